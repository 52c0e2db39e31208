"""The words of a result, for people: the summary of a probe, its plan, what filled the memory,
the confirmation and the prediction; a plan's and a mixed plan's lines; an estimate.

Lines are rich markup with user text escaped, except where a function says plain text.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from autotune.cli.app import out
from autotune.units import format_bytes

if TYPE_CHECKING:
    from autotune.engine.estimate import EstimateResult
    from autotune.plans.mixed import MixedPlan
    from autotune.plans.plan import Plan
    from autotune.results import AllocatorComparison, ProbeResult, TrialRecord


def trial_table(trials: list[TrialRecord], title: str) -> Table:
    table = Table(title=escape(title), title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("batch", justify="right")
    table.add_column("micro-steps", justify="right")
    table.add_column("result")
    table.add_column("peak allocated", justify="right")
    table.add_column("peak reserved", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("samples/s", justify="right")
    for i, t in enumerate(trials, 1):
        table.add_row(
            str(i),
            str(t.batch),
            str(t.micro_steps),
            "[green]fits[/]" if t.fits else "[red]OOM[/]",
            format_bytes(t.peak_allocated_bytes),
            format_bytes(t.peak_reserved_bytes),
            f"{t.seconds:.2f}",
            f"{t.samples_per_second:.1f}" if t.samples_per_second else "-",
        )
    return table


def plan_arithmetic(p: Plan) -> str:
    """The plan as exact arithmetic, micro-batch × steps: "17 × 4 + 16 × 2 = effective batch 100";
    "(684 + 683 × 2) × world size 2 = effective batch 4100". A size that runs once has no "× 1"."""
    terms = [f"{m} × {n}" if n > 1 else str(m) for m, n in Counter(p.micro_batches).items()]
    expression = " + ".join(terms)
    if p.world_size > 1:
        expression = f"({expression})" if len(terms) > 1 else expression
        expression += f" × world size {p.world_size}"
    return f"{expression} = effective batch {p.achieved_effective_batch}"


def plan_lines(p: Plan) -> list[str]:
    """The plan for people, as markup (user text escaped)."""
    sizes = p.micro_batches
    shown = (
        ", ".join(map(str, sizes))
        if len(sizes) <= 12
        else f"{', '.join(map(str, sizes[:10]))}, ... ({len(sizes)} steps)"
    )
    steps = p.accumulation_steps
    if steps == 1:
        shape = "one micro-step per optimizer step (no accumulation)"
    else:
        equal = len(set(sizes)) == 1
        shape = f"{steps} accumulation steps of {'' if equal else 'at most '}{p.micro_batch} (micro-batch × steps)"
    lines = [f"plan ({p.policy.value}): {shape}: {plan_arithmetic(p)}", f"  per-step micro-batches: {shown}"]
    if p.verified_for != "unverified":
        what = "one micro-step per optimizer step" if p.verified_for == "one-micro-step" else "gradient accumulation"
        lines.append(f"  micro-batch {p.micro_batch} verified for {what}")
    else:
        lines.append(
            f"  unverified: the maximum {p.max_micro_batch} was given, not probed; verify it in the job's loop with "
            f"`autotune probe TARGET --effective-batch {p.effective_batch}"
            + (f" --world-size {p.world_size}" if p.world_size > 1 else "")
            + "` (or autotune.probe_workload in Python)"
        )
    lines += [f"  [yellow]warning:[/] {escape(w)}" for w in p.warnings]
    return lines


def print_summary(
    result: ProbeResult, saved: str | None = None, *, wall_seconds: float | None = None, waited_seconds: float = 0.0
) -> None:
    """The result for people; `saved`: the file --save wrote, which the closing lines load;
    `wall_seconds`: the command's time from its start (its processes' start-up, and `waited_seconds`
    for the device, included)."""
    at = result.trial_at_answer
    single = result.max_micro_batch_without_accumulation
    if result.max_micro_batch is None:
        out.print(f"[bold]max micro-batch: {single}[/] with one micro-step per optimizer step (no accumulation)")
        out.print(f"  [yellow]with gradient accumulation: none fits:[/] {escape(result.accumulation_failure or '')}")
        out.print("  plans that need no accumulation are made from the answer above", highlight=False)
    else:
        out.print(
            f"[bold]max micro-batch: {result.max_micro_batch}[/]"
            + (" [yellow](capped: the cap fitted, the true maximum may be larger)[/]" if result.capped else "")
            + (" with gradient accumulation" if result.loop.accumulates else "")
        )
        if single is not None and result.loop.accumulates:
            out.print(f"  without accumulation (one micro-step per optimizer step): {single}")
    verdict = result.verdict
    for checked in verdict.answers:
        if checked.answer != "plan":
            out.print(f"  {checked.words}", highlight=False, markup=False)
    if result.workload.parallel.strategy != "none":
        from autotune.parallel import describe

        out.print(f"  {describe(result.workload.parallel)}", highlight=False, markup=False)
    out.print(
        f"  device: {escape(result.device.name)}; budget {format_bytes(result.budget_bytes)} "
        f"({escape(result.budget_policy)}), headroom {format_bytes(result.headroom_bytes)}, "
        f"limit {format_bytes(result.limit_bytes)}"
    )
    if result.allocator_config:
        out.print(f"  allocator: {escape(result.allocator_config)}", highlight=False)
    if at is not None:
        out.print(f"  peak at {at.batch}: {format_bytes(at.peak_reserved_bytes)} reserved")
    for line in breakdown_lines(result):
        out.print(line, highlight=False, markup=False)
    answer = result.max_micro_batch if result.max_micro_batch is not None else single
    above = None if answer is None else answer + result.granularity
    failed = next((t for t in result.evidence() if t.batch == above and not t.fits), None)
    if failed is not None:
        out.print(f"  {failed.batch} ran out of memory: {escape(failed.oom_message or '')}")
    out.print(f"  {escape(time_words(result, wall_seconds, waited_seconds))}; fingerprint {result.fingerprint[:16]}")
    compared = result.allocator_comparison
    if compared is not None:
        out.print(f"  {escape(_comparison_words(result, compared))}", highlight=False)
    for note in result.notes:
        out.print(f"  [yellow]note:[/] {escape(note)}")
    for line in _prediction_lines(result):
        out.print(line)
    for line in _confirmation_lines(result):
        out.print(line, highlight=False)
    from autotune.cli.checkpointing import checkpointing_table

    for item in checkpointing_table(result):
        out.print(item, highlight=False)
    if result.plan is not None:
        for line in plan_lines(result.plan):
            out.print(line)
    out.print(_verdict_line(result), highlight=False)
    if result.plan is not None and verdict.status != "not-confirmed":
        for line in python_lines(saved, allow_unconfirmed=verdict.status != "confirmed"):
            out.print(line, highlight=False, markup=False)


def _verdict_line(result: ProbeResult) -> str:
    """The result's status, one line (markup): what the exit code says."""
    verdict = result.verdict
    if verdict.status == "confirmed":
        return f"[green]answered and confirmed[/]: {escape(verdict.note)}"
    if verdict.status == "not-confirmed":
        return f"[red]answered, NOT confirmed (exit {verdict.exit_code}):[/] {escape(verdict.note)}"
    words = verdict.note if verdict.note.startswith("unconfirmed") else f"unconfirmed: {verdict.note}"
    return f"[yellow]answered, {escape(words)}[/]"


