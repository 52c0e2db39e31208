"""The memory-vs-batch picture of a probe result, as PNG (or JPEG, SVG, PDF) bytes.

`render_plot(result)` draws both loops a probe answers for, one colour each (one micro-step per
optimizer step, and accumulation): each trial's peak (fitting and out-of-memory trials apart), the
predicted peak-memory curve when the predictor ran, and the answer; then the budget and the limit
(budget minus headroom); beside it, a stacked bar of what filled the memory at the answer's peak
(parameters, gradients, optimizer state, activations and temporaries) when the result has it. The
legends sit below the axes, outside the data, so they never cover the answers. It only reads a
`ProbeResult`, so the CLI (`--plot probe.png`) and the service (`GET /v1/probes/{id}/plot.png`,
always PNG) draw the same picture of a stored result. `--plot` writes the format its extension
names (`FORMATS`) and refuses any other before the probe starts.

matplotlib is an optional extra (`pip install autotune[plot]`): it is imported when a plot is
asked for, and its absence is a ConfigError with the install hint. We draw on a `Figure` with the
Agg canvas, never through pyplot, so nothing global is touched and threads can render at once.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.results import LoopAnswer, LoopShape, MemoryBreakdown, ProbeResult, TrialRecord
from autotune.units import format_bytes

MIB = 2**20
# The extensions --plot accepts and the format each is written in; the service serves PNG.
FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".svg": "svg", ".pdf": "pdf"}
# Colours of the breakdown's parts (MemoryBreakdown.parts' order).
PART_COLORS = ("tab:gray", "tab:olive", "tab:brown", "tab:cyan")
# Each loop's colour and marker of a fitting trial, in the result's order of answers (one
# micro-step, accumulation, then any loop a framework's plan was settled in); marker shapes tell
# the loops apart without colour too.
LOOP_STYLES = (("tab:blue", "o"), ("tab:green", "s"), ("tab:purple", "^"), ("tab:pink", "D"))
# The colours of the checkpointing settings compared and not chosen (`--checkpointing auto`).
CANDIDATE_COLORS = ("tab:red", "tab:olive", "tab:cyan", "tab:gray")


def require_matplotlib() -> None:
    """Fail fast (before a probe runs) when the plot extra is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'autotune[plot]'") from None


def _figure(width: float = 10) -> Any:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, 5.6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _mib(n: int | None) -> float:
    return (n or 0) / MIB


def _scatter(ax: Any, trials: list[TrialRecord], color: Any, marker: str, label: str) -> Any:
    """Each trial at its batch and reserved peak (on the budget device reserved equals allocated)."""
    return ax.scatter(
        [t.batch for t in trials],
        [_mib(t.peak_reserved_bytes) for t in trials],
        color=color,
        marker=marker,
        zorder=3,
        label=label,
    )


def render_plot(result: ProbeResult, format: str = "png") -> bytes:
    """The picture of the result's trials, predicted curves and answers for each loop, the budget
    and limit, and the memory breakdown at the answer; PNG unless `format` names another (a value
    of FORMATS)."""
    figure = draw(result)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=format)
    return buffer.getvalue()


def _loops(result: ProbeResult) -> list[LoopAnswer]:
    if result.answers:
        return result.answers
    # A result with no per-loop answers (stored before they were recorded): its own loop alone.
    return [
        LoopAnswer(
            loop=result.loop, max_micro_batch=result.max_micro_batch, capped=result.capped, prediction=result.prediction
        )
    ]


def _answer(result: ProbeResult, answer: LoopAnswer) -> tuple[int | None, bool]:
    """A loop's answer as the result gives it now (a fresh-process confirmation or a failed run may
    have lowered it since the search), and whether it is the cap."""
    if answer.loop == result.loop:
        return result.max_micro_batch, result.capped
    if not answer.loop.accumulates:
        return result.max_micro_batch_without_accumulation, answer.capped
    return answer.max_micro_batch, answer.capped


