"""The memory-vs-batch picture: a PNG drawn from a result alone, from the CLI or a function."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import ConfigError
from autotune.plot import draw, render_plot
from autotune.results import ProbeResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 2**20


def _size(png: bytes) -> tuple[int, int]:
    from matplotlib import image

    pixels = image.imread(io.BytesIO(png), format="png")
    return pixels.shape[1], pixels.shape[0]


@pytest.mark.parametrize("search", ["predict", "plain"])
def test_render_plot_returns_a_png_for_any_search(search: str) -> None:
    result = run_probe(
        ProbeRequest(target="tests.predict_workloads:plain", device="cpu", memory=MIB, headroom=0, search=search)
    )
    png = render_plot(result)
    assert png.startswith(PNG_MAGIC)
    assert _size(png) == (1000, 560)


def test_a_stored_result_renders_without_torch_state() -> None:
    """The service renders results it stored as JSON: the round trip draws the same picture."""
    result = run_probe(ProbeRequest(target="tests.predict_workloads:plain", device="cpu", memory=MIB, headroom=0))
    stored = ProbeResult.model_validate_json(result.model_dump_json())
    assert render_plot(stored) == render_plot(result)


def test_missing_matplotlib_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = run_probe(ProbeRequest(target="tests.predict_workloads:plain", device="cpu", memory=MIB, headroom=0))
    with pytest.raises(ConfigError, match=r"autotune\[plot\]"):
        render_plot(result)


def test_cli_plot_search_and_objective_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI's entry point in this process: its confirmations fork from the server this
    process's probes share (the CLI as a process of its own is test_cli's)."""
    from autotune import cli

    target = tmp_path / "probe.png"
    code = cli.run(
        [
            "probe", "tests.predict_workloads:plain", "--device", "cpu", "--memory", "1MiB",
            "--headroom", "0", "--in-process", "--plot", str(target), "--objective", "throughput",
            "--effective-batch", "1000",
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert target.read_bytes().startswith(PNG_MAGIC)
    assert "predicted" in out and "throughput: micro-batch" in out
    assert cli.run(["probe", "gpt", "--device", "cpu", "--search", "guess"]) == 2
    assert "--search 'guess' is not one of plain, predict" in capsys.readouterr().err


def _loop_artists(figure: Any, name: str) -> dict[str, Any]:
    """The main axes' lines and point sets whose label names the loop, by the rest of the label."""
    ax = figure.axes[0]
    return {
        str(a.get_label()).removeprefix(f"{name}: "): a
        for a in [*ax.lines, *ax.collections]
        if str(a.get_label()).startswith(f"{name}: ")
    }


def _points(artist: Any) -> list[tuple[float, float]]:
    return sorted((float(x), float(y)) for x, y in artist.get_offsets())


def test_the_plot_draws_both_loops_apart_with_a_legend() -> None:
    """Each loop's trials (fitting and out-of-memory), predicted curve and answer, in a colour of its
    own, and a legend naming both loops and both answers."""
    from matplotlib.colors import to_hex

    result = run_probe(ProbeRequest(target="tests.predict_workloads:plain", device="cpu", memory=MIB, headroom=0))
    one, accumulating = result.answers
    assert not one.loop.accumulates and accumulating.loop.accumulates
    assert result.max_micro_batch != result.max_micro_batch_without_accumulation  # two answers to tell apart
    figure = draw(result)
    colours = {}
    for answer, name, found in (
        (one, "without accumulation", result.max_micro_batch_without_accumulation),
        (accumulating, "with accumulation", result.max_micro_batch),
    ):
        drawn = _loop_artists(figure, name)
        trials = result.loop_trials(answer.loop.micro_steps)
        for label, fits in (("trial fits (peak)", True), ("trial out of memory", False)):
            expected = sorted((t.batch, t.peak_reserved_bytes / MIB) for t in trials if t.fits is fits)
            assert expected, f"{name} has no {label}"
            assert _points(drawn[label]) == expected
        assert answer.prediction is not None
        assert list(drawn["predicted peak"].get_xdata()) == [p.batch for p in answer.prediction.curve]
        assert list(drawn[f"answer {found}"].get_xdata()) == [found, found]
        loop_colours = {to_hex(drawn["predicted peak"].get_color()), to_hex(drawn[f"answer {found}"].get_color())}
        loop_colours |= {
            to_hex(c) for label in ("trial fits (peak)", "trial out of memory") for c in drawn[label].get_facecolor()
        }
        assert len(loop_colours) == 1, (name, loop_colours)
        colours[name] = loop_colours.pop()
    assert colours["without accumulation"] != colours["with accumulation"]
    ax = figure.axes[0]
    shown = [t.get_text() for t in ax.get_legend().get_texts()]
    for words in (
        "without accumulation",
        "with accumulation",
        f"answer {result.max_micro_batch_without_accumulation}",
        f"answer {result.max_micro_batch}",
        "budget",
    ):
        assert words in shown, (words, shown)
    one_answer, accumulating_answer = result.max_micro_batch_without_accumulation, result.max_micro_batch
    assert ax.get_title().endswith(f": {one_answer} without accumulation, {accumulating_answer} with accumulation")
    assert render_plot(result).startswith(PNG_MAGIC)


def test_the_plot_says_when_no_size_fits_with_accumulation() -> None:
    """wide at 40 MiB: one micro-step fits up to 511, accumulation's second gradient leaves room for none."""
    result = run_probe(ProbeRequest(target="tests.workloads:wide", device="cpu", memory=40 * MIB, headroom=0))
    assert result.max_micro_batch is None and result.max_micro_batch_without_accumulation is not None
    figure = draw(result)
    failed = _loop_artists(figure, "with accumulation")
    assert set(failed) == {"trial out of memory"}  # its trials, and no answer line
    assert _points(failed["trial out of memory"]) == sorted(
        (t.batch, t.peak_reserved_bytes / MIB) for t in result.loop_trials(2)
    )
    assert "none fits" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert (
        figure.axes[0]
        .get_title()
        .endswith(f": {result.max_micro_batch_without_accumulation} without accumulation, none fits with accumulation")
    )
    assert render_plot(result).startswith(PNG_MAGIC)
