"""What a replica asks Ray for: the device `auto` resolves to before the replicas start, and the
GPU share, refused where replicas sharing a GPU would overcommit its memory; and engine settings
the model refuses, refused by `loopserve serve --replicas` before Ray starts."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ray", reason="the replicas need the `ray` extra")
pytest.importorskip("fastapi", reason="the ingress needs the `serve` extra")

from loopserve.config import EngineConfig
from loopserve.entrypoints.cli import main
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.ray import app


def _config(**options: object) -> EngineConfig:
    return EngineConfig.from_options(model="ouro-tiny", **options)


@pytest.mark.parametrize("has_gpu", [True, False])
def test_auto_resolves_before_ray_starts(monkeypatch: pytest.MonkeyPatch, has_gpu: bool) -> None:
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(app.torch.cuda, "is_available", lambda: has_gpu)
    assert app.replica_device(_config(device="auto")) == ("cuda" if has_gpu else "cpu")
    assert app.replica_device(_config(device="cpu")) == "cpu"


@pytest.mark.parametrize("gpus", [0.0, 2.0])
def test_auto_follows_the_clusters_gpus(monkeypatch: pytest.MonkeyPatch, gpus: float) -> None:
    monkeypatch.setattr(app.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(app.ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": gpus})
    monkeypatch.setattr(app.torch.cuda, "is_available", lambda: not gpus)  # must not be asked
    assert app.replica_device(_config(device="auto")) == ("cuda" if gpus else "cpu")


def test_a_replica_takes_its_share_of_a_gpu() -> None:
    assert app.replica_gpus(_config(device="cuda"), 1.0) == {"num_gpus": 1.0}
    shared = _config(device="cuda", gpu_memory_utilization=0.45)
    assert app.replica_gpus(shared, 0.5) == {"num_gpus": 0.5}
    assert app.replica_gpus(_config(device="cpu"), 0.5) == {}


def test_a_share_that_would_overcommit_memory_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.45"):
        app.replica_gpus(_config(device="cuda"), 0.5)  # 0.9 of the GPU each, two per GPU


@pytest.mark.parametrize("share", [0.0, -1.0, 1.5])
def test_a_share_outside_one_gpu_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match=r"gpus_per_replica must be in \(0, 1\]"):
        app.replica_gpus(_config(device="cpu"), share)


@pytest.mark.parametrize(
    ("speculative_config", "message"),
    [
        ('{"draft_loops": 4}', r"draft_loops 4 must be below the model's loop count \(4\)"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ],
)
def test_a_bad_speculative_config_stops_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    speculative_config: str,
    message: str,
) -> None:
    """One the model refuses (its config.json has 4 loops) or a bad value: one line naming the
    flag. The model's refusal used to come from each replica's engine inside Ray, where Serve
    restarted the replicas until the deployment failed with a traceback."""

    def start(*args: object, **kwargs: object) -> None:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(app.ray, "init", start)
    argv = ["serve", "--replicas", "2", "--speculative-config", speculative_config]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("loopserve serve: error: speculative_config (--speculative-config) ")
    assert re.search(message, error) and error.count("\n") == 1, error


def test_replicas_refuse_an_engine_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replicas", "2", "--engine-process"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("loopserve serve: error: --engine-process is for the single-process")
    assert error.count("\n") == 1


@pytest.mark.parametrize(
    "flags", [[], ["--no-engine-process"]], ids=["default", "no-engine-process"]
)
def test_replicas_serve_with_the_default(monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> None:
    """The single-process server's default (an engine process) is no refusal: each replica keeps
    its engine in its actor process, and the server config the replicas get says so."""
    served: list[ServerConfig] = []

    def serve_replicas(engine: EngineConfig, config: ServerConfig, *args: object) -> None:
        served.append(config)

    monkeypatch.setattr(app, "serve_replicas", serve_replicas)
    assert main(["serve", "--replicas", "2", *flags]) == 0
    assert [config.engine_process for config in served] == [False]
