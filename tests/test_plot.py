"""The memory-vs-batch picture: a PNG drawn from a result alone, from the CLI or a function."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import ConfigError
from autotune.plot import render_plot
from autotune.results import ProbeResult

AUTOTUNE = str(Path(sys.executable).parent / "autotune")
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


def test_cli_plot_search_and_objective_flags(tmp_path: Path) -> None:
    target = tmp_path / "probe.png"
    proc = subprocess.run(
        [
            AUTOTUNE, "probe", "tests.predict_workloads:plain", "--device", "cpu", "--memory", "1MiB",
            "--headroom", "0", "--in-process", "--plot", str(target), "--objective", "throughput",
            "--effective-batch", "1000",
        ],
        capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes().startswith(PNG_MAGIC)
    assert "predicted" in proc.stdout and "throughput: micro-batch" in proc.stdout
    bad = subprocess.run(
        [AUTOTUNE, "probe", "gpt", "--device", "cpu", "--search", "guess"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--search 'guess' is not one of plain, predict" in bad.stderr
