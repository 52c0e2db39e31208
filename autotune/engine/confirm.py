"""Confirmation in a fresh process: the answer runs again where nothing of the probe is left.

A probe's process has a history the job's process will not have: on a GPU, a CUDA context whose
caching allocator has already split, cached and freed blocks for a dozen trials, and workspaces
that a fresh process allocates at other moments. So after the search, each answer runs again in its own loop,
and the plan's micro-batch in the plan's loop unless a larger size that passed covers it, in a
**new interpreter** (`python -m autotune.engine.confirm` with this process's `sys.path`, never a re-import
of the caller's `__main__`), one process per size, under the same limit, for `confirm_steps`
optimizer steps of up to `CONFIRM_MICRO_STEPS` micro-steps when the loop accumulates.

When a size runs out of memory there, the answer steps down (a few more runs, each in its own fresh
process: a guess from the failed run, then wider steps, then a bisection) to the largest size that passes, the
plan is made again from the lowered answers, and whatever the new plan runs is confirmed in turn.
A run that fitted only by the caching allocator freeing its cache and retrying is at the edge,
where details of the loop decide: that size runs again with EDGE_MARGIN_BYTES less, and steps down
if it does not fit there. The result's `confirmation` says what ran, what passed and what changed.

A run's progress (the process starting, then each micro-step, throttled) streams back as it goes,
for the command line's display; an interrupted caller kills and reaps the run's process before the
exception leaves `run_fresh`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel

from autotune import errors
from autotune.engine import lock, zygote
from autotune.engine.isolation import hold_interrupts
from autotune.engine.search import search_from_guess
from autotune.errors import NothingFitsError, ProbeError, ProbeTimeoutError
from autotune.progress import ProgressCallback, TrialProgress, throttled
from autotune.request import ProbeRequest, TrialCallback, with_plan
from autotune.results import Confirmation, ConfirmationCheck, LoopShape, ProbeResult, TrialRecord
from autotune.units import format_bytes

# Micro-steps of an accumulating confirmation run: the second and third both run with gradients
# alive, so a third shows that nothing grows from one accumulated micro-step to the next.
CONFIRM_MICRO_STEPS = 3
# A fresh run repeats the probe's trial at the same size: its peak allocated bytes must agree with the
# probe's within this fraction (or PEAK_SLACK_BYTES, for workspaces a fresh CUDA context allocates at
# other moments). Further apart, the step does not repeat what the probe measured (state kept between
# calls, a cache, shapes that depend on the process) and the answer is flagged, not confirmed.
PEAK_TOLERANCE = 0.10
PEAK_SLACK_BYTES = 1 << 20
# A size that fitted only because the caching allocator freed its cache and retried (its
# num_alloc_retries grew) is at the edge, where a 2 MiB small-pool segment decides. On the H100 (gpt
# at 2 GiB, 2026-11-26) 137 samples fitted the confirmation with two retries and ran out at step 2 of
# a plain loop (bench/cuda_truth.py) whose tiny tensors (its loss divided once more, its batch freed
# sooner) pinned one small segment more: its retry released four where the probe's released five,
# and the 274 MiB it asked for no longer fitted (bench/trace_loops.py's traces). A user's loop differs
# from the probe's in such details, so a size at the edge must also fit a fresh run with the limit
# lowered by two small segments, or it steps down.
EDGE_MARGIN_BYTES = 4 << 20
# Checks: each answer and the plan once, and again after a step-down lowers one (at most two
# lowerings per loop kind can change what the plan runs); more is a bug.
MAX_CHECKS = 8


def _resolved(request: ProbeRequest, result: ProbeResult) -> ProbeRequest:
    return request.model_copy(update={"confirm_steps": request.confirmation_steps(result.device.kind)})


RunCallback = Callable[[TrialRecord], None]
FreshRun = Callable[[int, LoopShape, int], TrialRecord]  # (batch, loop, bytes below the limit)


class FreshRunRequest(BaseModel):
    """What a fresh process needs to run one trial of a probed answer."""

    probe: ProbeRequest
    batch: int
    loop: LoopShape
    device_kind: str
    device_index: int | None
    total_bytes: int
    limit_bytes: int


# Deciding what to confirm (pure) ---------------------------------------------------------------
def _loop(micro_steps: int, request: ProbeRequest) -> LoopShape:
    return LoopShape(micro_steps=micro_steps, steps=request.confirmation_steps("cpu-budget"), prefetch=request.prefetch)


def checks_for(result: ProbeResult, request: ProbeRequest) -> list[tuple[str, int, LoopShape]]:
    """(answer name, micro-batch, loop) for each run the result's answers and plan need.

    Both answers are confirmed (a stored result answers later plans too); the plan's micro-batch
    is confirmed in its own loop, which a larger answer that passed in the same loop kind covers
    (memory grows with the batch), so `confirm_answers` runs it only when nothing covers it."""
    todo: list[tuple[str, int, LoopShape]] = []
    if result.max_micro_batch is not None:
        todo.append(("max_micro_batch", result.max_micro_batch, _loop(CONFIRM_MICRO_STEPS, request)))
    if result.max_micro_batch_without_accumulation is not None:
        single = result.max_micro_batch_without_accumulation
        todo.append(("max_micro_batch_without_accumulation", single, _loop(1, request)))
    if result.plan is not None:
        p = result.plan
        micro = 1 if p.accumulation_steps == 1 else min(p.accumulation_steps, CONFIRM_MICRO_STEPS)
        todo.append(("plan", p.micro_batch, _loop(micro, request)))
    return todo


def lowered(result: ProbeResult, request: ProbeRequest, accumulates: bool, confirmed: int) -> ProbeResult:
    """The result with the answer for one loop kind lowered to what passed in a fresh process.

    An accumulating loop holds more than one micro-step, so lowering the one-micro-step answer
    lowers the accumulation answer with it."""
    single = result.max_micro_batch_without_accumulation
    acc = result.max_micro_batch
    if accumulates:
        acc = None if acc is None else min(acc, confirmed)
    else:
        single = confirmed if single is None else min(single, confirmed)
        acc = None if acc is None else min(acc, single)
    updated = result.model_copy(
        update={"max_micro_batch": acc, "max_micro_batch_without_accumulation": single, "capped": False}
    )
    return with_plan(updated, request)


def probe_peak(result: ProbeResult, batch: int, loop: LoopShape) -> int | None:
    """The probe's peak allocated bytes at `batch` in `loop`'s kind (accumulating or not), if it ran one."""
    peaks = [
        t.peak_allocated_bytes
        for t in result.trials
        if t.batch == batch
        and t.fits
        and t.peak_allocated_bytes is not None
        and (t.micro_steps > 1) == loop.accumulates
        and t.prefetch == loop.prefetch
    ]
    return max(peaks) if peaks else None


def peak_mismatch(name: str, batch: int, fresh_peak: int | None, probe_peak: int | None) -> str | None:
    """Why a fresh run that fitted does not confirm the probe: peaks further apart than the tolerance."""
    if probe_peak is None or fresh_peak is None:
        return None
    apart = abs(fresh_peak - probe_peak)
    if apart <= max(PEAK_TOLERANCE * probe_peak, PEAK_SLACK_BYTES):
        return None
    return (
        f"{name} {batch}: the fresh process peaked at {format_bytes(fresh_peak)}, the probe at "
        f"{format_bytes(probe_peak)} ({apart / max(probe_peak, 1):.0%} apart; the tolerance is "
        f"{PEAK_TOLERANCE:.0%} or {format_bytes(PEAK_SLACK_BYTES)}): the step does not repeat what the probe measured "
        "(state kept between calls, a cache, shapes that depend on the process?), so its fitting there confirms nothing"
    )


def confirm_answers(
    result: ProbeResult, request: ProbeRequest, fresh_run: FreshRun, on_run: RunCallback | None = None
) -> ProbeResult:
    """Run the result's answer (or plan) again with `fresh_run`, stepping down where it fails."""
    started = time.perf_counter()
    request = _resolved(request, result)
    checks: list[ConfirmationCheck] = []
    passed_upto: dict[bool, int] = {}  # accumulates -> largest size that passed
    stepped = False
    edge_runs = 0  # sizes run again with EDGE_MARGIN_BYTES less
    for _check in range(MAX_CHECKS):
        # One check at a time, each chosen from the result as it now stands: a lowered answer
        # changes the plan, and a size that a larger passing one covers needs no run.
        todo = next(
            (
                (name, batch, loop)
                for name, batch, loop in checks_for(result, request)
                if batch > passed_upto.get(loop.accumulates, 0)
            ),
            None,
        )
        if todo is None:
            break
        name, batch, loop = todo
        runs: list[TrialRecord] = []

        def run(
            size: int, loop: LoopShape = loop, runs: list[TrialRecord] = runs, limit: int = result.limit_bytes
        ) -> TrialRecord:
            nonlocal edge_runs
            record = fresh_run(size, loop, 0)
            runs.append(record)
            if on_run is not None:
                on_run(record)
            if record.fits and at_the_edge(record) and limit > EDGE_MARGIN_BYTES:
                edge_runs += 1
                again = fresh_run(size, loop, EDGE_MARGIN_BYTES)
                runs.append(again)
                if on_run is not None:
                    on_run(again)
                if not again.fits:
                    return again  # a failure at this size: the step-down takes it from here
            return record

        confirmed: int | None
        first = run(batch)
        probe_peak_bytes = probe_peak(result, batch, loop)
        mismatch: str | None = None
        if first.fits:
            confirmed = batch
            mismatch = peak_mismatch(name, batch, first.peak_allocated_bytes, probe_peak_bytes)
        else:
            stepped = True
            confirmed = _step_down(run, first, result.limit_bytes, result.granularity)
        checks.append(
            ConfirmationCheck(
                answer=name,  # type: ignore[arg-type]
                loop=loop,
                searched=batch,
                confirmed=confirmed,
                runs=runs,
                probe_peak_bytes=probe_peak_bytes,
                mismatch=mismatch,
            )
        )
        if confirmed is None:
            raise NothingFitsError(
                f"the probe's answer {batch} ran out of memory in a fresh process ({loop.describe()}), "
                f"and so did every size down to {result.granularity}: {runs[-1].oom_message}",
                peak_bytes=runs[-1].peak_allocated_bytes,
                limit_bytes=result.limit_bytes,
            )
        passed_upto[loop.accumulates] = max(passed_upto.get(loop.accumulates, 0), confirmed)
        if confirmed < batch:
            result = lowered(result, request, loop.accumulates, confirmed)
    else:
        raise ProbeError("the fresh-process confirmation did not settle: report this as a bug")
    mismatches = [c.mismatch for c in checks if c.mismatch]
    if stepped:
        status, note = (
            "stepped-down",
            ("an answer ran out of memory in a fresh process and was lowered to the largest size that passed there"),
        )
    elif mismatches:
        status, note = "mismatch", "not confirmed: " + "; ".join(mismatches)
    else:
        status, note = "passed", "every answer fitted in a fresh process"
    if edge_runs:
        note += (
            f" ({edge_runs} size(s) fitted only by the allocator freeing its cache and retrying, and ran again with "
            f"{format_bytes(EDGE_MARGIN_BYTES)} less, as a loop whose small tensors pin more of its cache would have)"
        )
    confirmation = Confirmation(
        status=status,  # type: ignore[arg-type]
        passed=status == "passed",
        steps=request.confirmation_steps(result.device.kind),
        checks=checks,
        seconds=time.perf_counter() - started,
        note=note,
    )
    return result.model_copy(update={"confirmation": confirmation})


