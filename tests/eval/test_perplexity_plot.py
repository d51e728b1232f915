"""`--plot` without matplotlib fails at once, in one line naming `--plot` and the extra to install,
before anything is evaluated; and the thresholds of the plot are told apart in its legend, so
close ones (0.9 and 0.95) do not write over each other."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loopserve.entrypoints.cli import main
from loopserve.eval.perplexity import CurvePoint


def _no_evaluation(*args: object, **kwargs: object) -> None:
    raise AssertionError("evaluated although --plot cannot be drawn")


@pytest.mark.parametrize("command", ["perplexity", "plot"])
def test_plot_without_matplotlib_fails_before_evaluating(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr("loopserve.eval.perplexity.held_out_windows", _no_evaluation)
    monkeypatch.setattr("loopserve.models.loader.load_checkpoint", _no_evaluation)
    curve = tmp_path / "curve.json"
    curve.write_text('{"points": []}')
    argv = {
        "perplexity": ["eval", "perplexity", "--plot", str(tmp_path / "curve.png")],
        "plot": ["eval", "plot", str(curve), str(tmp_path / "curve.png")],
    }[command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert "--plot" in line and "pip install 'loopserve[plot]'" in line
    assert captured.out == ""  # no table: nothing ran


def test_close_thresholds_are_told_apart_in_the_legend() -> None:
    pytest.importorskip("matplotlib", reason="the plot is optional (loopserve[plot])")
    from loopserve.eval.plot import draw_curve, require_matplotlib

    points = [CurvePoint("fixed depth 4", 1.0, 4, 1, 100, 0.8, 2.2, 4.0, [0, 0, 0, 100])]
    for threshold, depth in ((0.95, 3.91), (0.9, 3.9), (0.5, 2.5)):
        points.append(
            CurvePoint(f"threshold {threshold}", threshold, 4, 1, 100, 0.8, 2.3, depth, [25] * 4)
        )
    figure = draw_curve(points, "test")
    quality = figure.axes[0]
    assert not quality.texts  # no labels next to the points, where close ones would collide
    labels = [text.get_text() for text in quality.get_legend().get_texts()]
    assert labels == ["fixed depth", "exit gate 0.95", "exit gate 0.9", "exit gate 0.5"]
    colours = {tuple(line.get_color()) for line in quality.get_lines()[1:]}
    assert len(colours) == 3
    figure.canvas.draw()
    boxes = [text.get_window_extent() for text in quality.get_legend().get_texts()]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    require_matplotlib().close(figure)