def python_lines(saved: str | None, *, allow_unconfirmed: bool = False) -> list[str]:
    """How to run the plan in a script: three lines to paste (the file --save wrote, or where to save
    it); an unconfirmed result's plan is loaded only when asked for as such."""
    path = saved if saved is not None else "result.json"
    allow = ", allow_unconfirmed=True" if allow_unconfirmed else ""
    lines = [
        "in Python" + (":" if saved is not None else f" (probe again with --save {path} to keep this result):"),
        f"  plan = autotune.load_result({json.dumps(path)}{allow}).plan",
        "  loader = DataLoader(dataset, batch_sampler=plan.sampler(len(dataset), shuffle=True))",
        "  for step in autotune.accumulate(loader, plan): ...  # step.batch, step.scale(loss).backward(), "
        "step.should_step",
    ]
    return lines


def time_words(result: ProbeResult, wall_seconds: float | None = None, waited_seconds: float = 0.0) -> str:
    """Where the time went: the search, the fresh-process confirmation, and, given the command's
    wall time from its start (`wall_seconds`), all of it: the processes' start-up (an interpreter,
    torch, the workload) and the wait for the device (`waited_seconds`) are in it."""
    words = f"{len(result.trials)} trials in {result.duration_seconds:.1f} s"
    c = result.confirmation
    if c is not None and c.status != "skipped" and c.runs:
        words += f", then {c.runs} fresh-process confirmation run(s) in {c.seconds:.1f} s"
    if wall_seconds is not None:
        waited = f", {waited_seconds:.1f} s of it waiting for the device" if waited_seconds >= 0.05 else ""
        words += f"; {wall_seconds:.1f} s in all from the command's start (starting its processes included{waited})"
    return words


