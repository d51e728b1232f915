"""The fleet's routing policy, without Ray: prefix affinity, load balance, failed replicas."""

from __future__ import annotations

import sys

import pytest

from loopserve.engine.prefix_cache import block_hashes
from loopserve.ray.fleet import Fleet, ReplicaReport
from loopserve.ray.routing import (
    Decision,
    NoHealthyReplicaError,
    ReplicaLoad,
    RoutingConfig,
    RoutingPolicy,
    affinity_key,
)


def _load(replica: int, rows: int = 0, pages: int = 0, healthy: bool = True) -> ReplicaLoad:
    return ReplicaLoad(replica, healthy, rows, max_rows=10, kv_pages_used=pages, kv_pages_total=100)


def _affine(key: bytes, replicas: int) -> int:
    policy = RoutingPolicy(RoutingConfig())
    return policy.choose(key, [_load(index) for index in range(replicas)]).replica


def test_the_key_is_the_prefix_caches_hash_of_the_first_full_pages() -> None:
    tokens = list(range(100))
    assert affinity_key(tokens, 16, 4) == block_hashes(tokens[:64], 16)[-1]
    assert affinity_key(tokens, 16, 4) == affinity_key([*tokens[:64], 7, 7, 7], 16, 4)
    assert affinity_key(tokens[:40], 16, 4) == block_hashes(tokens, 16)[1]  # two full pages
    assert affinity_key(tokens[:15], 16, 4) is None
    assert affinity_key(tokens, 16, 0) is None


def test_one_key_always_goes_to_one_replica_and_keys_spread() -> None:
    keys = [affinity_key([index] * 16, 16, 1) for index in range(200)]
    chosen = [_affine(key, 4) for key in keys if key is not None]
    assert chosen == [_affine(key, 4) for key in keys if key is not None]
    assert all(chosen.count(replica) > 20 for replica in range(4))


def test_a_saturated_affine_replica_sends_the_request_to_the_least_loaded() -> None:
    key = affinity_key([1] * 16, 16, 1)
    assert key is not None
    affine = _affine(key, 3)
    policy = RoutingPolicy(RoutingConfig(saturation=0.8, max_imbalance=1.0))
    loads = [_load(index, rows=3) for index in range(3)]
    loads[affine] = _load(affine, rows=9)  # 0.9 >= saturation
    least = (affine + 1) % 3
    loads[least] = _load(least, rows=1)
    assert policy.choose(key, loads) == Decision(least, "saturated")
    loads[affine] = _load(affine, pages=85)  # KV pages count too
    assert policy.choose(key, loads) == Decision(least, "saturated")
    loads[affine] = _load(affine, rows=7)  # busy but below saturation: affinity holds
    assert policy.choose(key, loads) == Decision(affine, "affinity")


def test_an_imbalanced_affine_replica_is_passed_over() -> None:
    key = affinity_key([2] * 16, 16, 1)
    assert key is not None
    affine = _affine(key, 2)
    policy = RoutingPolicy(RoutingConfig(saturation=1.0, max_imbalance=0.3))
    loads = [_load(0), _load(1)]
    loads[affine] = _load(affine, rows=4)
    assert policy.choose(key, loads) == Decision(1 - affine, "saturated")
    loads[affine] = _load(affine, rows=3)
    assert policy.choose(key, loads) == Decision(affine, "affinity")


def test_without_a_key_the_least_loaded_replica_wins_and_ties_rotate() -> None:
    policy = RoutingPolicy(RoutingConfig())
    assert policy.choose(None, [_load(0, rows=5), _load(1, rows=2)]) == Decision(1, "least_loaded")
    tied = [_load(0), _load(1), _load(2)]
    assert {policy.choose(None, tied).replica for _ in range(3)} == {0, 1, 2}


def test_zero_affinity_pages_routes_by_load_only() -> None:
    """`--affinity-pages 0`: prompts have no key, so a shared prefix spreads like any prompt."""
    config = RoutingConfig(affinity_pages=0)
    policy = RoutingPolicy(config)
    shared = [5] * 64  # four full pages of one shared prefix
    key = affinity_key(shared, 16, config.affinity_pages)
    assert key is None
    tied = [_load(index) for index in range(2)]
    chosen = [policy.choose(key, tied) for _ in range(4)]
    assert {decision.reason for decision in chosen} == {"least_loaded"}
    assert {decision.replica for decision in chosen} == {0, 1}
    assert policy.choose(key, [_load(0, rows=1), _load(1, rows=6)]) == Decision(0, "least_loaded")
    # The same prompts with affinity on all go to one replica while it is not too busy.
    keyed = affinity_key(shared, 16, RoutingConfig().affinity_pages)
    assert keyed is not None
    on = RoutingPolicy(RoutingConfig())
    assert len({on.choose(keyed, tied).replica for _ in range(4)}) == 1


