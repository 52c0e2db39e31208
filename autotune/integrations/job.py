"""What the three integrations share: the job's batch as it is configured (kept unless asked
otherwise), the tune's progress and its log, and a process left as the tune found it.

The effective batch. `effective_batch=None` (the default) plans for the job's own: the per-device
batch x accumulation steps x world size it is configured with. `effective_batch=N` plans for N
samples per optimizer step, and `effective_batch="max"` asks for the largest micro-batch that fits
with no accumulation (the effective batch then follows the memory, and the training with it).

Progress. Each trial is logged at INFO (`autotune.integrations.<framework>`) in the command line's
words (`trial   3: batch     64 x2 fits peak    1.2 MiB   0.31 s`). On a terminal the command line's
live table shows the trials as they run; otherwise (a log file, CI) stderr gets the command line's
plain progress lines (that it is starting, when it has said nothing else a moment after it began;
each trial as it starts and ends, the step running at most once a second, a heartbeat while one runs
long), unless the log already writes INFO to stderr. At the end the plan is logged at INFO and each
of its warnings at WARNING, with the tune's seconds and, apart from them, the seconds it waited for
the device while another probe held it.

No side effects. torch's CPU random state (and CUDA's, when CUDA is initialized or is the job's
device), numpy's and `random`'s states, each module's train/eval mode and the model's device are put
back as they were: a seeded run after tuning is the run it would have been without it. The trials
restore the weights, and the gradient check never steps an optimizer.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from autotune.errors import ConfigError
from autotune.progress import TrialProgress
from autotune.results import FrameworkTuning, GradientCheck, JobBatch, ProbeResult, TrialRecord
from autotune.units import format_bytes

if TYPE_CHECKING:
    from autotune.cli.progress import ProgressLines, ProgressView

EffectiveBatch = int | Literal["max"] | None
Framework = Literal["transformers", "lightning", "accelerate"]
Source = Literal["job", "argument", "max"]


def valid_effective(effective_batch: object, *, who: str) -> None:
    """Refuse an `effective_batch` that is neither None, 'max' nor a number of samples."""
    if effective_batch is None or effective_batch == "max":
        return
    if isinstance(effective_batch, bool) or not isinstance(effective_batch, int) or effective_batch < 1:
        raise ConfigError(
            f"{who}: effective_batch must be a number of samples (1 or more), 'max', or None for the job's own; "
            f"got {effective_batch!r}"
        )


def planned_effective(
    effective_batch: object, job: JobBatch | None, *, who: str, unknown: str = ""
) -> tuple[int | None, Source]:
    """The effective batch to plan for and where it comes from; `unknown` says why the job's own
    is not known when `job` is None (the refusal's reason)."""
    valid_effective(effective_batch, who=who)
    if effective_batch == "max":
        return None, "max"
    if effective_batch is None:
        if job is None:
            raise ConfigError(
                f"{who}: {unknown}, so the job's effective batch is unknown: pass effective_batch= (samples per "
                "optimizer step over all processes), or effective_batch='max' for the largest micro-batch without "
                "accumulation"
            )
        return job.effective_batch, "job"
    assert isinstance(effective_batch, int)
    return effective_batch, "argument"


def loader_batch_size(loader: Any) -> int | None:
    """The samples per batch a DataLoader gives (its batch sampler's, when it has one), or None."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None


@contextmanager
def random_states_kept() -> Iterator[None]:
    """Run the block, then put back torch's CPU random state, numpy's and `random`'s (what a
    DataLoader's shuffling, its workers' seeds or a dataset's augmentation draw from)."""
    cpu_state = torch.get_rng_state()
    numpy_state = np.random.get_state()
    random_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        np.random.set_state(numpy_state)
        random.setstate(random_state)


def first_batch_size(loader: Any) -> int | None:
    """The samples in the first batch `loader` yields: built and read on the host (nothing is moved
    to a device), with the random states put back. None when it yields nothing, fails to, or its
    batch cannot be counted (`autotune.plans.batches.count_samples`)."""
    from autotune.plans.batches import count_samples

    iterator: Any = None
    with random_states_kept():
        try:
            iterator = iter(loader)
            batch = next(iterator)
        except Exception:  # noqa: BLE001 - the job's data: its errors are the scan's and the fit's to report
            return None
        finally:
            del iterator  # a loader's workers stop with their iterator
    try:
        size = count_samples(batch)
    except ConfigError:
        return None
    return size if size >= 1 else None


def custom_batch_sampler(loader: Any) -> str | None:
    """The class name of a DataLoader's batch_sampler when it is not torch's own BatchSampler (a
    `batch_sampler=` given to the loader); None for a loader built with `batch_size=`."""
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is None or type(sampler) is torch.utils.data.BatchSampler:
        return None
    return type(sampler).__name__


def samples_in(loader: Any) -> int | None:
    """len(loader.dataset), or None when it has none."""
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None


def yields_the_plan(yielded: int, micro: int, loader: Any) -> bool:
    """Whether a loader whose first batch has `yielded` samples runs micro-batches of `micro`: the
    same number, or all of a dataset smaller than one micro-batch."""
    return yielded == micro or (yielded < micro and samples_in(loader) == yielded)


def describe_job(job: JobBatch) -> str:
    steps = "step" if job.accumulation_steps == 1 else "steps"
    processes = "process" if job.world_size == 1 else "processes"
    return (
        f"{job.micro_batch} per device x {job.accumulation_steps} accumulation {steps} x {job.world_size} {processes}"
    )


def log_target(logger: logging.Logger, effective: int | None, source: Source, job: JobBatch | None) -> None:
    if source == "job" and job is not None:
        logger.info("autotune: planning for the job's effective batch %d (%s)", effective, describe_job(job))
    elif source == "argument":
        kept = "" if job is None else f"; the job was configured with {job.effective_batch} ({describe_job(job)})"
        logger.info("autotune: planning for effective batch %d, as asked%s", effective, kept)
    else:
        logger.info("autotune: effective_batch='max': the largest micro-batch that fits, no accumulation")


# No side effects ----------------------------------------------------------------------------------
@contextmanager
def preserved(model: nn.Module, device: torch.device | None = None) -> Iterator[None]:
    """Run the block, then put back the random states and the model's modes and device."""
    cuda = torch.cuda.is_available() and (torch.cuda.is_initialized() or (device is not None and device.type == "cuda"))
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    numpy_state = np.random.get_state()
    random_state = random.getstate()
    # Each module's own flag: a job may keep some modules in eval mode (a frozen BatchNorm), which
    # model.train(mode) for the whole model would undo.
    modes = [(module, module.training) for module in model.modules()]
    where = next((p.device for p in model.parameters()), None)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        np.random.set_state(numpy_state)
        random.setstate(random_state)
        for module, training in modes:
            module.training = training
        if where is not None and next(model.parameters()).device != where:
            model.to(where)


# Progress ---------------------------------------------------------------------------------------
def trial_line(number: int, record: TrialRecord) -> str:
    """A trial in the command line's words (its plain progress lines, `autotune.cli.progress`)."""
    verdict = "fits" if record.fits else "OOM "
    return (
        f"trial {number:3d}: batch {record.batch:6d} x{record.micro_steps} {verdict} "
        f"peak {format_bytes(record.peak_reserved_bytes):>10} {record.seconds:6.2f} s"
    )


class Reporter:
    """Where a tune's trials go: the log, the live table on a terminal or the plain progress lines
    otherwise, and the caller's callback; and how long the tune waited for its device."""

    def __init__(self, logger: logging.Logger, on_trial: Callable[[TrialRecord], None] | None = None) -> None:
        self.logger = logger
        self.trials = 0
        self.view: ProgressView | None = None  # the live table, on a terminal
        self.lines: ProgressLines | None = None  # the plain lines, on stderr that is not a terminal
        self.waits: list[float] = []  # when the device's lock said it was held, then free (time.time())
        self._on_trial = on_trial

    def trial(self, record: TrialRecord) -> None:
        self.trials += 1
        self.logger.info("%s", trial_line(self.trials, record))
        if self.lines is not None:
            self.lines.trial(record)
        elif self.view is not None:
            self.view.trial(record)
        if self._on_trial is not None:
            self._on_trial(record)

    def progress(self, progress: TrialProgress) -> None:
        if self.lines is not None:
            self.lines.progress(progress)
        elif self.view is not None:
            self.view.progress(progress)

    @property
    def waited(self) -> float:
        """Seconds the tune waited for its device (from the lock's first "waiting" to its "free")."""
        return self.waits[-1] - self.waits[0] if len(self.waits) >= 2 else 0.0

    def say(self, line: str) -> None:
        """A line for the person watching (the live table, or the plain lines); the log has it too."""
        if self.view is not None or self.lines is not None:
            from rich.text import Text

            from autotune.cli.app import err

            err.print(Text(line), highlight=False)


_current = threading.local()  # the Reporter of this thread's tune (`tuning_record` reads its wait)


class _LockWaits(logging.Filter):
    """The device lock's log lines of one thread (`autotune.engine.lock`: who holds the device, then
    that it is free), timed for its Reporter; the lines themselves go on as they would."""

    def __init__(self, reporter: Reporter) -> None:
        super().__init__()
        self.reporter, self.thread = reporter, threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread:
            self.reporter.waits.append(record.created)
        return True


def _logs_info_to_stderr(logger: logging.Logger) -> bool:
    """Whether `logger`'s INFO records reach stderr through a handler of its own or its ancestors'
    (then the trials are on stderr already, and the plain lines would say them twice)."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            stream = getattr(handler, "stream", None)
            if handler.level <= logging.INFO and stream in (sys.stderr, sys.__stderr__):
                return True
        current = current.parent if current.propagate else None
    return False


@contextmanager
def reporting(
    logger: logging.Logger,
    title: str,
    *,
    show: bool | None = None,
    on_trial: Callable[[TrialRecord], None] | None = None,
) -> Iterator[Reporter]:
    """A Reporter for the block. With `show` the command line's live table of the trials and the
    running one is drawn on stderr while the block runs; by default (`show=None`) when stderr is a
    terminal, and otherwise the command line's plain progress lines go to stderr (unless the log
    already writes INFO there); `show=False`: the log alone. The device lock's waits in this thread
    are timed (`Reporter.waited`), apart from the tune's seconds (`tuning_record`)."""
    reporter = Reporter(logger, on_trial)
    plain = show is None and not sys.stderr.isatty() and not _logs_info_to_stderr(logger)
    if show is None:
        show = sys.stderr.isatty()
    waits = _LockWaits(reporter)
    lock_log = logging.getLogger("autotune.engine.lock")
    lock_log.addFilter(waits)
    outer = getattr(_current, "reporter", None)
    _current.reporter = reporter
    try:
        if not show and not plain:
            yield reporter
            return
        from autotune.cli.app import err
        from autotune.cli.progress import ProgressLines, ProgressView

        view = ProgressView(title, isolated=False)
        if plain:
            lines = reporter.lines = ProgressLines(view, starting=f"{title}: starting, in this process")
            with lines.heartbeat():
                yield reporter
            return
        from rich.live import Live

        reporter.view = view
        with Live(view, console=err, auto_refresh=True, refresh_per_second=8):
            try:
                yield reporter
            finally:
                view.done = True  # the last frame: the table alone
    finally:
        _current.reporter = outer
        lock_log.removeFilter(waits)


