"""The `autotune` command line: probe, plan (and the service's serve, devices, estimate).

Errors we expect (bad input, a probe that cannot answer) print one line and exit non-zero:
2 for bad input, 1 for a probe that failed. No traceback reaches the user.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from autotune import __version__
from autotune.errors import AutotuneError, ConfigError
from autotune.plan import Plan, Policy, parse_policy, plan
from autotune.probe import ProbeRequest, load_workload
from autotune.results import ProbeResult, TrialRecord
from autotune.settings import get_settings
from autotune.units import format_bytes, parse_headroom, parse_size
from autotune.workload import parse_options

app = typer.Typer(
    name="autotune",
    help="Find the largest micro-batch that fits in GPU memory, exactly, and plan accumulation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def _trial_table(trials: list[TrialRecord], title: str) -> Table:
    table = Table(title=title, title_justify="left")
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


def _plan_lines(p: Plan) -> list[str]:
    sizes = p.micro_batches
    shown = (
        ", ".join(map(str, sizes))
        if len(sizes) <= 12
        else f"{', '.join(map(str, sizes[:10]))}, ... ({len(sizes)} steps)"
    )
    # Counter keeps first-appearance order: [6, 6, 5] -> 2 × 6 + 1 × 5.
    arithmetic = " + ".join(f"{n} × {m}" for m, n in Counter(sizes).items())
    lines = [
        f"plan ({p.policy.value}): {p.accumulation_steps} accumulation step(s) of at most {p.micro_batch} "
        f"({arithmetic}) × world size {p.world_size} = effective batch {p.achieved_effective_batch}",
        f"  per-step micro-batches: {shown}",
    ]
    if p.verified_for != "unverified":
        what = "one micro-step per optimizer step" if p.verified_for == "one-micro-step" else "gradient accumulation"
        lines.append(f"  micro-batch {p.micro_batch} verified for {what}")
    lines += [f"  [yellow]warning:[/] {w}" for w in p.warnings]
    return lines


def _print_summary(result: ProbeResult) -> None:
    at = result.trial_at_answer
    out.print(
        f"[bold]max micro-batch: {result.max_micro_batch}[/]"
        + (" [yellow](capped: the cap fitted, the true maximum may be larger)[/]" if result.capped else "")
        + (" with gradient accumulation" if result.loop.accumulates else "")
    )
    if result.max_micro_batch_without_accumulation is not None and result.loop.accumulates:
        out.print(
            f"  without accumulation (one micro-step per optimizer step): {result.max_micro_batch_without_accumulation}"
        )
    out.print(f"  verified for: {result.loop.describe()}", highlight=False)
    out.print(
        f"  device: {result.device.name}; budget {format_bytes(result.budget_bytes)} "
        f"({result.budget_policy}), headroom {format_bytes(result.headroom_bytes)}, "
        f"limit {format_bytes(result.limit_bytes)}"
    )
    if at is not None:
        out.print(f"  peak at {at.batch}: {format_bytes(at.peak_reserved_bytes)} reserved")
    above = result.max_micro_batch + result.granularity
    failed = next((t for t in result.evidence() if t.batch == above and not t.fits), None)
    if failed is not None:
        out.print(f"  {failed.batch} ran out of memory: {failed.oom_message}")
    out.print(
        f"  {len(result.trials)} trials in {result.duration_seconds:.1f} s; fingerprint {result.fingerprint[:16]}"
    )
    for line in _prediction_lines(result):
        out.print(line)
    for line in _confirmation_lines(result):
        out.print(line, highlight=False)
    if result.plan is not None:
        for line in _plan_lines(result.plan):
            out.print(line)


@app.command()
def probe(
    target: Annotated[str, typer.Argument(help="Built-in example (mlp, cnn, gpt) or module:attribute.")],
    device: Annotated[
        str | None,
        typer.Option(help="cuda, cuda:N or cpu (the budget device). Default: CUDA when present."),
    ] = None,
    memory: Annotated[str | None, typer.Option(help="Probe as if the device had this much memory, e.g. 24GiB.")] = None,
    budget: Annotated[
        str | None,
        typer.Option(help="CUDA budget: total (the card) or free (what other processes leave)."),
    ] = None,
    headroom: Annotated[
        str | None,
        typer.Option(help="Kept free: a fraction (0.05, 5%) or a size (2GiB). Default 5%."),
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler).")
    ] = None,
    optimizer: Annotated[str | None, typer.Option(help="sgd, adam or adamw.")] = None,
    steps: Annotated[int, typer.Option(help="Training steps per trial (2: the second is the steady state).")] = 2,
    max_batch: Annotated[int | None, typer.Option(help="Never try more than this.")] = None,
    start_batch: Annotated[int, typer.Option(help="First size to try.")] = 1,
    granularity: Annotated[int, typer.Option(help="Only try multiples of this (e.g. 8).")] = 1,
    effective_batch: Annotated[int | None, typer.Option(help="Plan accumulation for this effective batch.")] = None,
    world_size: Annotated[int, typer.Option(help="Data-parallel ranks.")] = 1,
    policy: Annotated[str, typer.Option(help="fewest-steps or exact.")] = Policy.FEWEST_STEPS.value,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="Workload option key=value (repeatable)."),
    ] = None,
    in_process: Annotated[
        bool,
        typer.Option("--in-process", help="Run in this process (debugging); default is an isolated child."),
    ] = False,
    timeout: Annotated[float | None, typer.Option(help="Seconds before the isolated probe is killed.")] = None,
    min_free_memory: Annotated[
        str | None, typer.Option(help="Refuse to probe a GPU with less free memory than this.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as one JSON document.")] = False,
    publish: Annotated[
        str | None,
        typer.Option(help="Post the result to the autotune service at this URL (token: AUTOTUNE_TOKEN)."),
    ] = None,
    search: Annotated[
        str, typer.Option(help="predict (two timeline trials predict, two verify) or plain (double, then bisect).")
    ] = "predict",
    objective: Annotated[
        str, typer.Option(help="memory (the largest that fits) or throughput (the fastest fitting one for the plan).")
    ] = "memory",
    plot: Annotated[
        str | None, typer.Option(help="Write a PNG of memory against batch size (needs the plot extra).")
    ] = None,
    prefetch: Annotated[
        int, typer.Option(help="Further batches your loader holds on the device during a step (e.g. 1 for Accelerate).")
    ] = 0,
    confirm: Annotated[
        bool,
        typer.Option("--confirm/--no-confirm", help="Run the answer again in a fresh process after the search."),
    ] = True,
    confirm_steps: Annotated[int, typer.Option(help="Optimizer steps of each fresh-process confirmation run.")] = 2,
) -> None:
    """Probe the largest micro-batch of TARGET that fits within the budget."""
    if publish is not None and not publish.startswith(("http://", "https://")):
        raise ConfigError(f"--publish {publish!r} must be the service's URL, e.g. http://autotune:8000")
    try:
        request = ProbeRequest.model_validate(
            dict(
                target=target,
                options=parse_options(option or []),
                device=device,
                memory=parse_size(memory) if memory else None,
                budget=_choice(budget, ("total", "free"), "--budget"),
                headroom=parse_headroom(headroom) if headroom is not None else None,
                precision=_choice(precision, ("fp32", "bf16", "fp16"), "--precision"),
                optimizer=_choice(optimizer.lower() if optimizer else None, ("sgd", "adam", "adamw"), "--optimizer"),
                steps=steps,
                max_batch=max_batch,
                start_batch=start_batch,
                granularity=granularity,
                effective_batch=effective_batch,
                world_size=world_size,
                policy=parse_policy(policy),
                min_free_memory=parse_size(min_free_memory) if min_free_memory else None,
                search=_choice(search, ("plain", "predict"), "--search"),
                objective=_choice(objective, ("memory", "throughput"), "--objective"),
                prefetch=prefetch,
                confirm=confirm,
                confirm_steps=confirm_steps,
            )
        )
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(_validation_message(exc)) from None
    if effective_batch is not None:
        plan(effective_batch, 1, world_size, request.policy)  # fail fast on an impossible plan
    if plot is not None:
        from autotune.plot import require_matplotlib

        require_matplotlib()

    load_workload(request)  # bad targets and options fail here, before any process starts
    result = _run_with_progress(request, in_process, timeout)
    if json_output:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        _print_summary(result)
    if plot is not None:
        from autotune.plot import write_plot

        err.print(f"plot written to {write_plot(result, plot)}", highlight=False)
    if publish is not None:
        from autotune.client import publish_result

        fingerprint = publish_result(publish, result, token=get_settings().token)
        err.print(f"published to {publish} (fingerprint {fingerprint[:16]})", highlight=False)


def _run_with_progress(request: ProbeRequest, in_process: bool, timeout: float | None) -> ProbeResult:
    """Run the probe, showing each trial as it finishes: a live table on a terminal, one line
    per trial otherwise (logs, CI)."""
    trials: list[TrialRecord] = []
    title = f"probing {request.target}"

    def run(on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
        from autotune.confirm import probe_and_confirm

        return probe_and_confirm(
            request,
            timeout=timeout or get_settings().probe_timeout,
            in_process=in_process,
            on_trial=on_trial,
            on_run=confirming,
        )

    def confirming(t: TrialRecord) -> None:
        verdict = "fits" if t.fits else "OOM"
        loop = f"{t.micro_steps} micro-steps" if t.micro_steps > 1 else "1 micro-step"
        err.print(
            f"confirm: batch {t.batch} in a fresh process ({loop} per optimizer step): {verdict}, "
            f"peak {format_bytes(t.peak_reserved_bytes)}, {t.seconds:.2f} s",
            highlight=False,
        )

    if not err.is_terminal:

        def log(t: TrialRecord) -> None:
            verdict = "fits" if t.fits else "OOM "
            err.print(
                f"trial {len(trials) + 1:3d}: batch {t.batch:6d} x{t.micro_steps} {verdict} "
                f"peak {format_bytes(t.peak_reserved_bytes):>10} {t.seconds:6.2f} s",
                highlight=False,
            )
            trials.append(t)

        return run(log)
    with Live(_trial_table(trials, title), console=err, auto_refresh=False) as live:

        def show(t: TrialRecord) -> None:
            trials.append(t)
            live.update(_trial_table(trials, title), refresh=True)

        return run(show)


def _confirmation_lines(result: ProbeResult) -> list[str]:
    c = result.confirmation
    if c is None:
        return ["  unconfirmed: this result has no fresh-process confirmation"]
    if c.status == "skipped":
        return [f"  {c.note}"]
    lines = []
    for check in c.checks:
        sizes = ", ".join(f"{r.batch} {'fits' if r.fits else 'OOM'}" for r in check.runs)
        lines.append(
            f"  confirmed in a fresh process: {check.answer} {check.confirmed} "
            f"({check.loop.micro_steps} micro-step(s) × {check.loop.steps} optimizer steps; runs: {sizes})"
        )
    if c.status == "stepped-down":
        lines.append(f"  [yellow]stepped down:[/] {c.note}")
    return lines


def _prediction_lines(result: ProbeResult) -> list[str]:
    lines: list[str] = []
    p = result.prediction
    if p is not None:
        if p.predicted_max_micro_batch is not None:
            verdict = "exact" if p.exact else f"verified answer {result.max_micro_batch}"
            lines.append(
                f"  predicted {p.predicted_max_micro_batch} from timelines at {', '.join(map(str, p.probe_batches))} "
                f"({verdict}; the {p.probe_trials} timeline trials are counted above)"
            )
        if p.fallback_reason:
            lines.append(f"  [yellow]plain search:[/] {p.fallback_reason}")
    c = result.throughput
    if c is not None:
        unit = "per optimizer step" if c.basis == "optimizer-step" else "per sample"
        lines.append(
            f"  throughput: micro-batch {c.micro_batch} is fastest ({c.seconds:.4g} s {unit}); "
            f"the largest timed, {c.largest_micro_batch}, is {c.largest_slowdown:.0%} slower"
        )
    return lines


@app.command("plan")
def plan_command(
    effective_batch: Annotated[int, typer.Option(help="The effective batch to reach.")],
    max_micro_batch: Annotated[int, typer.Option(help="The largest micro-batch that fits.")],
    world_size: Annotated[int, typer.Option(help="Data-parallel ranks.")] = 1,
    policy: Annotated[str, typer.Option(help="fewest-steps or exact.")] = Policy.FEWEST_STEPS.value,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan micro-batches and accumulation steps for an effective batch."""
    p = plan(effective_batch, max_micro_batch, world_size, parse_policy(policy))
    if json_output:
        sys.stdout.write(p.model_dump_json(indent=2) + "\n")
    else:
        for line in _plan_lines(p):
            out.print(line)


