"""The words of `--checkpointing auto`'s choice: a table of the settings compared (setting, max
micro-batch, plan, measured samples/s, peak, trials) and why the chosen one won. Lines are rich
markup or tables with user text escaped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from autotune.units import format_bytes

if TYPE_CHECKING:
    from autotune.results import CheckpointingCandidate, ProbeResult


def _answers(c: CheckpointingCandidate) -> str:
    if c.max_micro_batch is None and c.max_micro_batch_without_accumulation is None:
        return "none fits"
    accumulating = "none" if c.max_micro_batch is None else str(c.max_micro_batch)
    return f"{accumulating} / {c.max_micro_batch_without_accumulation}"


def _plan(c: CheckpointingCandidate) -> str:
    if c.plan is None:
        return "-" if c.micro_batch is None else f"{c.micro_batch} (no plan)"
    p = c.plan
    return str(p.micro_batch) if p.accumulation_steps == 1 else f"{p.micro_batch} × {p.accumulation_steps}"


def checkpointing_table(result: ProbeResult) -> list[Table | str]:
    """The table of the settings compared and the line saying why the chosen one won; nothing for a
    result that compared none."""
    choice = result.checkpointing
    if choice is None:
        setting = result.workload.checkpointing
        return [] if setting is None else [f"  activation checkpointing: {escape(setting)} (of the repeated blocks)"]
    unit = "plan's samples/s" if choice.basis == "optimizer-step" else "samples/s"
    table = Table(title="activation checkpointing, chosen with the micro-batch", title_justify="left")
    for name, justify in (
        ("setting", "left"),
        ("max acc / 1 step", "right"),
        ("plan", "right"),
        (unit, "right"),
        ("peak", "right"),
        ("trials", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for c in choice.candidates:
        chosen = c.setting == choice.chosen
        table.add_row(
            f"[bold]{escape(c.setting)} (chosen)[/]" if chosen else escape(c.setting),
            _answers(c),
            _plan(c),
            "-" if c.samples_per_second is None else f"{c.samples_per_second:.1f}",
            format_bytes(c.peak_bytes),
            str(len(c.trials)),
        )
    return [
        table,
        f"  checkpointing {escape(choice.chosen)}: {escape(choice.reason)}; {choice.trials} trials in all settings "
        "(the answers above are this setting's)",
    ]
