"""The Ray Serve application: N engine replicas behind one ingress (needs the `ray` extra).

Owns: the only imports of Ray in loopserve; `build_app`, which makes `EngineReplica` and `Ingress`
deployments (replica i is the deployment `loopserve-engine-i`: one replica each, on CUDA one GPU
or a share of one, restarted by Serve when it dies or fails its health check, drained for
`shutdown_timeout_s` when it stops) and binds them into one application; and `serve_replicas`,
which `loopserve serve --replicas N` runs: start a local Ray cluster or join one, run the
application on the server's host and port, and on SIGTERM or Ctrl-C drain and remove it (and
shut Serve down on a cluster it started).
Must not: hold serving logic (the replica and ingress classes do).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
from typing import Any

import torch

from loopserve.config import EngineConfig
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.models.builtin import resolve_model_dir
from loopserve.ray.ingress import Ingress
from loopserve.ray.replica import EngineReplica
from loopserve.ray.routing import RoutingConfig
from loopserve.runner.setup import read_checked_model_config

try:
    import ray
    from ray import serve
except ImportError as error:
    raise ImportError(
        f"engine replicas need Ray Serve, which is not installed ({error}); "
        "run: pip install 'loopserve[ray]'"
    ) from error

APP_NAME = "loopserve"
# Seconds between Serve's calls of a replica's `check_health`, and how long one may take.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# Calls a deployment takes at once beyond the generation requests: polls, /metrics, /health.
_CONTROL_CALLS = 16


def build_app(
    engine_config: EngineConfig,
    server_config: ServerConfig | None = None,
    *,
    num_replicas: int = 1,
    gpus_per_replica: float = 1.0,
    routing: RoutingConfig | None = None,
    replica_actor_options: dict[str, Any] | None = None,
    ingress_actor_options: dict[str, Any] | None = None,
) -> serve.Application:
    """A Serve application serving the OpenAI API from `num_replicas` engine replicas.

    Args:
        engine_config: every replica's engine, as `Engine(engine_config)` would build it.
        server_config: the API's settings (key, limits, names); its host and port are used only
            by `serve_replicas` (Serve's HTTP options decide where an application listens).
        num_replicas: engine replicas, each its own deployment.
        gpus_per_replica: on CUDA, the share of one GPU a replica asks Ray for, in (0, 1]: 0.5
            puts two replicas on each GPU (each then needs `gpu_memory_utilization` ≤ 0.5).
        routing: the routing policy's knobs.
        replica_actor_options: Ray actor options merged over each replica's defaults
            (`num_cpus=1`, and `num_gpus=gpus_per_replica` when the engine's device is CUDA).
        ingress_actor_options: Ray actor options merged over the ingress's (`num_cpus=0`).
    Raises:
        ValueError: num_replicas is below 1, or the GPU share is out of range or too small for
            the engine's memory fraction.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    server_config = server_config or ServerConfig()
    routing = routing or RoutingConfig()
    engine_config = dataclasses.replace(engine_config, device=replica_device(engine_config))
    gpus = replica_gpus(engine_config, gpus_per_replica)
    replica_options = {"num_cpus": 1, **gpus, **(replica_actor_options or {})}
    replicas = [
        serve.deployment(
            name=f"loopserve-engine-{index}",
            num_replicas=1,
            max_ongoing_requests=server_config.max_concurrent_requests + _CONTROL_CALLS,
            ray_actor_options=replica_options,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            # The ingress logs every HTTP request; a line per forwarded call and poll is noise.
            logging_config={"enable_access_log": False},
            health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
            graceful_shutdown_wait_loop_s=1.0,
            graceful_shutdown_timeout_s=server_config.shutdown_timeout_s,
        )(EngineReplica).bind(index, engine_config, server_config)
        for index in range(num_replicas)
    ]
    ingress = serve.deployment(
        name="loopserve-ingress",
        max_ongoing_requests=server_config.max_concurrent_requests + _CONTROL_CALLS,
        ray_actor_options={"num_cpus": 0, **(ingress_actor_options or {})},
        graceful_shutdown_timeout_s=server_config.shutdown_timeout_s,
    )(serve.ingress()(Ingress))
    return ingress.bind(replicas, engine_config, server_config, routing)


def replica_device(engine_config: EngineConfig) -> str:
    """The device the replicas run on. `auto` is decided here, not in each replica (a replica
    that asks Ray for no GPU sees none): CUDA when the cluster has GPUs, or, before Ray has
    started, when this machine has one."""
    if engine_config.device != "auto":
        return engine_config.device
    if ray.is_initialized():
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    else:
        has_gpu = torch.cuda.is_available()
    return "cuda" if has_gpu else "cpu"


def replica_gpus(engine_config: EngineConfig, gpus_per_replica: float) -> dict[str, float]:
    """A replica's GPU request to Ray: `num_gpus` on CUDA (an engine runs on one GPU, so a share
    of at most one), nothing on a CPU. Replicas that share a GPU must also share its memory."""
    if not 0 < gpus_per_replica <= 1:
        raise ValueError(
            "gpus_per_replica must be in (0, 1] (an engine runs on one GPU), "
            f"got {gpus_per_replica}"
        )
    if not engine_config.device.startswith("cuda"):
        return {}
    if engine_config.gpu_memory_utilization > gpus_per_replica:
        raise ValueError(
            f"replicas with {gpus_per_replica} of a GPU each share its memory, but each would take "
            f"gpu_memory_utilization {engine_config.gpu_memory_utilization} of it; pass "
            f"--gpu-memory-utilization {0.9 * gpus_per_replica:.2f} (at most {gpus_per_replica})"
        )
    return {"num_gpus": gpus_per_replica}


def serve_replicas(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    num_replicas: int,
    ray_address: str | None = None,
    routing: RoutingConfig | None = None,
    gpus_per_replica: float = 1.0,
) -> None:
    """Serve on the server's host and port until SIGTERM or Ctrl-C, then drain and stop.

    Args:
        ray_address: a running cluster to join (`auto`, `ray://host:port`, ...); None starts a
            local one (with at least one CPU per replica).
    Raises:
        ValueError, FileNotFoundError: the model cannot be found, or `engine_config` asks for
            what its config.json refuses (a `speculative_config` whose draft_loops leaves no
            loop to check it, say): checked before Ray starts, as one engine would before its
            weights load, since a replica that refuses its config only fails inside Ray.
    """
    read_checked_model_config(engine_config, resolve_model_dir(engine_config.model))
    if ray_address is None:
        ray.init(num_cpus=max(os.cpu_count() or 1, num_replicas))
    else:
        ray.init(address=ray_address)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        port = server_config.port or free_port(server_config.host)
        serve.start(http_options={"host": server_config.host, "port": port})
        app = build_app(
            engine_config,
            server_config,
            num_replicas=num_replicas,
            gpus_per_replica=gpus_per_replica,
            routing=routing,
        )
        serve.run(app, name=APP_NAME, route_prefix="/")
        address = f"http://{server_config.host}:{port}"
        # the same line as one engine's server prints, so scripts find the address either way
        print(
            f"loopserve serve: listening on {address} ({num_replicas} engine replica(s))",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        # Both drain: each replica finishes its requests (up to shutdown_timeout_s) and stops.
        if ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)  # a joined cluster's other applications keep running


def free_port(host: str) -> int:
    """A port nobody listens on at `host`, for `--port 0` (Serve's proxy binds the port itself,
    so it is found by binding and closing a socket: another process could take it in between)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
    return port