def _comparison_words(result: ProbeResult, compared: AllocatorComparison) -> str:
    """`with expandable_segments:True instead (unconfirmed): 32 / 32 (+2 / +3)`."""

    def change(theirs: int | None, ours: int | None) -> str:
        if theirs is None or ours is None:
            return "n/a"
        return "same" if theirs == ours else f"{theirs - ours:+d}"

    ours = (result.max_micro_batch, result.max_micro_batch_without_accumulation)
    theirs = (compared.max_micro_batch, compared.max_micro_batch_without_accumulation)
    return (
        f"with {compared.allocator_config} instead (unconfirmed, {compared.trials} trials): "
        f"{theirs[0]} / {theirs[1]} (accumulating / one micro-step; "
        f"{change(theirs[0], ours[0])} / {change(theirs[1], ours[1])})"
    )


def breakdown_lines(result: ProbeResult) -> list[str]:
    """What filled the memory at the answer's peak, and what would shrink the largest part (plain text)."""
    parts = result.breakdown
    if parts is None:
        return []
    where = f", in {parts.peak_op}" if parts.peak_op else ""
    shares = ", ".join(f"{label} {format_bytes(size)}" for label, size in parts.parts())
    label, size = parts.largest()
    share = size / parts.total if parts.total else 0.0
    lines = [
        f"  at the peak ({format_bytes(parts.total)} allocated{where}): {shares}",
        f"  largest: {label} ({share:.0%}): {parts.lever()}",
    ]
    at = result.trial_at_answer
    if at is not None and at.peak_reserved_bytes and at.peak_allocated_bytes:
        cached = at.peak_reserved_bytes - at.peak_allocated_bytes
        if cached > 0:  # a caching allocator's: what the limit counts beyond the tensors
            lines.append(
                f"  reserved but unallocated at the peak: {format_bytes(cached)} (the caching allocator's "
                f"cached and split blocks; the limit counts {format_bytes(at.peak_reserved_bytes)} reserved)"
            )
    return lines


def _confirmation_lines(result: ProbeResult) -> list[str]:
    c = result.confirmation
    if c is None:
        return ["  unconfirmed: this result has no fresh-process confirmation"]
    if c.status == "skipped":
        return [f"  {escape(c.note or '')}"]
    lines = []
    for check in c.checks:
        sizes = ", ".join(
            f"{r.batch} {'fits' if r.fits else 'OOM'}"
            + ("" if r.limit_bytes is None else f" under {format_bytes(r.limit_bytes)}")
            + _run_seconds(r)
            for r in check.runs
        )
        verdict = "NOT confirmed" if check.mismatch else "confirmed"
        lines.append(
            f"  {verdict} in a fresh process: {check.answer} {check.confirmed} "
            f"({check.loop.micro_steps} micro-step(s) × {check.loop.steps} optimizer steps; runs: {sizes})"
        )
    if c.status == "stepped-down":
        lines.append(f"  [yellow]stepped down:[/] {escape(c.note or '')}")
    return lines


def _run_seconds(run: TrialRecord) -> str:
    """A fresh run's time as its progress lines counted it: from its process's start."""
    if run.process_seconds is None:
        return ""
    return f" in {run.process_seconds:.1f} s, {run.seconds:.1f} s of it training"


def predicted_words(predicted: int) -> str:
    """The timelines' prediction; at the model's ceiling it is a lower bound (the search went on)."""
    from autotune.engine.search import MAX_PREDICTED_BATCH  # no torch

    if predicted >= MAX_PREDICTED_BATCH:
        return f"at least {predicted:,} (the curve is not followed past that: the search went on from there)"
    return str(predicted)


def _prediction_lines(result: ProbeResult) -> list[str]:
    lines: list[str] = []
    p = result.prediction
    if p is not None:
        if p.predicted_max_micro_batch is not None and p.seeded_from is not None:
            # The accumulating loop recorded no timelines: its guess came from the other loop's curve.
            verdict = "exact" if p.exact else f"verified answer {result.max_micro_batch}"
            lines.append(
                f"  predicted {predicted_words(p.predicted_max_micro_batch)} from {escape(p.seeded_from)} ({verdict})"
            )
            single = result.answers[0].prediction if result.answers else None
            if single is not None and single is not p and single.probe_batches:
                found = result.max_micro_batch_without_accumulation
                lines.append(
                    f"  that curve: predicted {predicted_words(single.predicted_max_micro_batch or 0)} without "
                    f"accumulation from timelines at {', '.join(map(str, single.probe_batches))} "
                    f"({'exact' if single.exact else f'verified answer {found}'}; "
                    f"the {single.probe_trials} timeline trials are counted above)"
                )
        elif p.predicted_max_micro_batch is not None:
            verdict = "exact" if p.exact else f"verified answer {result.max_micro_batch}"
            lines.append(
                f"  predicted {predicted_words(p.predicted_max_micro_batch)} from timelines at "
                f"{', '.join(map(str, p.probe_batches))} "
                f"({verdict}; the {p.probe_trials} timeline trials are counted above)"
            )
        if p.fallback_reason:
            lines.append(f"  [yellow]plain search:[/] {escape(p.fallback_reason)}")
    c = result.throughput
    if c is not None:
        unit = "per optimizer step" if c.basis == "optimizer-step" else "per sample"
        lines.append(
            f"  throughput: micro-batch {c.micro_batch} is fastest ({c.seconds:.4g} s {unit}); "
            f"the largest timed, {c.largest_micro_batch}, is {c.largest_slowdown:.0%} slower"
        )
    return lines