def _loop_name(loop: LoopShape, first_accumulating: bool) -> str:
    """As the summary says it: two micro-steps stand for any number."""
    if not loop.accumulates:
        return "without accumulation"
    return "with accumulation" if first_accumulating else f"with {loop.micro_steps} accumulated micro-steps"


def draw(result: ProbeResult) -> Any:
    """The result's picture as a matplotlib `Figure` (render_plot writes it). Every artist's label
    names its loop; the legend has a column per loop, headed by its name, and one for the lines
    common to both."""
    others = 0 if result.checkpointing is None else len(result.checkpointing.candidates) - 1
    figure = _figure(10 + 2.5 * others)  # first: without matplotlib, the ConfigError with the install hint
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    breakdown = result.breakdown
    if breakdown is None:
        ax = figure.add_subplot(1, 1, 1)
    else:
        grid = figure.add_gridspec(1, 2, width_ratios=(4, 1))
        ax = figure.add_subplot(grid[0, 0])
        _draw_breakdown(figure.add_subplot(grid[0, 1], sharey=ax), result, breakdown)
    blank = Line2D([], [], linestyle="none")  # a column's heading, or the space below a short column
    columns: list[list[tuple[Any, str]]] = []
    said: list[str] = []
    named_accumulation = False
    for answer, (color, marker) in zip(_loops(result), LOOP_STYLES, strict=False):
        name = _loop_name(answer.loop, not named_accumulation)
        named_accumulation = named_accumulation or answer.loop.accumulates
        column: list[tuple[Any, str]] = [(blank, name)]
        columns.append(column)
        prediction = answer.prediction
        if prediction is not None and prediction.curve:
            predicted = prediction.predicted_max_micro_batch
            (line,) = ax.plot(
                [p.batch for p in prediction.curve],
                [_mib(p.peak_bytes) for p in prediction.curve],
                color=color,
                linewidth=1.5,
                alpha=0.7,
                label=f"{name}: predicted peak",
            )
            column.append((line, "predicted peak" + (f" (answer {predicted})" if predicted is not None else "")))
        # On CUDA the limit applies to reserved memory; on the budget device reserved == allocated.
        shown = result.loop_trials(answer.loop.micro_steps)
        for fitting, mark, words in ((True, marker, "trial fits (peak)"), (False, "x", "trial out of memory")):
            trials = [t for t in shown if t.fits is fitting]
            if trials:
                column.append((_scatter(ax, trials, color, mark, f"{name}: {words}"), words))
        found, capped = _answer(result, answer)
        if found is None:
            column.append((blank, "none fits"))
            said.append(f"none fits {name}")
            continue
        words = f"answer {found}" + (" (capped)" if capped else "")
        column.append((ax.axvline(found, color=color, linestyle=":", linewidth=1.5, label=f"{name}: {words}"), words))
        said.append(f"{found} {name}")
    columns += _draw_candidates(ax, result, blank)
    budget = ax.axhline(_mib(result.budget_bytes), color="black", linestyle="-", linewidth=1, label="budget")
    limit = ax.axhline(
        _mib(result.limit_bytes),
        color="tab:orange",
        linestyle="--",
        linewidth=1,
        label=f"limit (budget − headroom {format_bytes(result.headroom_bytes)})",
    )
    columns.append([(blank, ""), (budget, "budget"), (limit, str(limit.get_label()))])
    setting = result.workload.checkpointing or ("none" if result.checkpointing is not None else None)
    chosen = "" if setting is None else f"\ncheckpointing {setting}{' (chosen)' if result.checkpointing else ''}"
    ax.set_title(f"{result.workload.target} on {result.device.name}: {', '.join(said)}{chosen}", fontsize=10)
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # batch sizes are whole numbers
    ax.grid(True, alpha=0.3)
    # matplotlib fills a legend column by column: equal columns keep each loop's entries in one.
    rows = max(len(column) for column in columns)
    entries = [entry for column in columns for entry in column + [(blank, "")] * (rows - len(column))]
    legend = ax.legend(
        [handle for handle, _ in entries],
        [text for _, text in entries],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=len(columns),
        fontsize=8,
        frameon=False,
    )
    for text in legend.get_texts()[::rows][:-1]:  # each loop's heading
        text.set_fontweight("bold")
    return figure