@app.command()
def devices(
    json_output: Annotated[bool, typer.Option("--json", help="Print the inventory as one JSON document.")] = False,
) -> None:
    """List the GPUs NVML sees: memory (v2 with reserved where the driver has it), compute
    processes and MIG instances. Exits 1 when NVML cannot be read (the reason says why)."""
    from autotune.devices_view import print_inventory
    from autotune.nvml import inventory

    inv = inventory()
    if json_output:
        sys.stdout.write(inv.model_dump_json(indent=2) + "\n")
    else:
        print_inventory(inv, out, err)
    if not inv.available:
        sys.exit(1)  # not typer.Exit: main() runs click with standalone_mode=False, which drops its code


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(min=1, max=64, help="Server processes on this node; they share the store (AUTOTUNE_DB)."),
    ] = 1,
) -> None:
    """Run the autotune service (AUTOTUNE_* settings; needs the `server` extra)."""
    try:
        from api.server import serve as run_server
    except ImportError as exc:
        raise ConfigError(
            f"the service needs autotune's server extra (fastapi, uvicorn, prometheus-client): {exc}"
        ) from None
    run_server(host=host, port=port, workers=workers)


@app.command()
def estimate(
    target: Annotated[str, typer.Argument(help="Built-in example (mlp, cnn, gpt) or module:attribute.")],
    memory: Annotated[str, typer.Option(help="The device's memory, e.g. 80GiB.")],
    precision: Annotated[
        str | None, typer.Option(help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler).")
    ] = None,
    optimizer: Annotated[str | None, typer.Option(help="sgd, adam or adamw.")] = None,
    headroom: Annotated[
        str | None, typer.Option(help="Kept free: a fraction (0.05, 5%) or a size (2GiB). Default 5%.")
    ] = None,
    overhead: Annotated[
        str | None,
        typer.Option(help="Subtracted for the CUDA context, workspaces and fragmentation. Default 768MiB."),
    ] = None,
    steps: Annotated[int, typer.Option(help="Training steps per trial.")] = 2,
    max_batch: Annotated[int | None, typer.Option(help="Never consider more than this.")] = None,
    granularity: Annotated[int, typer.Option(help="Only consider multiples of this.")] = 1,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-o", help="Workload option key=value (repeatable)."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the estimate as one JSON document.")] = False,
) -> None:
    """Estimate the largest micro-batch of TARGET for a memory size, without a GPU (fake tensors)."""
    from autotune.estimate import CUDA_OVERHEAD_BYTES
    from autotune.estimate import estimate as run_estimate

    if steps < 1 or granularity < 1:
        raise ConfigError("--steps and --granularity must be at least 1")
    result = run_estimate(
        target,
        parse_size(memory),
        options=parse_options(option or []),
        precision=_choice(precision, ("fp32", "bf16", "fp16"), "--precision"),
        optimizer=_choice(optimizer.lower() if optimizer else None, ("sgd", "adam", "adamw"), "--optimizer"),
        headroom=parse_headroom(headroom) if headroom is not None else None,
        overhead_bytes=_overhead(overhead, CUDA_OVERHEAD_BYTES),
        steps=steps,
        max_batch=max_batch,
        granularity=granularity,
    )
    if json_output:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
        return
    out.print(
        f"[bold]estimated max micro-batch: {result.max_micro_batch}[/]"
        + (" [yellow](capped)[/]" if result.capped else "")
        + " (an estimate: fake tensors on the CPU, nothing measured on a GPU)"
    )
    out.print(
        f"  memory {format_bytes(result.memory_bytes)} - headroom {format_bytes(result.headroom_bytes)} "
        f"- CUDA overhead {format_bytes(result.overhead_bytes)} = limit {format_bytes(result.limit_bytes)}; "
        f"parameters and buffers {format_bytes(result.state_bytes)}"
    )
    if result.predicted_max_micro_batch is not None:
        out.print(f"  the two timeline trials predicted {result.predicted_max_micro_batch}")
    if result.fallback_reason:
        out.print(f"  [yellow]plain search:[/] {result.fallback_reason}")
    if result.curve:
        table = Table(title="predicted peak memory", title_justify="left")
        table.add_column("micro-batch", justify="right")
        table.add_column("peak", justify="right")
        table.add_column("", justify="left")
        for point in result.curve:
            mark = "fits" if point.peak_bytes <= result.limit_bytes else "over the limit"
            table.add_row(str(point.batch), format_bytes(point.peak_bytes), mark)
        out.print(table)
    out.print(f"  {len(result.trials)} fake trials in {result.seconds:.1f} s")


def _overhead(text: str | None, default: int) -> int:
    if text is None:
        return default
    return 0 if text.strip() == "0" else parse_size(text)


@app.command()
def version() -> None:
    """Print the version."""
    out.print(__version__)


def _choice(value: str | None, choices: tuple[str, ...], flag: str) -> str | None:
    if value is not None and value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of {', '.join(choices)}")
    return value


def _validation_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = [f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}" for e in errors()]
        return "invalid input: " + "; ".join(parts)
    return str(exc)


def main() -> None:
    """Console entry point: our errors become one line on stderr and an exit code.

    Usage errors (a missing argument, an unknown flag) are click's: it prints them and exits 2."""
    try:
        app()
    except ConfigError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        sys.exit(2)
    except AutotuneError as exc:
        err.print(f"[red]probe failed:[/] {exc}", highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