def mixed_plan_lines(p: MixedPlan) -> list[str]:
    """A mixed plan for people, as markup (user text escaped): one line per kind of rank."""
    from autotune.plans.mixed import mixed_arithmetic

    steps = p.accumulation_steps
    shape = "one micro-step per optimizer step (no accumulation)" if steps == 1 else f"{steps} accumulation steps"
    lines = [
        f"mixed plan ({p.mode.value}, {p.policy.value}): {shape} on every rank of {p.world_size}: {mixed_arithmetic(p)}"
    ]
    for group in p.groups:
        for run in group.runs:
            ranks = f"rank {run.first_rank}" if run.rank_count == 1 else f"ranks {run.first_rank}-{run.last_rank}"
            sizes = run.micro_batches
            shown = ", ".join(map(str, sizes)) if len(sizes) <= 12 else f"{', '.join(map(str, sizes[:10]))}, ..."
            weights = ", ".join(
                f"{w:.6g} for {m}" for m, w in dict(zip(run.micro_batches, run.loss_weights, strict=True)).items()
            )
            lines.append(
                f"  {escape(group.name)} {ranks}: micro-batches {shown} ({run.samples} samples per optimizer step "
                f"each), loss weight {weights}"
            )
    lines.append(
        f"  loss weight = world size {p.world_size} × micro-batch / effective batch {p.effective_batch}: multiply "
        "each micro-step's mean loss by it"
    )
    lines += [f"  [yellow]warning:[/] {escape(w)}" for w in p.warnings]
    return lines


def print_estimate(result: EstimateResult) -> None:
    """Both loops' answers, named as the probe's summary names them."""
    single = result.max_micro_batch_without_accumulation
    estimate = " (an estimate: fake tensors on the CPU, nothing measured on a GPU)"
    if result.max_micro_batch is None:
        out.print(
            f"[bold]estimated max micro-batch: {single}[/] with one micro-step per optimizer step (no accumulation)"
            + estimate
        )
        out.print(f"  [yellow]with gradient accumulation: none fits:[/] {escape(result.accumulation_failure or '')}")
    else:
        out.print(
            f"[bold]estimated max micro-batch: {result.max_micro_batch}[/]"
            + (" [yellow](capped)[/]" if result.capped else "")
            + " with gradient accumulation"
            + estimate
        )
        out.print(f"  without accumulation (one micro-step per optimizer step): {single}")
        out.print(f"  estimated for: {result.loop.describe()}", highlight=False, markup=False)
    out.print(
        f"  memory {format_bytes(result.memory_bytes)} - headroom {format_bytes(result.headroom_bytes)} "
        f"- CUDA overhead {format_bytes(result.overhead_bytes)} = limit {format_bytes(result.limit_bytes)}; "
        f"parameters and buffers {format_bytes(result.state_bytes)}"
    )
    predicted, fallbacks = [], []
    for answer in result.answers:
        loop = "with accumulation" if answer.loop.accumulates else "without accumulation"
        p = answer.prediction
        if p is not None and p.predicted_max_micro_batch is not None:
            predicted.append(f"{predicted_words(p.predicted_max_micro_batch)} {loop}")
        if p is not None and p.fallback_reason:
            fallbacks.append(f"  [yellow]plain search {loop}:[/] {escape(p.fallback_reason)}")
    if predicted:
        out.print(f"  the timeline trials predicted {', '.join(predicted)}")
    for line in fallbacks:
        out.print(line)
    curves = {"one micro-step": result.curve_without_accumulation, "with accumulation": result.curve}
    shown = {name: {p.batch: p.peak_bytes for p in points} for name, points in curves.items() if points}
    if shown:
        table = Table(title="predicted peak memory", title_justify="left")
        table.add_column("micro-batch", justify="right")
        for name in shown:
            table.add_column(name, justify="right")
        for batch in sorted({b for peaks in shown.values() for b in peaks}):
            cells = []
            for peaks in shown.values():
                peak = peaks.get(batch)
                mark = "fits" if peak is not None and peak <= result.limit_bytes else "over the limit"
                cells.append("-" if peak is None else f"{format_bytes(peak)} {mark}")
            table.add_row(str(batch), *cells)
        out.print(table)
    out.print(f"  {len(result.trials)} fake trials in {result.seconds:.1f} s")