def _draw_candidates(ax: Any, result: ProbeResult, blank: Any) -> list[list[tuple[Any, str]]]:
    """Each checkpointing setting compared and not chosen (`--checkpointing auto`), a colour each: its
    trials' peaks (a marker per loop, as the chosen setting's) and its accumulating answer; a legend
    column each."""
    choice = result.checkpointing
    if choice is None:
        return []
    columns: list[list[tuple[Any, str]]] = []
    others = [c for c in choice.candidates if c.setting != choice.chosen]
    for c, color in zip(others, CANDIDATE_COLORS, strict=False):
        name = f"checkpointing {c.setting}"
        column: list[tuple[Any, str]] = [(blank, name)]
        for accumulates, (_, marker) in ((False, LOOP_STYLES[0]), (True, LOOP_STYLES[1])):
            trials = [t for t in c.trials if t.fits and (t.micro_steps > 1) == accumulates]
            if trials:
                loop = "with accumulation" if accumulates else "without accumulation"
                column.append((_scatter(ax, trials, color, marker, f"{name}: trial fits {loop}"), f"trial fits {loop}"))
        if c.max_micro_batch is not None:
            words = f"answer {c.max_micro_batch} with accumulation"
            line = ax.axvline(c.max_micro_batch, color=color, linestyle="-.", linewidth=1.5, label=f"{name}: {words}")
            column.append((line, words))
        else:
            column.append((blank, "none fits" if c.reason else "no accumulating answer"))
        columns.append(column)
    return columns


def _draw_breakdown(ax: Any, result: ProbeResult, breakdown: MemoryBreakdown) -> None:
    """One stacked bar: what filled the memory at the answer's peak, on the main axes' scale."""
    bottom = 0.0
    for (label, size), color in zip(breakdown.parts(), PART_COLORS, strict=True):
        ax.bar(0, _mib(size), bottom=bottom, width=0.6, color=color, label=f"{label}: {format_bytes(size)}")
        bottom += _mib(size)
    ax.axhline(_mib(result.limit_bytes), color="tab:orange", linestyle="--", linewidth=1)
    ax.set_xlim(-0.6, 0.6)
    at = result.trial_at_answer
    ax.set_xticks([0], [f"batch {at.batch if at is not None else result.max_micro_batch}"])
    ax.tick_params(axis="y", labelleft=False)
    where = f"\nin {breakdown.peak_op}" if breakdown.peak_op else ""
    ax.set_title(f"at the answer's peak{where}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    # Largest part on top in the legend, as in the stack.
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8, frameon=False)


def check_plot_format(path: str | Path, flag: str = "--plot") -> None:
    """Refuse now (before a probe spends minutes) a plot file whose extension FORMATS lacks; that the
    file can be written is the caller's check. A ConfigError names `flag` and says what to do."""
    target = Path(path).expanduser()
    if target.suffix.lower() not in FORMATS:
        shown = f"the extension {target.suffix!r}" if target.suffix else "no extension"
        raise ConfigError(
            f"{flag} {str(path)!r} has {shown}: the plot is written as PNG, JPEG, SVG or PDF, so name the file "
            f"{target.with_suffix('.png')} (or end it in {', '.join(f for f in FORMATS if f != '.png')})"
        )


def write_plot(result: ProbeResult, path: str | Path) -> Path:
    """Render and write the picture in the format the extension names (PNG for .png, JPEG for
    .jpg/.jpeg, SVG, PDF); returns the path written. Another extension, or an unwritable path, is a
    ConfigError."""
    target = Path(path).expanduser()
    written = FORMATS.get(target.suffix.lower())
    if written is None:
        raise ConfigError(f"cannot write the plot to {str(path)!r}: name a file ending in {', '.join(FORMATS)}")
    picture = render_plot(result, format=written)
    try:
        target.write_bytes(picture)
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to {str(path)!r}: {exc.strerror or exc}") from None
    return target