def _step_down(
    run: Callable[[int], TrialRecord], failed: TrialRecord, limit_bytes: int, granularity: int
) -> int | None:
    """The largest size below the failed one that passes, in few fresh processes.

    The first guess scales the failed size by limit / the peak it reached when it ran out (an
    overestimate: that peak stops at the failing allocation); then the walk and bisection of
    `search_from_guess`, in steps of a few percent."""
    below = (failed.batch - 1) // granularity * granularity  # plan sizes need not be on the grid
    if below < granularity:
        return None
    guess = below
    if failed.peak_allocated_bytes:
        guess = min(below, max(granularity, failed.batch * limit_bytes // failed.peak_allocated_bytes))
    try:
        outcome = search_from_guess(run, guess, cap=below, granularity=granularity, relative_miss=32)
    except NothingFitsError:
        return None
    return outcome.max_micro_batch


def at_the_edge(record: TrialRecord) -> bool:
    """Whether a run that fitted needed the caching allocator to free its cache and retry (see
    EDGE_MARGIN_BYTES): only a device with an allocator says (CUDA, the budget device's model)."""
    return record.allocator is not None and record.allocator.retries > 0


def skipped(result: ProbeResult, request: ProbeRequest) -> ProbeResult:
    confirmation = Confirmation(
        status="skipped",
        passed=False,
        steps=request.confirmation_steps(result.device.kind),
        note="unconfirmed (--no-confirm): the answer was not run again in a fresh process",
    )
    return result.model_copy(update={"confirmation": confirmation})


# Running in a fresh process ---------------------------------------------------------------------
def fresh_runner(
    result: ProbeResult, request: ProbeRequest, timeout: float, on_progress: ProgressCallback | None = None
) -> FreshRun:
    """A `FreshRun` that starts a new interpreter for every run."""

    def fresh_run(batch: int, loop: LoopShape, below_limit: int) -> TrialRecord:
        job = FreshRunRequest(
            probe=request,
            batch=batch,
            loop=loop,
            device_kind=result.device.kind,
            device_index=result.device.index,
            total_bytes=result.budget_bytes if result.device.kind == "cpu-budget" else result.device.total_bytes,
            limit_bytes=result.limit_bytes - below_limit,
        )
        record = run_fresh(job, timeout, on_progress)
        return record.model_copy(update={"limit_bytes": job.limit_bytes}) if below_limit else record

    return fresh_run


def run_fresh(job: FreshRunRequest, timeout: float, on_progress: ProgressCallback | None = None) -> TrialRecord:
    """Run one trial in a new `python -m autotune.engine.confirm` process; its record or our error.

    The request goes in on the child's stdin and the answer comes back on a pipe of its own (the
    workload may print on stdout): no file is written, so a full disk cannot fail a probe.
    `on_progress` hears the process start, then its micro-steps (phase "confirm", seconds since
    the process started), from a thread of its own."""
    read_end, write_end = os.pipe()
    chunks: list[bytes] = []
    launched = time.monotonic()
    relay: ProgressCallback | None = None
    if on_progress is not None:
        callback = on_progress

        def relay(p: TrialProgress) -> None:
            callback(p.model_copy(update={"phase": "confirm", "seconds": time.monotonic() - launched}))

        relay(
            TrialProgress(
                batch=job.batch, step=0, steps=job.loop.steps, micro_step=0, micro_steps=job.loop.micro_steps, seconds=0
            )
        )
    reader = threading.Thread(target=_drain, args=(read_end, chunks, relay), daemon=True)
    release = hold_interrupts()  # until the child is in the `try` that ends it
    try:
        child, _ = zygote.spawn(
            ["autotune.engine.confirm", str(write_end)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(write_end,),
        )
    except BaseException:
        os.close(read_end)
        release()
        raise
    finally:
        os.close(write_end)  # the child holds its own copy: EOF comes when it exits
    reader.start()
    try:
        release()
        _, stderr = child.communicate(job.model_dump_json().encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise ProbeTimeoutError(
            f"the fresh-process confirmation of batch {job.batch} ran past {timeout:g} s and was killed: "
            "raise the timeout (--timeout, AUTOTUNE_PROBE_TIMEOUT) or lower --confirm-steps"
        ) from None
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the run must not outlive the caller
        child.kill()
        child.wait()
        raise
    finally:
        reader.join(timeout=10)
    text = b"".join(chunks).decode(errors="replace")
    if not text:
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise errors.ProbeCrashedError(
            f"the fresh-process confirmation of batch {job.batch} exited with code {child.returncode} "
            f"without an answer: {tail[0]}"
        )
    answer = json.loads(text.splitlines()[-1])
    if "error" in answer:
        raise errors.from_report(
            answer["error"], message=f"confirmation in a fresh process: {answer['error'].get('message')}"
        )
    record = TrialRecord.model_validate(answer["trial"])
    # The progress lines count from the process's start: the record says that time too.
    return record.model_copy(update={"process_seconds": time.monotonic() - launched})


def _drain(fd: int, chunks: list[bytes], on_progress: ProgressCallback | None) -> None:
    # JSON lines: progress reports as they come, then the answer (kept in `chunks`).
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            if line.startswith(b'{"progress"'):
                if on_progress is not None:
                    on_progress(TrialProgress.model_validate(json.loads(line)["progress"]))
            else:
                chunks.append(line)


def _child(answer_fd: int) -> None:
    # Its stdin is read to its end at once, so nothing there says that the caller has gone: this
    # run dies with the process that started it (the fork server, or the caller without one).
    zygote.die_with_parent(os.getppid())
    job = FreshRunRequest.model_validate_json(sys.stdin.buffer.read())
    answer: dict[str, object]
    with os.fdopen(answer_fd, "w") as pipe:

        def send(progress: TrialProgress) -> None:
            pipe.write(json.dumps({"progress": progress.model_dump(mode="json")}) + "\n")
            pipe.flush()

        from autotune.workloads import usercode

        # As in the isolated search's child: a KeyboardInterrupt with no SIGINT is the workload's error.
        with usercode.telling_interrupts_apart():
            try:
                answer = {"trial": _one_trial(job, throttled(send)).model_dump(mode="json")}
            except errors.AutotuneError as exc:
                answer = {"error": errors.report(exc, with_traceback=True)}
            except (Exception, KeyboardInterrupt) as exc:  # reported to the parent as a failed confirmation
                if not isinstance(exc, Exception) and not usercode.raised_by_code(exc):
                    raise
                answer = {"error": errors.report(usercode.unexpected(exc), with_traceback=True)}
        pipe.write(json.dumps(answer) + "\n")


def _one_trial(job: FreshRunRequest, on_progress: ProgressCallback | None = None) -> TrialRecord:
    from autotune.devices.budget import BudgetDevice
    from autotune.devices.device import ProbeDevice
    from autotune.engine.probe import load_workload
    from autotune.engine.trial import TrialRunner

    workload = load_workload(job.probe)
    device: ProbeDevice
    if job.device_kind == "cuda":
        from autotune.devices.cuda import CudaDevice, apply_allocator_config

        apply_allocator_config(job.probe.allocator_config)
        device = CudaDevice(job.device_index or 0, job.limit_bytes)
    else:
        device = BudgetDevice(
            job.total_bytes,
            job.limit_bytes,
            allocator=job.probe.allocator,
            allocator_config=job.probe.allocator_config or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            card=job.probe.card,
        )
    try:
        runner = TrialRunner(
            workload, device, steps=job.loop.steps, on_progress=on_progress, max_steps=job.probe.max_steps
        )
    except NothingFitsError as exc:
        # The model alone did not fit in this process: as much an answer as an OOM in a step.
        return TrialRecord(
            batch=job.batch,
            fits=False,
            micro_steps=job.loop.micro_steps,
            prefetch=job.loop.prefetch,
            peak_allocated_bytes=exc.peak_bytes,
            seconds=0.0,
            oom_message=str(exc),
        )
    return runner.run(job.batch, job.loop)


# Probe, then confirm -----------------------------------------------------------------------------
def probe_and_confirm(
    request: ProbeRequest,
    *,
    timeout: float,
    in_process: bool = False,
    on_trial: TrialCallback | None = None,
    on_run: RunCallback | None = None,
    on_progress: ProgressCallback | None = None,
    wait_for_device: bool = True,
    on_wait: lock.WaitCallback | None = None,
) -> ProbeResult:
    """Search (in an isolated child, or here), then confirm in fresh processes unless the
    request says not to. What the CLI, the service and the client's local fallback run.
    `on_progress` hears the micro-steps inside trials and confirmation runs (throttled).

    The device's lock (`autotune.engine.lock`) is held throughout, by this process for all of the
    probe's: while another probe holds it, this one waits (`on_wait` hears who holds it), or
    raises DeviceBusyError with `wait_for_device=False`."""
    with (
        lock.device_lock(request.device, wait=wait_for_device, on_wait=on_wait) as device_key,
        zygote.serving(zygote.forks_for(device_key)),
    ):
        result = _probe_and_confirm(request, timeout, in_process, on_trial, on_run, on_progress)
        if request.compare_allocator_config is not None:
            result = _compared(result, request, timeout, in_process)
        return result


def _compared(result: ProbeResult, request: ProbeRequest, timeout: float, in_process: bool) -> ProbeResult:
    """`result` with the answers of the same probe under the compared allocator settings: a second
    search, unconfirmed (its process starts with those settings; on the budget device, its model)."""
    from autotune.results import AllocatorComparison

    other = request.model_copy(
        update={
            "allocator_config": request.compare_allocator_config,
            "compare_allocator_config": None,
            "confirm": False,
        }
    )
    try:
        compared = _probe_and_confirm(other, timeout, in_process, None, None, None)
    except errors.AutotuneError as exc:  # the result stands; the comparison says why it has none
        note = f"the probe with {request.compare_allocator_config} did not answer, so there is no comparison: {exc}"
        return result.model_copy(update={"notes": [*result.notes, note]})
    comparison = AllocatorComparison(
        allocator_config=request.compare_allocator_config or "",
        max_micro_batch=compared.max_micro_batch,
        max_micro_batch_without_accumulation=compared.max_micro_batch_without_accumulation,
        trials=len(compared.trials),
    )
    return result.model_copy(update={"allocator_comparison": comparison})


def _probe_and_confirm(
    request: ProbeRequest,
    timeout: float,
    in_process: bool,
    on_trial: TrialCallback | None,
    on_run: RunCallback | None,
    on_progress: ProgressCallback | None,
) -> ProbeResult:
    if in_process:
        from autotune.engine.probe import run_probe  # torch: the isolated path leaves it to the child

        relay = None if on_progress is None else throttled(on_progress)
        result = run_probe(request, on_trial=on_trial, on_progress=relay)
        _release_cuda_cache()
    else:
        from autotune.engine.isolation import run_isolated

        result = run_isolated(request, timeout, on_trial=on_trial, on_progress=on_progress)
    if result.checkpointing is not None:
        # The setting chosen among several: the fresh processes rebuild the workload with it.
        request = request.model_copy(update={"checkpointing": result.checkpointing.chosen})
    if not request.confirm:
        return skipped(result, request)
    return confirm_answers(result, request, fresh_runner(result, request, timeout, on_progress), on_run)


def _release_cuda_cache() -> None:
    # In-process probes leave their cached blocks with this process; the confirmation's fresh
    # process shares the card, so give back what can be given (the context itself stays).
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def main() -> None:
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.stderr.write("usage: python -m autotune.engine.confirm ANSWER_FD < REQUEST.json (autotune's own use)\n")
        sys.exit(2)
    _child(int(sys.argv[1]))


if __name__ == "__main__":
    main()