def test_a_failed_replica_gets_nothing_and_its_keys_move_elsewhere_only() -> None:
    policy = RoutingPolicy(RoutingConfig())
    keys = [key for index in range(100) if (key := affinity_key([index] * 16, 16, 1))]
    before = [policy.choose(key, [_load(index) for index in range(3)]).replica for key in keys]
    down = [_load(0, healthy=False), _load(1), _load(2)]
    after = [policy.choose(key, down).replica for key in keys]
    assert 0 not in after
    assert all(old == new for old, new in zip(before, after, strict=True) if old != 0)
    assert policy.choose(None, [_load(0, healthy=False), _load(1, rows=9)]).replica == 1
    with pytest.raises(NoHealthyReplicaError):
        policy.choose(None, [_load(0, healthy=False)])


def test_the_config_refuses_bad_knobs() -> None:
    for bad in ({"affinity_pages": -1}, {"saturation": 0}, {"max_imbalance": -0.1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RoutingConfig(**bad)  # type: ignore[arg-type]


def _report(replica: int, running: int, healthy: bool = True) -> ReplicaReport:
    return ReplicaReport(
        replica, 1, healthy, running, 0, 10, 0, 100, 0, 0, 0, 0, 0, 0, 0, {}, 0.0, 0
    )


def test_the_fleet_counts_in_flight_requests_and_routes_around_failures() -> None:
    fleet = Fleet(2)
    assert [load.healthy for load in fleet.loads()] == [False, False]  # no report yet
    fleet.update(_report(0, running=1))
    fleet.update(_report(1, running=0))
    for _ in range(3):
        fleet.begin(Decision(1, "least_loaded"))
    assert [load.rows for load in fleet.loads()] == [1, 3]  # in flight beats a stale report
    fleet.end(1)
    fleet.mark_down(0)
    assert [load.healthy for load in fleet.loads()] == [False, True]
    fleet.update(_report(0, running=0))
    assert fleet.is_up(0)
    fleet.update(_report(0, running=0, healthy=False))  # the engine thread died
    assert not fleet.is_up(0)
    assert fleet.routed[1, "least_loaded"] == 3


def test_serve_replicas_without_ray_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopserve.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    monkeypatch.delitem(sys.modules, "loopserve.ray.app", raising=False)
    assert main(["serve", "--replicas", "2"]) == 2
    error = capsys.readouterr().err
    assert "--replicas" in error and "pip install 'loopserve[ray]'" in error


def test_the_fleet_and_one_server_describe_shared_metrics_alike() -> None:
    """Every HELP / TYPE pair of both `/metrics` comes from `metrics.METRICS`, once per metric,
    so a metric both expose is described identically."""
    from loopserve.engine.engine import EngineStats
    from loopserve.entrypoints.openai.metrics import METRICS, ServerMetrics
    from loopserve.ray.fleet_metrics import render_fleet

    fleet = Fleet(2)
    fleet.update(_report(0, running=2))
    fleet.update(_report(1, running=1))
    stats = EngineStats(**{name: 0 for name in EngineStats.__dataclass_fields__})
    texts = (render_fleet(fleet), ServerMetrics(num_loops=4).render(stats))
    described: list[set[str]] = []
    for text in texts:
        helps = [line for line in text.splitlines() if line.startswith("# HELP ")]
        names = [line.split()[2].removeprefix("loopserve:") for line in helps]
        assert len(names) == len(set(names))
        for line, name in zip(helps, names, strict=True):
            kind, help_text = METRICS[name]
            assert line == f"# HELP loopserve:{name} {help_text}"
            assert f"# TYPE loopserve:{name} {kind}" in text
        described.append(set(names))
    fleet_names, server_names = described
    assert {"num_requests_running", "requests_finished_total"} <= fleet_names & server_names
    assert "loopserve:num_requests_running 3" in texts[0]
