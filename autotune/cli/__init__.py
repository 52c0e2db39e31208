"""The `autotune` command line: probe, plan (and the service's serve, devices, estimate).

Errors we expect (bad input, a probe that cannot answer) print one line and exit non-zero:
2 for bad input (a flag, an argument, an AUTOTUNE_* variable), 1 for a probe that failed; 130
(Ctrl-C) or 143 (SIGTERM) for a probe interrupted, once its processes have exited. No traceback
reaches the user; with `--json`, stdout gets a JSON error document as well.

Every flag is checked before anything slow starts: torch, the workload and the probe machinery are
imported inside the commands, after the checks, so `--help`, `--version` and bad input answer at
once, and an output path that cannot be written is refused before the probe, not after it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from autotune import __version__
from autotune.errors import AutotuneError, ConfigError, DeviceError, PlanError, ProbeError, WorkloadError, report
from autotune.plans.plan import Plan, Policy, parse_policy, plan
from autotune.units import format_bytes, parse_headroom, parse_size

if TYPE_CHECKING:
    from autotune.engine.probe import ProbeRequest
    from autotune.plans.mixed import MixedPlan
    from autotune.progress import TrialProgress
    from autotune.results import ProbeResult, TrialRecord
    from autotune.settings import Settings

# A plan longer than this is a typo (the service refuses the same), and its list would fill memory.
MAX_ACCUMULATION_STEPS = 10_000
# A probe's plan is made after the search, from an answer not known yet: above this many samples
# per rank an effective batch is refused before the probe rather than planned into millions of steps.
MAX_SAMPLES_PER_RANK = 10_000_000

app = typer.Typer(
    name="autotune",
    help="Find the largest micro-batch that fits in GPU memory, exactly, and plan accumulation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: no `<bool>` column, no rich import before parsing
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
# emoji=False: a target like nwl:factory: would otherwise print a factory emoji. User text that
# goes through markup is escaped (rich.markup.escape), so `[batch, 16]` in a message survives.
err = Console(stderr=True, soft_wrap=True, emoji=False)
out = Console(soft_wrap=True, emoji=False)


def _version_callback(value: bool) -> None:
    if value:
        out.print(__version__, markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="On failure, print the full traceback (a workload's own error, from the probe's process too) "
            "before the one-line message.  " + "[default: AUTOTUNE_DEBUG, false]",
        ),
    ] = False,
) -> None:
    """Find the largest micro-batch that fits in GPU memory, exactly, and plan accumulation."""
    if debug:
        _debug.append(True)


def _trial_table(trials: list[TrialRecord], title: str) -> Table:
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


def _plan_lines(p: Plan) -> list[str]:
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
    lines += [f"  [yellow]warning:[/] {escape(w)}" for w in p.warnings]
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
    out.print(f"  verified for: {result.loop.describe()}", highlight=False, markup=False)
    if result.workload.parallel.strategy != "none":
        from autotune.parallel import describe

        out.print(f"  {describe(result.workload.parallel)}", highlight=False, markup=False)
    out.print(
        f"  device: {escape(result.device.name)}; budget {format_bytes(result.budget_bytes)} "
        f"({escape(result.budget_policy)}), headroom {format_bytes(result.headroom_bytes)}, "
        f"limit {format_bytes(result.limit_bytes)}"
    )
    if at is not None:
        out.print(f"  peak at {at.batch}: {format_bytes(at.peak_reserved_bytes)} reserved")
    for line in _breakdown_lines(result):
        out.print(line, highlight=False, markup=False)
    above = result.max_micro_batch + result.granularity
    failed = next((t for t in result.evidence() if t.batch == above and not t.fits), None)
    if failed is not None:
        out.print(f"  {failed.batch} ran out of memory: {escape(failed.oom_message or '')}")
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


_DEFAULT_NOTE = "[default: {}]"


# Options several commands take, declared once.
TargetArgument = Annotated[
    str, typer.Argument(metavar="TARGET", help="Built-in example (mlp, cnn, gpt) or module:attribute.")
]
PrecisionOption = Annotated[
    str | None,
    typer.Option(
        metavar="fp32|bf16|fp16",
        help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler).  " + _DEFAULT_NOTE.format("the workload's"),
    ),
]
OptimizerOption = Annotated[
    str | None,
    typer.Option(
        metavar="sgd|adam|adamw",
        help="Override the workload's optimizer.  " + _DEFAULT_NOTE.format("the workload's"),
    ),
]
HeadroomOption = Annotated[
    str | None,
    typer.Option(
        metavar="F|SIZE",
        help="Kept free: a fraction (0.05, 5%) or a size (2GiB).  " + _DEFAULT_NOTE.format("AUTOTUNE_HEADROOM, 5%"),
    ),
]
OptionsOption = Annotated[
    list[str] | None,
    typer.Option("--option", "-o", metavar="KEY=VALUE", help="Workload option (repeatable)."),
]
WorldSizeOption = Annotated[int, typer.Option(metavar="W", min=1, help="Data-parallel ranks.")]
PolicyOption = Annotated[
    str, typer.Option(metavar="fewest-steps|exact", help="How the plan splits the effective batch.")
]


@app.command(short_help="Probe the largest micro-batch of TARGET that fits; plan accumulation.")
def probe(
    target: TargetArgument,
    device: Annotated[
        str | None,
        typer.Option(
            metavar="DEVICE",
            help="cuda, cuda:N or cpu (the budget device).  "
            + _DEFAULT_NOTE.format("cuda:0 when CUDA is present, else cpu"),
        ),
    ] = None,
    memory: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Probe as if the device had this much memory, e.g. 24GiB.  "
            + _DEFAULT_NOTE.format("the card's; on cpu AUTOTUNE_CPU_MEMORY, 256MiB"),
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(
            metavar="total|free",
            help="CUDA budget: total (the card) or free (what other processes leave).  "
            + _DEFAULT_NOTE.format("AUTOTUNE_BUDGET, total"),
        ),
    ] = None,
    headroom: HeadroomOption = None,
    precision: PrecisionOption = None,
    optimizer: OptimizerOption = None,
    steps: Annotated[
        int,
        typer.Option(metavar="N", min=1, max=100, help="Training steps per trial (2: the second is the steady state)."),
    ] = 2,
    max_batch: Annotated[
        int | None,
        typer.Option(metavar="N", min=1, help="Never try more than this.  " + _DEFAULT_NOTE.format("no cap")),
    ] = None,
    start_batch: Annotated[int, typer.Option(metavar="N", min=1, help="First size to try.")] = 1,
    granularity: Annotated[int, typer.Option(metavar="G", min=1, help="Only try multiples of this (e.g. 8).")] = 1,
    effective_batch: Annotated[
        int | None,
        typer.Option(
            metavar="E", min=1, help="Plan accumulation for this effective batch.  " + _DEFAULT_NOTE.format("no plan")
        ),
    ] = None,
    world_size: WorldSizeOption = 1,
    policy: PolicyOption = Policy.FEWEST_STEPS.value,
    option: OptionsOption = None,
    in_process: Annotated[
        bool,
        typer.Option("--in-process", help="Run in this process (debugging); default is an isolated child."),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds before the isolated probe (and each confirmation run) is killed.  "
            + _DEFAULT_NOTE.format("AUTOTUNE_PROBE_TIMEOUT, 900"),
        ),
    ] = None,
    min_free_memory: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Refuse to probe a GPU with less free memory than this (0: never refuse).  "
            + _DEFAULT_NOTE.format("AUTOTUNE_MIN_FREE_MEMORY, 1GiB"),
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the result (or the error) as one JSON document on stdout.")
    ] = False,
    publish: Annotated[
        str | None,
        typer.Option(
            metavar="URL", help="Post the result to the autotune service at this URL (token: AUTOTUNE_TOKEN)."
        ),
    ] = None,
    search: Annotated[
        str,
        typer.Option(
            metavar="predict|plain", help="predict (two timeline trials predict, two verify) or plain (double, bisect)."
        ),
    ] = "predict",
    objective: Annotated[
        str,
        typer.Option(
            metavar="memory|throughput",
            help="memory (the largest that fits) or throughput (the fastest fitting one for the plan).",
        ),
    ] = "memory",
    plot: Annotated[
        str | None,
        typer.Option(
            metavar="FILE.png",
            help="Draw memory against batch size and what fills it at the answer (needs the plot extra); "
            ".png, .jpg, .svg or .pdf, as the extension says.",
        ),
    ] = None,
    prefetch: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=0,
            max=16,
            help="Further batches your loader holds on the device during a step (e.g. 1 for Accelerate).",
        ),
    ] = 0,
    confirm: Annotated[
        bool,
        typer.Option("--confirm/--no-confirm", help="Run the answer again in a fresh process after the search."),
    ] = True,
    confirm_steps: Annotated[
        int, typer.Option(metavar="N", min=1, max=100, help="Optimizer steps of each fresh-process confirmation run.")
    ] = 2,
    parallel: Annotated[
        str,
        typer.Option(
            metavar="none|ddp|fsdp",
            help="How the job runs the model across ranks: ddp (DistributedDataParallel: its gradient buckets are "
            "measured) or fsdp (FSDP2 over --world-size ranks: rank 0 simulated on this one device).",
        ),
    ] = "none",
    reshard_after_forward: Annotated[
        bool,
        typer.Option(
            "--reshard-after-forward/--no-reshard-after-forward",
            help="--parallel fsdp: free each block's gathered parameters after forward (ZeRO-3), or keep them "
            "for backward (ZeRO-2: more memory, fewer all-gathers), as the job's fully_shard does.",
        ),
    ] = True,
) -> None:
    """Probe the largest micro-batch of TARGET that fits within the budget, and plan accumulation
    for --effective-batch. TARGET is a built-in example (mlp, cnn, gpt) or module:attribute naming a
    Workload (or a function of -o options returning one).

    Exit codes: 0 with an answer, 1 when the probe could not answer, 2 for bad input, 130 when
    interrupted (Ctrl-C) and 143 when terminated (SIGTERM), after the probe's processes have
    exited, with a line saying how many trials ran."""
    # Every check that needs no torch comes first: bad input answers at once.
    if publish is not None and not publish.startswith(("http://", "https://")):
        raise ConfigError(f"--publish {publish!r} must be the service's URL, e.g. http://autotune:8000")
    if timeout is not None:
        _check_timeout(timeout, "--timeout")
    _device(device)
    pairs = _check_options(option)
    fields: dict[str, Any] = dict(
        target=target,
        device=device,
        memory=_size("--memory", memory),
        budget=_choice(budget, ("total", "free"), "--budget"),
        headroom=_headroom("--headroom", headroom),
        precision=_choice(precision, ("fp32", "bf16", "fp16"), "--precision"),
        optimizer=_choice(optimizer.lower() if optimizer else optimizer, ("sgd", "adam", "adamw"), "--optimizer"),
        steps=steps,
        max_batch=max_batch,
        start_batch=start_batch,
        granularity=granularity,
        effective_batch=effective_batch,
        world_size=world_size,
        policy=_policy(policy),
        min_free_memory=_size("--min-free-memory", min_free_memory, allow_zero=True),
        search=_choice(search, ("plain", "predict"), "--search"),
        objective=_choice(objective, ("memory", "throughput"), "--objective"),
        prefetch=prefetch,
        confirm=confirm,
        confirm_steps=confirm_steps,
        parallel=_choice(parallel, ("none", "ddp", "fsdp"), "--parallel"),
        reshard_after_forward=reshard_after_forward,
    )
    if not reshard_after_forward and parallel != "fsdp":
        raise ConfigError(
            f"--no-reshard-after-forward is FSDP's choice, and --parallel is {parallel}: add --parallel fsdp "
            "--world-size N, or drop it"
        )
    if parallel == "fsdp" and world_size < 2:
        raise ConfigError(
            f"--parallel fsdp shards over --world-size ranks, and --world-size is {world_size}: give the job's "
            "number of ranks, e.g. --world-size 4"
        )
    if max_batch is not None and max_batch < granularity:
        raise ConfigError(f"--max-batch {max_batch} is below --granularity {granularity}: raise --max-batch")
    if effective_batch is not None:
        _check_effective_batch(effective_batch, world_size, max_batch)
    if plot is not None:
        from autotune.plot import check_plot_path, require_matplotlib

        check_plot_path(plot)
        require_matplotlib()
    settings = _settings()
    if timeout is None:
        _check_timeout(settings.probe_timeout, "AUTOTUNE_PROBE_TIMEOUT")

    _check_ignored_flags(fields, timeout, in_process)
    from autotune.request import ProbeRequest  # no torch: the probe's process imports it, and the workload

    try:
        request = ProbeRequest.model_validate({**fields, "options": _options(pairs)})
    except ValueError as exc:  # pydantic's ValidationError
        raise ConfigError(_validation_message(exc)) from None
    if _on_budget_device(request.device):
        _check_cpu_budget(request, settings)
    _check_target(request, in_process)
    result = _run_with_progress(request, in_process, timeout if timeout is not None else settings.probe_timeout)
    if json_output:
        _emit_json(result.model_dump_json(indent=2))
    else:
        _print_summary(result)
    if plot is not None:
        from autotune.plot import write_plot

        err.print(f"plot written to {write_plot(result, plot)}", highlight=False, markup=False)
    if publish is not None:
        from autotune.client import publish_result

        fingerprint = publish_result(publish, result, token=settings.token)
        err.print(f"published to {publish} (fingerprint {fingerprint[:16]})", highlight=False, markup=False)


class _Terminated(BaseException):
    """SIGTERM during a probe, raised in the main thread by the handler `_run_with_progress` installs
    (a BaseException: no `except Exception` in a trial may take it for the workload's error)."""


class ProbeInterrupted(BaseException):
    """A probe stopped by Ctrl-C (exit 130) or SIGTERM (exit 143), its processes already ended:
    `run` prints `message` as one line (and the JSON error document with --json)."""

    def __init__(self, message: str, code: int, signal_name: str, trials: int) -> None:
        super().__init__(message)
        self.message, self.code, self.signal_name, self.trials = message, code, signal_name, trials


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _step_words(p: TrialProgress) -> str:
    if p.starting:
        return "starting a fresh process"
    return f"step {p.step}/{p.steps} · micro-step {p.micro_step}/{p.micro_steps}"


class ProgressView:
    """What a probe shows while it runs, on a terminal: the table of the trials so far and, under
    it, a spinner with the trial running (`trial 3 · batch 64 · step 2/2 · micro-step 1/3 · 3.4 s`,
    the seconds ticking between reports). A rich renderable: `rich.live.Live` redraws it."""

    def __init__(self, title: str, *, isolated: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.spinner import Spinner

        self.title = title
        self.isolated = isolated
        self.trials: list[TrialRecord] = []
        self.runs = 0  # fresh-process confirmation runs that finished
        self.current: TrialProgress | None = None
        self.done = False
        self._clock = clock
        self._since = clock()  # when `current` arrived (or, with none, when the last change was)
        self._spinner = Spinner("dots", style="cyan")

    def progress(self, p: TrialProgress) -> None:
        self.current, self._since = p, self._clock()

    def trial(self, t: TrialRecord) -> None:
        self.trials.append(t)
        self.current, self._since = None, self._clock()

    def confirmed(self, t: TrialRecord) -> None:
        self.runs += 1
        self.current, self._since = None, self._clock()

    def status(self) -> str:
        """The status line, in words."""
        elapsed = self._clock() - self._since
        p = self.current
        if p is None:
            if self.runs:
                return f"confirming · {_count(self.runs, 'fresh-process run')} done · {elapsed:.1f} s"
            if not self.trials:
                return f"starting the probe{' process' if self.isolated else ''} · {elapsed:.1f} s"
            return f"searching · {_count(len(self.trials), 'trial')} done · {elapsed:.1f} s"
        seconds = p.seconds + elapsed
        if p.phase == "confirm":
            where = "" if p.starting else " in a fresh process"
            return f"confirming batch {p.batch}{where} · {_step_words(p)} · {seconds:.1f} s"
        return f"trial {len(self.trials) + 1} · batch {p.batch} · {_step_words(p)} · {seconds:.1f} s"

    def __rich__(self) -> Any:
        from rich.console import Group

        table = _trial_table(self.trials, self.title)
        if self.done:
            return table
        self._spinner.update(text=escape(self.status()))
        return Group(table, self._spinner) if self.trials else self._spinner


def _progress_line(p: TrialProgress, trial: int) -> str:
    """A report as one plain line, for logs: `trial   3: batch     64 step 1/2 micro-step 1/1   2.10 s`."""
    if p.phase == "confirm":
        what = "starting a fresh process" if p.starting else _step_words(p).replace(" · ", " ")
        return f"confirm: batch {p.batch} {what} {p.seconds:.2f} s"
    return (
        f"trial {trial:3d}: batch {p.batch:6d} step {p.step}/{p.steps} micro-step {p.micro_step}/{p.micro_steps} "
        f"{p.seconds:6.2f} s"
    )


# A log gets a progress line for each trial's first report, then at most one a second.
_LOG_INTERVAL_SECONDS = 1.0
_HEARTBEAT_SECONDS = 30.0  # piped output: a step with no new report is said to be still running this often


def _interrupted(exc: BaseException, trials: int, current: TrialProgress | None) -> ProbeInterrupted:
    terminated = isinstance(exc, _Terminated)
    done = _count(trials, "trial")
    if current is None:
        running = ""
    elif current.phase == "confirm":
        running = f" (confirming batch {current.batch} in a fresh process)"
    else:
        running = f" (batch {current.batch} was running, step {current.step}/{current.steps})"
    how = "SIGTERM" if terminated else "Ctrl-C (SIGINT)"
    message = f"interrupted after {done}{running} by {how}; the probe's processes have exited"
    return ProbeInterrupted(message, 143 if terminated else 130, "SIGTERM" if terminated else "SIGINT", trials)


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _run_with_progress(request: ProbeRequest, in_process: bool, timeout: float) -> ProbeResult:
    """Run the probe, showing each trial as it finishes and the one running (its batch, step,
    micro-step and seconds): a live table and a spinner on a terminal, plain lines otherwise (logs,
    CI). Ctrl-C or SIGTERM ends the probe's processes, then raises ProbeInterrupted."""
    view = ProgressView(f"probing {request.target}", isolated=not in_process)

    def run(on_trial: Callable[[TrialRecord], None], on_progress: Callable[[TrialProgress], None]) -> ProbeResult:
        from autotune.engine.confirm import probe_and_confirm

        return probe_and_confirm(
            request,
            timeout=timeout,
            in_process=in_process,
            on_trial=on_trial,
            on_run=confirming,
            on_progress=on_progress,
        )

    # Piped: the step running and when its report came (a step can run for minutes with no new
    # report, and a log that stops moving looks like a hang), when a line was last said, and a lock
    # that keeps the heartbeat's line from naming a step that has just ended.
    latest: list[tuple[TrialProgress, float] | None] = [None]
    said = [time.monotonic()]
    saying = threading.Lock()

    def say(line: str) -> None:
        # A Text, not markup=False: print's options would reach the live table's markup as well.
        err.print(Text(line), highlight=False)
        said[0] = time.monotonic()

    def confirming(t: TrialRecord) -> None:
        with saying:
            latest[0] = None
            view.confirmed(t)
            verdict = "fits" if t.fits else "OOM"
            loop = f"{t.micro_steps} micro-steps" if t.micro_steps > 1 else "1 micro-step"
            say(
                f"confirm: batch {t.batch} in a fresh process ({loop} per optimizer step): {verdict}, "
                f"peak {format_bytes(t.peak_reserved_bytes)}, {t.seconds:.2f} s"
            )

    def run_and_show() -> ProbeResult:
        if not err.is_terminal:
            logged = -math.inf

            def log(t: TrialRecord) -> None:
                with saying:
                    latest[0] = None
                    verdict = "fits" if t.fits else "OOM "
                    say(
                        f"trial {len(view.trials) + 1:3d}: batch {t.batch:6d} x{t.micro_steps} {verdict} "
                        f"peak {format_bytes(t.peak_reserved_bytes):>10} {t.seconds:6.2f} s"
                    )
                    view.trial(t)

            def log_progress(p: TrialProgress) -> None:
                nonlocal logged
                with saying:
                    view.progress(p)
                    now = time.monotonic()
                    latest[0] = (p, now)
                    if p.first or now - logged >= _LOG_INTERVAL_SECONDS:
                        logged = now
                        say(_progress_line(p, len(view.trials) + 1))

            def heartbeat() -> None:
                while not stopped.wait(min(1.0, _HEARTBEAT_SECONDS)):
                    with saying:
                        running, now = latest[0], time.monotonic()
                        if running is not None and now - said[0] >= _HEARTBEAT_SECONDS:
                            p, received = running
                            still = p.model_copy(update={"seconds": p.seconds + now - received})
                            say(_progress_line(still, len(view.trials) + 1) + " (still running)")

            stopped = threading.Event()
            beating = threading.Thread(target=heartbeat, name="autotune-progress-heartbeat", daemon=True)
            beating.start()
            try:
                return run(log, log_progress)
            finally:
                stopped.set()
                beating.join()
        from rich.live import Live

        with Live(view, console=err, auto_refresh=True, refresh_per_second=8):
            try:
                return run(view.trial, view.progress)
            finally:
                view.done = True  # the last frame, drawn as Live stops: the table alone

    handled = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if handled else None
    if previous is not signal.SIG_DFL:
        handled = False  # SIGTERM ignored or handled by the caller: left as it is
    if handled:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return run_and_show()
    except (KeyboardInterrupt, _Terminated) as exc:
        raise _interrupted(exc, len(view.trials), view.current) from None
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _breakdown_lines(result: ProbeResult) -> list[str]:
    """What filled the memory at the answer's peak, and what would shrink the largest part (plain text)."""
    parts = result.breakdown
    if parts is None:
        return []
    where = f", in {parts.peak_op}" if parts.peak_op else ""
    shares = ", ".join(f"{label} {format_bytes(size)}" for label, size in parts.parts())
    label, size = parts.largest()
    share = size / parts.total if parts.total else 0.0
    return [
        f"  at the peak ({format_bytes(parts.total)} allocated{where}): {shares}",
        f"  largest: {label} ({share:.0%}): {parts.lever()}",
    ]


def _confirmation_lines(result: ProbeResult) -> list[str]:
    c = result.confirmation
    if c is None:
        return ["  unconfirmed: this result has no fresh-process confirmation"]
    if c.status == "skipped":
        return [f"  {escape(c.note or '')}"]
    lines = []
    for check in c.checks:
        sizes = ", ".join(f"{r.batch} {'fits' if r.fits else 'OOM'}" for r in check.runs)
        lines.append(
            f"  confirmed in a fresh process: {check.answer} {check.confirmed} "
            f"({check.loop.micro_steps} micro-step(s) × {check.loop.steps} optimizer steps; runs: {sizes})"
        )
    if c.status == "stepped-down":
        lines.append(f"  [yellow]stepped down:[/] {escape(c.note or '')}")
    return lines


def _predicted_words(predicted: int) -> str:
    """The timelines' prediction; at the model's ceiling it is a lower bound (the search went on)."""
    from autotune.engine.search import MAX_PREDICTED_BATCH  # no torch

    if predicted >= MAX_PREDICTED_BATCH:
        return f"at least {predicted:,} (the curve is not followed past that: the search went on from there)"
    return str(predicted)


def _prediction_lines(result: ProbeResult) -> list[str]:
    lines: list[str] = []
    p = result.prediction
    if p is not None:
        if p.predicted_max_micro_batch is not None:
            verdict = "exact" if p.exact else f"verified answer {result.max_micro_batch}"
            lines.append(
                f"  predicted {_predicted_words(p.predicted_max_micro_batch)} from timelines at "
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


@app.command("plan", short_help="Plan micro-batches and accumulation steps for an effective batch.")
def plan_command(
    effective_batch: Annotated[int, typer.Option(metavar="E", min=1, help="The effective batch to reach.")],
    max_micro_batch: Annotated[
        int | None,
        typer.Option(metavar="N", min=1, help="The largest micro-batch that fits (one GPU model; else --group)."),
    ] = None,
    world_size: WorldSizeOption = 1,
    policy: PolicyOption = Policy.FEWEST_STEPS.value,
    groups: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            metavar="NAME:RANKS:MAX_MICRO_BATCH",
            help="Ranks of one GPU model and the largest micro-batch that fits on it, e.g. H100-80GB:4:64; "
            "repeat it for each model of a job that spans several. The world size is the ranks' sum; "
            "every rank runs the same number of accumulation steps.",
        ),
    ] = None,
    mixed: Annotated[
        str | None,
        typer.Option(
            metavar="per-model|uniform",
            help="With --group: per-model gives each model micro-batches up to its own maximum, with loss "
            "weights from the global sample count (fewer steps, and the larger GPUs do more); uniform runs "
            "micro-batches of at most the smallest maximum on every rank.  " + _DEFAULT_NOTE.format("per-model"),
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan (or the error) as JSON.")] = False,
) -> None:
    """Plan micro-batches and accumulation steps for an effective batch: E = sum of the
    micro-batches × W, each at most --max-micro-batch. With --group (one per GPU model), one plan
    for a job that spans GPU models: what each rank runs, and the weight of each micro-step's loss."""
    chosen = _policy(policy)
    if groups:
        _mixed_plan_command(effective_batch, max_micro_batch, world_size, chosen, groups, mixed, json_output)
        return
    if mixed is not None:
        raise ConfigError(
            f"--mixed {mixed} applies to a job that spans GPU models: give --group NAME:RANKS:MAX_MICRO_BATCH "
            "for each model (and no --max-micro-batch)"
        )
    if max_micro_batch is None:
        raise ConfigError(
            "--max-micro-batch is missing: give the largest micro-batch that fits, or --group "
            "NAME:RANKS:MAX_MICRO_BATCH for each GPU model of the job"
        )
    _check_multiple(effective_batch, world_size)
    _check_plan_steps(effective_batch, max_micro_batch, world_size, chosen)
    p = plan(effective_batch, max_micro_batch, world_size, chosen)
    if json_output:
        _emit_json(p.model_dump_json(indent=2))
    else:
        for line in _plan_lines(p):
            out.print(line)


def _parse_group(text: str) -> tuple[str, int, int]:
    """`NAME:RANKS:MAX_MICRO_BATCH` (the name may hold colons), or a ConfigError naming --group."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0].strip():
        raise ConfigError(f"--group {text!r} is not NAME:RANKS:MAX_MICRO_BATCH: for example H100-80GB:4:64")
    name, numbers = parts[0].strip(), parts[1:]
    values = []
    for what, number in zip(("ranks", "max micro-batch"), numbers, strict=True):
        if not number.strip().isdigit() or int(number) < 1:
            raise ConfigError(f"--group {text!r}: {what} {number!r} is not a whole number of at least 1")
        values.append(int(number))
    return name, values[0], values[1]


def _mixed_plan_command(
    effective_batch: int,
    max_micro_batch: int | None,
    world_size: int,
    policy: Policy,
    specs: list[str],
    mode_name: str | None,
    json_output: bool,
) -> None:
    from autotune.plans.mixed import Group, Mode, mixed_plan, parse_mode

    try:
        mode = parse_mode(mode_name if mode_name is not None else Mode.PER_MODEL)
    except PlanError as exc:
        raise ConfigError(f"--mixed: {exc}") from None
    parsed = [_parse_group(text) for text in specs]
    names = Counter(name for name, _, _ in parsed)
    twice = next((name for name, n in names.items() if n > 1), None)
    if twice is not None:
        raise ConfigError(f"--group {twice!r} is given twice: give each GPU model once, with all its ranks")
    world = sum(ranks for _, ranks, _ in parsed)
    if max_micro_batch is not None:
        raise ConfigError(
            "--max-micro-batch is for a job on one GPU model: with --group each model gives its own "
            "(NAME:RANKS:MAX_MICRO_BATCH)"
        )
    if world_size not in (1, world):
        raise ConfigError(f"--world-size {world_size} is not the --group ranks' sum, {world}: leave it out")
    if effective_batch < world:
        raise ConfigError(
            f"--effective-batch {effective_batch} is less than the world size {world} (the --group ranks): every "
            f"rank needs at least one sample per optimizer step; use at least {world}"
        )
    if policy is Policy.EXACT and mode is Mode.PER_MODEL:
        raise ConfigError(
            "--policy exact (equal micro-batches) applies to --mixed uniform: with --mixed per-model the "
            "micro-batches differ by GPU model anyway, and each micro-step's loss takes its weight"
        )
    if mode is Mode.UNIFORM and effective_batch % world:
        lower = effective_batch // world * world
        raise ConfigError(
            f"--effective-batch {effective_batch} is not a multiple of the world size {world} (the --group ranks): "
            f"with --mixed uniform every rank runs the same micro-batches; use {lower or world}"
            + (f" or {lower + world}" if lower else "")
            + ", or --mixed per-model"
        )
    groups = [Group(name, ranks, largest) for name, ranks, largest in parsed]
    try:
        made = mixed_plan(effective_batch, groups, mode, policy, max_steps=MAX_ACCUMULATION_STEPS)
    except PlanError as exc:
        raise ConfigError(f"--effective-batch {effective_batch} with these --group maxima: {exc}") from None
    if json_output:
        _emit_json(made.model_dump_json(indent=2))
    else:
        for line in mixed_plan_lines(made):
            out.print(line)


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


@app.command(short_help="List the GPUs NVML sees, with memory and processes.")
def devices(
    json_output: Annotated[bool, typer.Option("--json", help="Print the inventory as one JSON document.")] = False,
) -> None:
    """List the GPUs NVML sees: memory (v2 with reserved where the driver has it), compute processes
    and MIG instances. Exits 1 when NVML cannot be read (the reason says why)."""
    from autotune.cli.inventory import print_inventory
    from autotune.devices.nvml import inventory

    inv = inventory()
    if json_output:
        _emit_json(inv.model_dump_json(indent=2))
    else:
        print_inventory(inv, out, err)
    if not inv.available:
        sys.exit(1)  # not typer.Exit: main() runs click with standalone_mode=False, which drops its code


@app.command(short_help="Run the autotune service (needs the server extra).")
def serve(
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", min=1, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            metavar="N", min=1, max=64, help="Server processes on this node; they share the store (AUTOTUNE_DB)."
        ),
    ] = 1,
) -> None:
    """Run the autotune service (AUTOTUNE_* settings; needs the `server` extra)."""
    _settings()
    try:
        from api.server import serve as run_server
    except ImportError as exc:
        raise ConfigError(
            f"the service needs autotune's server extra (fastapi, uvicorn, prometheus-client): {exc}"
        ) from None
    run_server(host=host, port=port, workers=workers)


@app.command(short_help="Estimate the largest micro-batch for a memory size, without a GPU.")
def estimate(
    target: TargetArgument,
    memory: Annotated[str, typer.Option(metavar="SIZE", help="The device's memory, e.g. 80GiB.")],
    precision: PrecisionOption = None,
    optimizer: OptimizerOption = None,
    headroom: HeadroomOption = None,
    overhead: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Subtracted for the CUDA context, workspaces and fragmentation.  " + _DEFAULT_NOTE.format("768MiB"),
        ),
    ] = None,
    steps: Annotated[int, typer.Option(metavar="N", min=1, max=100, help="Training steps per trial.")] = 2,
    max_batch: Annotated[
        int | None,
        typer.Option(metavar="N", min=1, help="Never consider more than this.  " + _DEFAULT_NOTE.format("no cap")),
    ] = None,
    granularity: Annotated[int, typer.Option(metavar="G", min=1, help="Only consider multiples of this.")] = 1,
    option: OptionsOption = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the estimate (or the error) as one JSON document.")
    ] = False,
) -> None:
    """Estimate the largest micro-batch of TARGET for a memory size, without a GPU (fake tensors)."""
    memory_bytes = _size("--memory", memory)
    assert memory_bytes is not None
    pairs = _check_options(option)
    chosen_precision = _choice(precision, ("fp32", "bf16", "fp16"), "--precision")
    chosen_optimizer = _choice(optimizer.lower() if optimizer else optimizer, ("sgd", "adam", "adamw"), "--optimizer")
    room = _headroom("--headroom", headroom)
    overhead_bytes = _size("--overhead", overhead, allow_zero=True)
    if max_batch is not None and max_batch < granularity:
        raise ConfigError(f"--max-batch {max_batch} is below --granularity {granularity}: raise --max-batch")
    _settings()

    from autotune.engine.estimate import CUDA_OVERHEAD_BYTES  # torch: only now
    from autotune.engine.estimate import estimate as run_estimate

    result = run_estimate(
        target,
        memory_bytes,
        options=_options(pairs),
        precision=chosen_precision,
        optimizer=chosen_optimizer,
        headroom=room,
        overhead_bytes=CUDA_OVERHEAD_BYTES if overhead_bytes is None else overhead_bytes,
        steps=steps,
        max_batch=max_batch,
        granularity=granularity,
    )
    if json_output:
        _emit_json(result.model_dump_json(indent=2))
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
        out.print(f"  the two timeline trials predicted {_predicted_words(result.predicted_max_micro_batch)}")
    if result.fallback_reason:
        out.print(f"  [yellow]plain search:[/] {escape(result.fallback_reason)}")
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


@app.command(short_help="Print the version.")
def version() -> None:
    """Print the version (as --version does)."""
    out.print(__version__, markup=False, highlight=False)


# --- checks of flags and variables: each error names the flag (or variable) and the fix --------------


def _choice(value: str | None, choices: tuple[str, ...], flag: str) -> str | None:
    if value is not None and value not in choices:
        raise ConfigError(f"{flag} {value!r} is not one of {', '.join(choices)}")
    return value


def _policy(value: str) -> Policy:
    try:
        return parse_policy(value)
    except PlanError as exc:
        raise ConfigError(f"--policy: {exc}") from None


def _device(spec: str | None) -> None:
    """The same rule as autotune.engine.probe.parse_device, without importing torch first."""
    if spec is None:
        return
    text = spec.strip().lower()
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit()):
        return
    raise ConfigError(f"--device: unknown device {spec!r}: use cuda, cuda:N or cpu")


def _size(flag: str, text: str | None, *, allow_zero: bool = False) -> int | None:
    if text is None:
        return None
    if not text.strip():
        raise ConfigError(f"{flag} is empty: give a size with its unit, for example 512MiB or 24GiB")
    try:
        size = parse_size(text, allow_zero=allow_zero)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    if flag == "--memory" and text.strip().isdigit() and 0 < size < 2**20:
        # A bare number is bytes: a device below a MiB had its unit left out (as a bare headroom of 5 means 5%).
        number = text.strip()
        raise ConfigError(
            f"{flag} {number} has no unit and would be {number} bytes: did you mean {number}GiB or {number}MiB?"
        )
    return size


def _headroom(flag: str, text: str | None) -> float | int | None:
    if text is None:
        return None
    if not text.strip():
        raise ConfigError(f"{flag} is empty: give a fraction (0.05, 5%) or a size (2GiB)")
    try:
        return parse_headroom(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _check_options(pairs: list[str] | None) -> list[str]:
    """The -o pairs, checked as autotune.workloads.workload.parse_options will parse them (it imports torch)."""
    for pair in pairs or []:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(f"-o/--option {pair!r} is not key=value (for example -o seq_len=512)")
    return list(pairs or [])


def _options(pairs: list[str]) -> dict[str, Any]:
    from autotune.request import parse_options

    return dict(parse_options(pairs))


def _check_target(request: ProbeRequest, in_process: bool) -> None:
    """Refuse a target that cannot be imported, before any process starts. What needs the import
    (the attribute, the factory's options, the module's own errors) is found by whoever imports it:
    with --in-process this process (once: the probe reuses it), otherwise the probe's child, whose
    error comes back as the same one line. The parent never imports the workload for the child."""
    from autotune.request import check_target

    check_target(request.target)
    if in_process:
        from autotune.engine.probe import load_workload  # torch

        load_workload(request)


def _on_budget_device(device: str | None) -> bool:
    """Whether the probe runs on the cpu budget device: `--device cpu`, or no device with no CUDA
    (read from torch's build without importing torch where it is a CPU-only build)."""
    if device is not None:
        return device.strip().lower() == "cpu"
    from autotune.request import cpu_only_torch

    if cpu_only_torch():
        return True
    import torch

    return not torch.cuda.is_available()


def _check_ignored_flags(fields: dict[str, Any], timeout: float | None, in_process: bool) -> None:
    """Flags that would have no effect are refused, naming why, rather than silently ignored."""
    if fields["search"] in (None, "predict") and fields["start_batch"] != 1:
        raise ConfigError(
            f"--start-batch {fields['start_batch']} is for --search plain: the default search (--search predict) "
            "starts from two timeline trials at small sizes and predicts from them; add --search plain, or drop "
            "--start-batch"
        )
    if timeout is not None and in_process:
        raise ConfigError(
            "--timeout bounds the isolated probe process, and --in-process runs the search in this process, "
            "which nothing kills at a timeout: drop --in-process to have the timeout, or drop --timeout"
        )
    if not fields["confirm"] and fields["confirm_steps"] != 2:
        raise ConfigError(
            f"--confirm-steps {fields['confirm_steps']} sizes the fresh-process confirmation, and --no-confirm "
            "skips it: drop one of them"
        )
    if fields["effective_batch"] is None:
        if fields["world_size"] > 1 and fields["parallel"] != "fsdp":
            raise ConfigError(
                f"--world-size {fields['world_size']} splits --effective-batch across ranks (and is the ranks "
                "--parallel fsdp shards over); with neither, it changes nothing: add --effective-batch E, or "
                "drop --world-size (a DDP rank's answer does not depend on the number of ranks)"
            )
        if fields["policy"] is not Policy.FEWEST_STEPS:
            raise ConfigError(
                f"--policy {fields['policy'].value} chooses how --effective-batch is split, and no "
                "--effective-batch is given: add --effective-batch E, or drop --policy"
            )
    flags = [
        flag
        for flag, given in (
            ("--budget free", fields["budget"] == "free"),
            ("--min-free-memory", fields["min_free_memory"] is not None),
        )
        if given
    ]
    if flags and _on_budget_device(fields["device"]):
        where = "--device cpu is" if fields["device"] is not None else "without CUDA here, the probe runs on"
        raise ConfigError(
            f"{flags[0]} applies to a CUDA device, and {where} the cpu budget device, whose memory no other "
            f"process holds: drop {flags[0]}"
            + (" (size the budget device with --memory)" if "budget" in flags[0] else "")
        )


def _check_cpu_budget(request: Any, settings: Any) -> None:
    """The budget device really allocates the memory it simulates, in host RAM: refuse a size the
    host cannot hold, and one above AUTOTUNE_MAX_CPU_MEMORY (the cap the service has too), before
    the probe reports host failures as out-of-memory trials and answers by host RAM (or its child
    is killed by the host). The size is --memory's, else AUTOTUNE_CPU_MEMORY's, and the message
    names the one that set it. (Called for the budget device only.)"""
    if request.memory is not None:
        size, source, fix = request.memory, "--memory", "probe a smaller --memory"
    else:
        size, source, fix = settings.cpu_memory, "AUTOTUNE_CPU_MEMORY", "lower AUTOTUNE_CPU_MEMORY or give --memory"
    cap = settings.max_cpu_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > cap:
        raise ConfigError(
            f"{source} {format_bytes(size)} on the cpu budget device allocates that much host RAM, "
            f"above AUTOTUNE_MAX_CPU_MEMORY ({format_bytes(cap)}): raise AUTOTUNE_MAX_CPU_MEMORY to allow it, "
            f"or {fix}"
        )
    if size > host:
        raise ConfigError(
            f"{source} {format_bytes(size)} on the cpu budget device needs that much host RAM, "
            f"and this host has {format_bytes(host)}: {fix} (it is a simulation: the answer scales) or run "
            "on the GPU"
        )


def _check_timeout(seconds: float, name: str) -> None:
    if math.isfinite(seconds) and seconds > 0:
        return
    if name.startswith("--"):
        raise ConfigError(
            f"{name} {seconds:g} is not a number of seconds above 0: give one, for example {name} 900, "
            "or leave it out for AUTOTUNE_PROBE_TIMEOUT (900 s)"
        )
    raise ConfigError(
        f"environment variable {name}={os.environ.get(name, str(seconds))!r} is not a finite number of seconds "
        "above 0: fix it (900 is the default) or unset it"
    )


def _check_multiple(effective_batch: int, world_size: int) -> None:
    if effective_batch % world_size:
        lower = effective_batch // world_size * world_size
        hint = f"{lower} or {lower + world_size}" if lower else str(world_size)
        raise ConfigError(
            f"--effective-batch {effective_batch} is not a multiple of --world-size {world_size}: every rank "
            f"runs the same micro-batches; use {hint}"
        )


def _planned_steps(per_rank: int, max_micro_batch: int, policy: Policy) -> int | None:
    """The plan's accumulation steps, or None when there would be more than MAX_ACCUMULATION_STEPS
    (found without building the plan: its list is what must not be built)."""
    fewest = -(-per_rank // max_micro_batch)
    if policy is Policy.FEWEST_STEPS or fewest > MAX_ACCUMULATION_STEPS:
        return fewest if fewest <= MAX_ACCUMULATION_STEPS else None
    # exact: the fewest steps a >= fewest that divide the per-rank batch.
    return next((a for a in range(fewest, min(per_rank, MAX_ACCUMULATION_STEPS) + 1) if per_rank % a == 0), None)


def _check_plan_steps(effective_batch: int, max_micro_batch: int, world_size: int, policy: Policy) -> None:
    per_rank = effective_batch // world_size
    if _planned_steps(per_rank, max_micro_batch, policy) is not None:
        return
    fewest = -(-per_rank // max_micro_batch)
    ranks = f" over --world-size {world_size}" if world_size > 1 else ""
    if fewest <= MAX_ACCUMULATION_STEPS:  # only policy exact goes past the bound
        raise ConfigError(
            f"--policy exact needs more than {MAX_ACCUMULATION_STEPS:,} accumulation steps for --effective-batch "
            f"{effective_batch}{ranks} (no micro-batch of at most {max_micro_batch} divides {per_rank} in fewer): "
            f"use --policy fewest-steps ({fewest} steps)"
        )
    raise ConfigError(
        f"--effective-batch {effective_batch}{ranks} with micro-batches of at most {max_micro_batch} needs "
        f"{fewest:,} accumulation steps, more than the {MAX_ACCUMULATION_STEPS:,} planned: check the number, or "
        "raise the micro-batch"
    )


def _check_effective_batch(effective_batch: int, world_size: int, max_batch: int | None) -> None:
    """What can be checked of a probe's plan before the probe: the multiple, the size per rank, and
    the number of steps when --max-batch bounds the answer."""
    _check_multiple(effective_batch, world_size)
    per_rank = effective_batch // world_size
    if max_batch is not None and -(-per_rank // max_batch) > MAX_ACCUMULATION_STEPS:
        _check_plan_steps(effective_batch, max_batch, world_size, Policy.FEWEST_STEPS)
    if per_rank > MAX_SAMPLES_PER_RANK:
        raise ConfigError(
            f"--effective-batch {effective_batch} is {per_rank:,} samples per rank, more than the "
            f"{MAX_SAMPLES_PER_RANK:,} a probe plans for: check the number"
        )


def _settings() -> Settings:
    """The AUTOTUNE_* settings, or a ConfigError naming the variable that is wrong and its value."""
    from autotune.settings import get_settings

    try:
        return get_settings()
    except (AutotuneError, ValueError) as exc:
        raise ConfigError(_environment_message(exc)) from None


def _environment_message(exc: Exception) -> str:
    from autotune.settings import Settings

    found = []
    blank = Settings.model_construct()
    for key, value in sorted(os.environ.items()):
        name = key.lower().removeprefix("autotune_")
        if not key.upper().startswith("AUTOTUNE_") or name not in Settings.model_fields:
            continue
        try:
            Settings.__pydantic_validator__.validate_assignment(blank, name, value)
        except (AutotuneError, ValueError) as bad:
            errors = getattr(bad, "errors", None)
            reason = errors()[0]["msg"] if callable(errors) else str(bad)
            found.append(f"environment variable {key}={value!r}: {reason}")
    if not found:
        return f"bad AUTOTUNE_* environment variable: {' '.join(str(exc).split())}"
    return "; ".join(found) + ": fix it or unset it"


def _flag(field: str) -> str:
    return {"target": "TARGET", "options": "-o/--option"}.get(field, "--" + field.replace("_", "-"))


def _validation_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = [f"{_flag(str(e['loc'][0])) if e['loc'] else 'input'}: {e['msg']}" for e in errors()]
        return "; ".join(parts)
    return str(exc)


# --- the entry point ----------------------------------------------------------------------------------

# Click's exception classes (recent typer vendors click, older typer uses click itself), found from a
# public name so that this works with both.
_CLICK_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _wants_json(args: Sequence[str]) -> bool:
    return "--json" in (args[: args.index("--")] if "--" in args else args)


_emitted: list[bool] = []  # a JSON document went to stdout in this run (one document, never two)


def _emit_json(text: str) -> None:
    sys.stdout.write(text + "\n")
    _emitted.append(True)


_debug: list[bool] = []  # --debug was given in this run


def _debugging() -> bool:
    if _debug:
        return True
    from autotune.settings import get_settings

    try:
        return get_settings().debug
    except (AutotuneError, ValueError):  # a bad AUTOTUNE_* variable: its own error says so
        return False


def _fail(
    message: str, code: int, label: str, data: dict[str, Any], as_json: bool, exc: BaseException | None = None
) -> int:
    if exc is not None and _debugging():
        import traceback

        # The user's code's traceback (a workload's error, maybe from the probe's process), or ours.
        text = getattr(exc, "traceback", None) or "".join(traceback.format_exception(exc))
        err.print(text.rstrip("\n"), highlight=False, markup=False)
    err.print(f"[red]{label}:[/] {escape(message)}", highlight=False)
    if as_json and not _emitted:  # after the result (a plot or publish failed), stderr says it
        _emit_json(json.dumps({"error": {**data, "exit_code": code}}, indent=2))
    return code


def run(args: Sequence[str]) -> int:
    """Run the CLI on `args` (without the program name) and return its exit code: 0, 1 when a probe
    (or the service, or a device) failed, 2 for bad input, 130/143 for a probe interrupted by
    SIGINT/SIGTERM. Messages go to stderr, one line each."""
    args = list(args)
    as_json = _wants_json(args)
    _emitted.clear()
    _debug.clear()
    split = args.index("--") if "--" in args else len(args)
    if "--debug" in args[:split]:  # a root option, also taken after the command, where people type it
        args = [a for a in args[:split] if a != "--debug"] + args[split:]
        _debug.append(True)
    # "probe failed: ...", "estimate failed: ...": the command named, as the user typed it.
    command = next((a for a in (args[: args.index("--")] if "--" in args else args) if not a.startswith("-")), "")
    failed = f"{command} failed" if command == "estimate" else "probe failed"
    try:
        code = typer.main.get_command(app).main(args, prog_name="autotune", standalone_mode=False)
    except (ConfigError, DeviceError) as exc:  # a device that does not exist here is bad input too
        return _fail(str(exc), 2, "error", report(exc), as_json, exc)
    except ProbeError as exc:
        return _fail(str(exc), 1, failed, report(exc), as_json, exc)
    except AutotuneError as exc:
        return _fail(str(exc), 1, "error", report(exc), as_json, exc)
    except _CLICK_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `autotune`: the help, as click prints it
            exc.show()  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", 2))
        message = " ".join(exc.format_message().split()).rstrip(".")  # type: ignore[attr-defined]
        context = getattr(exc, "ctx", None)
        where = f"; see '{context.command_path} --help'" if context is not None else ""
        data = {"type": "UsageError", "message": message}
        return _fail(message + where, int(getattr(exc, "exit_code", 2)), "error", data, as_json)
    except ProbeInterrupted as exc:  # its processes are gone: one line, and the JSON document
        err.print(exc.message, highlight=False, markup=False)
        if as_json and not _emitted:
            document = {
                "type": "Interrupted",
                "message": exc.message,
                "signal": exc.signal_name,
                "trials": exc.trials,
                "exit_code": exc.code,
            }
            _emit_json(json.dumps({"error": document}, indent=2))
        return exc.code
    except typer.Abort:
        err.print("aborted", highlight=False, markup=False)
        return 130
    except Exception as exc:  # noqa: BLE001 - nobody classified it (a workload's error with --in-process): one line
        from autotune.workloads.usercode import unexpected

        error = unexpected(exc)
        return _fail(str(error), 1, failed, report(error), as_json, error)
    return code if isinstance(code, int) else 0


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: exits with `run`'s code. Our errors and click's usage errors become one
    line on stderr (and a JSON error document on stdout with --json)."""
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
