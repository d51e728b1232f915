"""Bad engine and server flags: one line naming the flag, exit code 2, before anything large is
allocated; the Python API's errors name both the field and its flag."""

from __future__ import annotations

import pytest
import torch

from loopserve.config import EngineConfig, SchedulerConfig
from loopserve.depth.trace import check_distribution
from loopserve.entrypoints.cli import main
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.runner import kv_budget


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--kv-cache-memory-gb", "inf"], "must be a finite number, got inf"),
        (["--kv-cache-memory-gb", "nan"], "must be a finite number, got nan"),
        (["--kv-cache-memory-gb", "-1"], "must be positive"),
        (["--kv-cache-memory-gb", "1e9"], "GiB of memory available"),
        (["--num-kv-pages", "100000000000"], "GiB of memory available"),
        (["--num-kv-pages", "1"], "must be at least 2"),
        (["--max-num-seqs", "100000000"], "request slots"),
        (["--max-num-seqs", "0"], "must be at least 1"),
        (["--swap-space-gb", "inf"], "must be a finite number"),
        (["--gpu-memory-utilization", "nan"], "must be a finite number"),
        (["--kv-watermark", "nan"], "must be a finite number"),
        (["--max-model-len", "1"], "must be at least 2"),
    ],
)  # fmt: skip
def test_engine_flag_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], words: str
) -> None:
    argv = ["generate", "--prompt", "a", "--max-tokens", "2", "--device", "cpu", *flags]
    err = _one_line_error(capsys, argv)
    assert err.startswith("loopserve generate: error: ")
    assert flags[0] in err and words in err, err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--trace-distribution", "0.5,0.5,0.5"], "must sum to 1"),
        (["--trace-distribution=-0.5,1.5"], "must be finite, >= 0"),
        (["--trace-distribution", "nan,1"], "must be finite, >= 0"),
        (["--trace-distribution", "0.2,0.2,0.2,0.2,0.2"], "at most 4 loops"),
    ],
)
def test_trace_distribution_must_be_probabilities_of_the_models_depths(
    capsys: pytest.CaptureFixture[str], flags: list[str], words: str
) -> None:
    argv = ["generate", "--prompt", "a", "--max-tokens", "2", "--exit-mode", "trace", *flags]
    err = _one_line_error(capsys, [*argv, "--device", "cpu"])
    assert "(--trace-distribution)" in err and words in err, err


def test_trace_depths_beyond_the_models_loops_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["generate", "--prompt", "a", "--max-tokens", "3", "--exit-mode", "trace"]
    err = _one_line_error(capsys, [*argv, "--trace-depths", "9,9", "--device", "cpu"])
    assert "trace_depths must each be in 1..4" in err and "[9, 9]" in err, err


@pytest.mark.parametrize(
    ("flags", "words", "not_blamed"),
    [
        (["--host", "999.1.1.1"], "--host '999.1.1.1' is not a valid address", "--port"),
        (["--host", "192.0.2.123"], "--host 192.0.2.123: no network interface", "--port"),
        (["--shutdown-timeout", "-1"], "(--shutdown-timeout) must be >= 0", "s must"),
        (["--port", "70000"], "(--port) must be in [0, 65535]", None),
        (["--max-request-bytes", "10"], "(--max-request-bytes) must be at least 1024", None),
    ],
)  # fmt: skip
def test_server_flag_errors_name_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], words: str, not_blamed: str | None
) -> None:
    pytest.importorskip("uvicorn", reason="serving needs the `serve` extra")
    err = _one_line_error(capsys, ["serve", "--device", "cpu", *flags])
    assert words in err, err
    if not_blamed is not None:
        assert not_blamed not in err, err


def test_python_errors_name_the_field_and_the_flag() -> None:
    with pytest.raises(ValueError, match=r"num_kv_pages \(--num-kv-pages\) must be at least 2"):
        EngineConfig(num_kv_pages=1)
    with pytest.raises(ValueError, match=r"seed \(--engine-seed\) must be a finite number"):
        EngineConfig(seed=float("inf"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"block_size \(--block-size\) must be at least 1"):
        SchedulerConfig(block_size=0)
    with pytest.raises(ValueError, match=r"shutdown_timeout_s \(--shutdown-timeout\)"):
        ServerConfig(shutdown_timeout_s=-1)
    with pytest.raises(ValueError, match=r"trace_distribution \(--trace-distribution\)"):
        SchedulerConfig(trace_distribution=(float("nan"), 1.0))


def test_python_trace_distributions_may_be_weights() -> None:
    """`EngineConfig` normalizes weights (callers pass a truncated d2.6, say); only the command
    line insists on probabilities."""
    assert SchedulerConfig(trace_distribution=(0.1, 0.4, 0.3)).trace_distribution == (0.1, 0.4, 0.3)
    check_distribution((0.25, 0.75), normalized=True)
    check_distribution((0.1, 0.4, 0.3, 0.2), normalized=True)  # float sums within 1e-6
    with pytest.raises(ValueError, match=r"sums to 0\.8"):
        check_distribution((0.1, 0.4, 0.3), normalized=True)


def test_swap_space_beyond_host_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_budget, "_available_memory", lambda: 8 << 30)
    config = EngineConfig(swap_space_gb=16)
    with pytest.raises(ValueError, match=r"swap_space_gb \(--swap-space-gb\) 16 GiB is more"):
        kv_budget.check_swap_space(config, torch.device("cuda", 0))
    kv_budget.check_swap_space(config, torch.device("cpu"))  # no pinned swap on the CPU
    kv_budget.check_swap_space(EngineConfig(swap_space_gb=4), torch.device("cuda", 0))


@pytest.mark.parametrize(
    "command", [["generate", "--prompt", "a"], ["eval", "perplexity"], ["bench", "offline"]]
)
def test_calculate_kv_scales_needs_an_fp8_kv_cache(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """Refused by name wherever the flag is taken, before any model loads."""
    err = _one_line_error(capsys, [*command, "--device", "cpu", "--calculate-kv-scales"])
    assert "--calculate-kv-scales" in err and "needs" in err, err
    assert "--kv-cache-dtype" in err and "fp8" in err, err