def tuning_record(
    framework: Framework,
    *,
    job: JobBatch | None,
    effective: int | None,
    source: Source,
    tuned: tuple[int, int],
    world_size: int,
    check: GradientCheck | None,
    result: ProbeResult,
    started: float,
) -> FrameworkTuning:
    return FrameworkTuning(
        framework=framework,
        job=job,
        effective_batch=effective,
        effective_batch_from=source,
        tuned=JobBatch.of(tuned[0], tuned[1], world_size),
        gradient_check=check,
        trials=len(result.trials),
        # The tune's own seconds: a wait for the device (another probe held it) is said apart.
        seconds=max(0.0, time.perf_counter() - started - _waited()),
    )


def _waited() -> float:
    reporter: Reporter | None = getattr(_current, "reporter", None)
    return 0.0 if reporter is None else reporter.waited


def with_tuning(result: ProbeResult, tuning: FrameworkTuning, *warnings: str | None) -> ProbeResult:
    """The result with what the integration did, and its warnings (the gradient check's) among the plan's."""
    made = result.plan
    added = [w for w in warnings if w is not None]
    if added and made is not None:
        made = made.model_copy(update={"warnings": [*made.warnings, *added]})
    return result.model_copy(update={"framework": tuning, "plan": made})


def log_outcome(reporter: Reporter, result: ProbeResult, then: str) -> None:
    """The plan at INFO (and on the terminal), each of its warnings at WARNING."""
    tuning = result.framework
    assert tuning is not None
    tuned = tuning.tuned
    if tuning.effective_batch is None:
        what = f"micro-batch {tuned.micro_batch}, the largest that fits with no accumulation"
    else:
        what = (
            f"micro-batch {tuned.micro_batch} x {tuned.accumulation_steps} accumulation "
            f"step{'' if tuned.accumulation_steps == 1 else 's'} for the effective batch {tuning.effective_batch}"
        )
    line = f"autotune: {what} ({then}); {tuning.trials} trials in {tuning.seconds:.1f} s"
    if reporter.waited >= 0.05:
        line += f", after {reporter.waited:.1f} s waiting for the device (another probe held it)"
    reporter.logger.info("%s", line)
    reporter.say(line)
    for warning in result.plan.warnings if result.plan is not None else []:
        reporter.logger.warning("autotune: %s", warning)
