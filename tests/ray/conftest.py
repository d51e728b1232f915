"""The Ray tests' fleets: a local Ray cluster started once for the package (Ray takes seconds to
start), on which a test module runs its fleet, two CPU engine replicas of the built-in model
behind one ingress (one fleet at a time: each is the application `loopserve` at `/`), and a
single-process server with the same engine settings for reference."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the Ray tests need the `ray` extra (pip install .[ray])")
pytest.importorskip("fastapi", reason="the Ray tests need the `serve` extra")

from loopserve.models.builtin import BUILTIN_MODEL_DIR

from ..server.server_testing import RunningServer, free_port, serve_in_thread

API_KEY = "fleet-key"
NUM_REPLICAS = 2
APP_NAME = "loopserve"
# The engine settings of every replica and of the reference server.
ENGINE_OPTIONS = {"num_kv_pages": 1024, "max_num_seqs": 32, "seed": 0}


@pytest.fixture(scope="package")
def serve_port() -> Iterator[int]:
    """The port of Serve's HTTP proxy on a local Ray cluster, for the package's fleets."""
    import ray
    from ray import serve

    # Serve kills an HTTP proxy that is not ready within 3 checks of 5 s; a loaded machine can
    # take longer to start one (the raylet's workers inherit this environment).
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    # Two replicas and the ingress on 2 cores: Ray's CPUs are a scheduling count, not cores.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def running_fleet(
    port: int, engine_options: dict[str, Any], route_prefix: str = "/"
) -> Iterator[RunningServer]:
    """`NUM_REPLICAS` replicas with `engine_options` behind the ingress on `port` at
    `route_prefix`, until the block ends (then the application is deleted: its replicas drain
    and stop)."""
    from ray import serve

    from loopserve.config import EngineConfig
    from loopserve.entrypoints.openai.config import ServerConfig
    from loopserve.ray import build_app
    from loopserve.ray.routing import RoutingConfig

    app = build_app(
        EngineConfig.from_options(model=str(BUILTIN_MODEL_DIR), **engine_options),
        ServerConfig(served_model_names=("tiny",), api_key=API_KEY, shutdown_timeout_s=2),
        num_replicas=NUM_REPLICAS,
        routing=RoutingConfig(poll_interval_s=0.2),
        # One intra-op thread per replica process, as the test process itself runs.
        replica_actor_options={
            "num_cpus": 1,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}},
        },
    )
    serve.run(app, name=APP_NAME, route_prefix=route_prefix)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}", API_KEY)
    finally:
        serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def fleet(serve_port: int) -> Iterator[RunningServer]:
    with running_fleet(serve_port, ENGINE_OPTIONS) as running:
        yield running


@pytest.fixture(scope="package")
def reference() -> Iterator[RunningServer]:
    """One engine in this process, with the replicas' settings."""
    with serve_in_thread(BUILTIN_MODEL_DIR, engine=ENGINE_OPTIONS, api_key=API_KEY) as running:
        yield running
