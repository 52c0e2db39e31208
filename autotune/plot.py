"""The memory-vs-batch picture of a probe result, as PNG bytes.

`render_plot(result)` draws each trial's peak (fitting and out-of-memory trials apart), the
predicted peak-memory curve when the predictor ran, the budget and the limit (budget minus
headroom), and the answer. It only reads a `ProbeResult`, so the CLI (`--plot probe.png`) and the
service (`GET /v1/probes/{id}/plot.png`) draw the same picture of a stored result.

matplotlib is an optional extra (`pip install autotune[plot]`): it is imported when a plot is
asked for, and its absence is a ConfigError with the install hint. We draw on a `Figure` with the
Agg canvas, never through pyplot, so nothing global is touched and threads can render at once.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.results import ProbeResult
from autotune.units import format_bytes

MIB = 2**20
FORMATS = (".png",)  # what render_plot draws; the service serves the same PNG


def require_matplotlib() -> None:
    """Fail fast (before a probe runs) when the plot extra is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'autotune[plot]'") from None


def _figure() -> Any:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _mib(n: int | None) -> float:
    return (n or 0) / MIB


def render_plot(result: ProbeResult) -> bytes:
    """A PNG of the result's trials, predicted curve, budget, limit and answer."""
    figure = _figure()
    ax = figure.add_subplot(1, 1, 1)
    prediction = result.prediction
    if prediction is not None and prediction.curve:
        ax.plot(
            [p.batch for p in prediction.curve],
            [_mib(p.peak_bytes) for p in prediction.curve],
            color="tab:blue",
            linewidth=1.5,
            label="predicted peak",
        )
    # The answer's loop shape only: its trials and its predicted curve describe one loop.
    # On CUDA the limit applies to reserved memory; on the budget device reserved == allocated.
    shown = result.loop_trials()
    fits = [t for t in shown if t.fits]
    fails = [t for t in shown if not t.fits]
    if fits:
        ax.scatter(
            [t.batch for t in fits],
            [_mib(t.peak_reserved_bytes) for t in fits],
            color="tab:green",
            marker="o",
            zorder=3,
            label="trial fits (peak)",
        )
    if fails:
        ax.scatter(
            [t.batch for t in fails],
            [_mib(t.peak_reserved_bytes) for t in fails],
            color="tab:red",
            marker="x",
            zorder=3,
            label="trial out of memory (at the failing op)",
        )
    ax.axhline(_mib(result.budget_bytes), color="black", linestyle="-", linewidth=1, label="budget")
    ax.axhline(
        _mib(result.limit_bytes),
        color="tab:orange",
        linestyle="--",
        linewidth=1,
        label=f"limit (budget − headroom {format_bytes(result.headroom_bytes)})",
    )
    ax.axvline(
        result.max_micro_batch,
        color="tab:purple",
        linestyle=":",
        linewidth=1.5,
        label=f"answer: {result.max_micro_batch}" + (" (capped)" if result.capped else ""),
    )
    loop = "with accumulation" if result.loop.accumulates else "one micro-step"
    title = f"{result.workload.target} on {result.device.name} ({loop})"
    if prediction is not None and prediction.predicted_max_micro_batch is not None:
        title += f" — predicted {prediction.predicted_max_micro_batch}, found {result.max_micro_batch}"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def check_plot_path(path: str | Path, flag: str = "--plot") -> Path:
    """The path a plot will be written to, refused now (before a probe spends minutes) when it
    cannot be: empty, not a .png, a directory, in a directory that does not exist or that this user
    cannot write. A ConfigError names `flag` and says what to do."""
    text = str(path)
    if not text.strip():
        raise ConfigError(f"{flag} is empty: give the PNG file to write, for example {flag} probe.png")
    target = Path(text).expanduser()
    if target.is_dir():
        raise ConfigError(f"{flag} {text!r} is a directory: name a file in it, for example {target / 'probe.png'}")
    if target.suffix.lower() not in FORMATS:
        shown = f"the extension {target.suffix!r}" if target.suffix else "no extension"
        raise ConfigError(
            f"{flag} {text!r} has {shown}: the plot is a PNG, so name the file {target.with_suffix('.png')}"
        )
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{flag} {text!r}: {parent} {what}: create it first or write the plot elsewhere")
    # Open it as the write will (permissions, a read-only file system, /proc), leaving no trace.
    existed = target.exists()
    try:
        with open(target, "ab" if existed else "xb"):
            pass
        if not existed:
            target.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {text!r} cannot be written: {exc.strerror or exc}; choose another path") from None
    return target


def write_plot(result: ProbeResult, path: str | Path) -> Path:
    """Render and write the PNG; returns the path written. An unwritable path is a ConfigError."""
    target = Path(path).expanduser()
    png = render_plot(result)
    try:
        target.write_bytes(png)
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to {str(path)!r}: {exc.strerror or exc}") from None
    return target
