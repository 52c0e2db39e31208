"""Choosing activation checkpointing with the micro-batch (`--checkpointing auto`), by measured speed.

Checkpointing recomputes a block's activations in backward instead of keeping them from forward: a
larger micro-batch fits (fewer accumulation steps, better use of the device) at the cost of about
one more forward per checkpointed block. Whether it pays is measured, not assumed. Each candidate
setting (least checkpointing first) is probed like any setting, both loops, its plan made for the
effective batch, and the plan's micro-batch timed in the plan's loop by one more trial of
`autotune.engine.probe.TIMING_STEPS` optimizer steps (the fastest of its last step and the search's
trial at that size: load only ever slows a step down). A later setting's accumulating loop is predicted from its own
one-micro-step curve and what accumulating added under the setting before (`AccumulationSeed`),
without timeline trials of its own. The plans are compared as the throughput objective compares
micro-batches (`autotune.engine.objective.candidates`: accumulation steps x the measured time of a
micro-step, per optimizer step of the effective batch): the most samples per second wins, and a
setting within TIE_TOLERANCE of the fastest with less checkpointing wins over it (one step's time
is a single measurement; recomputing what is not needed is not worth a noise-sized gain).

The chosen setting's result is the result: its answers, plan, trials and fingerprint (which holds
the setting), confirmed in fresh processes that rebuild the workload with that setting, as every
answer is. `result.checkpointing` keeps every candidate and says why the chosen one won.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from autotune.engine.objective import candidates as timed_candidates
from autotune.engine.probe import AccumulationSeed, plan_loop
from autotune.errors import NothingFitsError, PlanError
from autotune.request import ProbeRequest, checkpointing_level
from autotune.results import CheckpointingCandidate, CheckpointingChoice, ProbeResult, TrialRecord

# Speeds within this fraction of the fastest are a tie, which less checkpointing wins.
TIE_TOLERANCE = 0.05

ProbeOne = Callable[[ProbeRequest, AccumulationSeed | None], ProbeResult]


def seed_from(result: ProbeResult, setting: str) -> AccumulationSeed | None:
    """What accumulating added to one micro-step's peak, at the largest micro-batch both loops ran and
    fitted in `result` (peaks as the limit counts them: reserved where the device has a cache)."""

    def peak(t: TrialRecord) -> int:
        return t.peak_reserved_bytes or t.peak_allocated_bytes or 0

    single = {t.batch: peak(t) for t in result.trials if t.fits and t.micro_steps == 1}
    accumulating = {t.batch: peak(t) for t in result.trials if t.fits and t.micro_steps > 1}
    common = sorted(set(single) & set(accumulating))
    if not common:
        return None
    batch = common[-1]
    return AccumulationSeed(extra_bytes=max(0, accumulating[batch] - single[batch]), setting=setting)


def candidate(setting: str, result: ProbeResult, request: ProbeRequest) -> CheckpointingCandidate:
    """One setting's answers, plan and measured speed: the fastest step of the plan's micro-batch in
    the plan's loop, over its trials there (without a plan, the accumulating answer's samples per
    second)."""
    made = result.plan
    loop = plan_loop(result)
    size = made.micro_batch if made is not None else result.max_micro_batch
    timed = [
        t
        for t in result.loop_trials(loop.micro_steps)
        if size is not None and t.batch == size and t.fits and t.step_seconds
    ]
    fields: dict[str, object] = {}
    if timed and size is not None:
        fastest = min(timed, key=lambda t: t.step_seconds or 0.0)
        step = fastest.step_seconds or 0.0
        (cost,) = timed_candidates({size: step}, request.effective_batch, request.world_size, request.policy)
        samples = request.effective_batch if made is not None else size
        fields = {
            "micro_batch": size,
            "accumulation_steps": None if made is None else made.accumulation_steps,
            "step_seconds": step,
            "seconds": cost.seconds,
            "samples_per_second": (samples or 0) / cost.seconds if made is not None else cost.samples_per_second,
            "peak_bytes": fastest.peak_reserved_bytes or fastest.peak_allocated_bytes,
        }
    return CheckpointingCandidate(
        setting=setting,
        max_micro_batch=result.max_micro_batch,
        max_micro_batch_without_accumulation=result.max_micro_batch_without_accumulation,
        answers=result.answers,
        plan=made,
        trials=result.trials,
        fingerprint=result.fingerprint,
        **fields,  # type: ignore[arg-type]
    )


def choose(options: list[CheckpointingCandidate]) -> tuple[CheckpointingCandidate, str]:
    """The winner among timed candidates and why: the most samples per second, less checkpointing
    within TIE_TOLERANCE of it. Raises ValueError when none was timed."""
    timed = [c for c in options if c.samples_per_second]
    if not timed:
        raise ValueError("no checkpointing setting was timed")
    fastest = max(timed, key=lambda c: c.samples_per_second or 0.0)
    best = fastest.samples_per_second or 0.0
    tied = [c for c in timed if (c.samples_per_second or 0.0) >= best * (1 - TIE_TOLERANCE)]
    winner = min(tied, key=lambda c: checkpointing_level(c.setting))
    said = "; ".join(_words(c) for c in options)
    if len(timed) == 1:
        why = f"{winner.setting} is the only setting that fits"
    elif winner is fastest:
        runner_up = max((c for c in timed if c is not winner), key=lambda c: c.samples_per_second or 0.0)
        gain = best / (runner_up.samples_per_second or best) - 1
        why = f"{winner.setting} is the fastest, {gain:.0%} more samples/s than {runner_up.setting}"
    else:
        behind = 1 - (winner.samples_per_second or 0.0) / best
        why = (
            f"{winner.setting} is within {TIE_TOLERANCE:.0%} of the fastest, {fastest.setting} ({behind:.1%} behind): "
            "a tie, which less checkpointing wins"
        )
    return winner, f"{why} ({said})"


def _words(c: CheckpointingCandidate) -> str:
    if c.max_micro_batch is None and c.max_micro_batch_without_accumulation is None:
        return f"{c.setting}: nothing fits"
    if c.samples_per_second is None:
        return f"{c.setting}: max micro-batch {c.max_micro_batch}, not timed"
    plan = "" if c.accumulation_steps is None else f" x {c.accumulation_steps} micro-steps"
    return f"{c.setting}: {c.micro_batch}{plan}, {c.samples_per_second:.1f} samples/s"


def choose_checkpointing(request: ProbeRequest, settings: list[str], probe_one: ProbeOne) -> ProbeResult:
    """Probe each setting (least checkpointing first), time each plan, and return the chosen setting's
    result with `checkpointing` saying what was compared and why it won. A setting where nothing fits
    (or whose answers cannot make the plan) is a candidate with its reason; when no setting answers,
    the last setting's error is raised."""
    started = time.perf_counter()
    options: list[CheckpointingCandidate] = []
    results: dict[str, ProbeResult] = {}
    seed: AccumulationSeed | None = None
    failure: NothingFitsError | PlanError | None = None
    for setting in settings:
        one = request.model_copy(update={"checkpointing": setting})
        try:
            result = probe_one(one, seed)
        except (NothingFitsError, PlanError) as exc:  # this setting answers nothing for the plan
            failure = exc
            options.append(CheckpointingCandidate(setting=setting, reason=str(exc)))
            continue
        finally:
            gc.collect()  # the setting's model and runner, before the next one builds its own
        results[setting] = result
        options.append(candidate(setting, result, request))
        seed = seed_from(result, setting) or seed
    if not results:
        assert failure is not None
        raise failure
    try:
        winner, why = choose(options)
    except ValueError:  # none timed (no fitting trial in a plan's loop): the least checkpointing that answered
        winner = next(c for c in options if c.setting in results)
        why = f"{winner.setting}: no setting's plan was timed, so the least checkpointing that answered"
    choice = CheckpointingChoice(
        chosen=winner.setting,
        basis="optimizer-step" if request.effective_batch is not None else "sample",
        tie_tolerance=TIE_TOLERANCE,
        candidates=options,
        reason=why,
    )
    chosen = results[winner.setting]
    return chosen.model_copy(update={"checkpointing": choice, "duration_seconds": time.perf_counter() - started})
