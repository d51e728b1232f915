"""The perplexity curve: its settings, its aggregation, its plot and `loopserve eval perplexity`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loopserve.entrypoints.cli import main
from loopserve.eval.early_exit_perplexity import ExitSettings, score_windows
from loopserve.eval.perplexity import CurvePoint, curve_settings, evaluate_setting
from loopserve.models.checkpoint_writer import RandomInit, random_state_dict
from loopserve.models.families import preset_config
from loopserve.models.ouro import OuroForCausalLM


@pytest.fixture(scope="module")
def model() -> OuroForCausalLM:
    config = preset_config("tiny")
    model = OuroForCausalLM(config)
    init = RandomInit(gate_scale=2.0, gate_bias=-1.0)
    model.load_state_dict(random_state_dict(config, seed=2, init=init), strict=False)
    return model.eval()


def test_curve_settings_cover_fixed_depths_then_thresholds() -> None:
    settings = curve_settings(4, [1.0, 0.9, 0.5], fixed_depths=True, min_loops=2)
    assert [(s.exit_threshold, s.max_loops, s.min_loops) for s in settings] == [
        (1.0, 1, 1),
        (1.0, 2, 1),
        (1.0, 3, 1),
        (1.0, 4, 1),
        (0.9, 4, 2),
        (0.5, 4, 2),
    ]
    only_gated = curve_settings(4, [1.0, 0.7], fixed_depths=False)
    assert [(s.exit_threshold, s.max_loops) for s in only_gated] == [(1.0, 4), (0.7, 4)]


def test_a_point_aggregates_every_window(model: OuroForCausalLM) -> None:
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, model.config.vocab_size, (5, 17), generator=generator)
    settings = ExitSettings(0.6, max_loops=4)
    point = evaluate_setting(model, windows, settings, batch_size=2)
    scores = score_windows(model, windows, settings)  # all five at once
    assert point.tokens == 5 * 16 == sum(point.depth_histogram)
    assert len(point.depth_histogram) == 4
    expected_nll = -scores.logprobs.double().mean().item()
    assert math.isclose(point.mean_nll, expected_nll, rel_tol=1e-6)
    assert math.isclose(point.perplexity, math.exp(expected_nll), rel_tol=1e-6)
    assert math.isclose(point.mean_depth, scores.exit_depths.double().mean().item(), rel_tol=1e-9)
    fixed = evaluate_setting(model, windows, ExitSettings(1.0, max_loops=2), batch_size=5)
    assert fixed.depth_histogram == [0, 80]
    assert fixed.label == "fixed depth 2" and point.label == "threshold 0.6"


def test_plot_writes_an_image(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot is optional (loopserve[plot])")
    from loopserve.eval.plot import plot_curve

    points = [
        CurvePoint(f"fixed depth {d}", 1.0, d, 1, 100, 3.0 - 0.2 * d, 0.0, float(d), [0] * 4)
        for d in range(1, 5)
    ]
    points.append(CurvePoint("threshold 0.5", 0.5, 4, 1, 100, 2.3, 10.0, 2.5, [30, 20, 20, 30]))
    path = plot_curve(points, tmp_path / "curve.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_on_the_builtin_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "curve.json"
    argv = ["eval", "perplexity", "--thresholds", "0.5", "--no-fixed-depths", "--seq-len", "64"]
    assert main([*argv, "--max-tokens", "128", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["windows"] == [2, 65]
    (point,) = report["points"]
    assert point["exit_threshold"] == 0.5 and point["tokens"] == 128
    assert sum(point["depth_histogram"]) == 128
    assert "threshold 0.5" in capsys.readouterr().out


def test_cli_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "perplexity", "--thresholds", "half"]) == 2
    assert "comma-separated numbers" in capsys.readouterr().err
    assert main(["eval", "perplexity", "--model", str(tmp_path / "nothing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_max_tokens_below_one_window_says_which_flag_to_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["eval", "perplexity", "--max-tokens", "64"]) == 2  # the trained window is 512
    error = capsys.readouterr().err
    assert "--max-tokens 64 is less than one window of --seq-len 512" in error


@pytest.mark.parametrize("skip_norm", [False, True])
def test_a_gateless_family_scores_as_the_dense_forward(skip_norm: bool) -> None:
    """Nanbeige at each fixed depth: the teacher-forced scores are the cache-free forward's."""
    from loopserve.models.loader import build_model
    from loopserve.reference import dense_logits

    config = preset_config("nanbeige-tiny", {"num_loops": 3, "skip_loop_final_norm": skip_norm})
    nanbeige = build_model(config)
    nanbeige.load_state_dict(random_state_dict(config, seed=4))
    windows = torch.randint(
        0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1)
    )
    for depth in (1, 3):
        scores = score_windows(nanbeige.eval(), windows, ExitSettings(1.0, max_loops=depth))
        logits = dense_logits(nanbeige, windows[0].tolist(), depth)
        expected = logits.log_softmax(-1)[:-1].gather(1, windows[0, 1:, None]).squeeze(-1)
        torch.testing.assert_close(scores.logprobs[0], expected, rtol=1e-5, atol=1e-5)
        assert scores.exit_depths.eq(depth).all()
