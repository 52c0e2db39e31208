"""The throughput objective: which fitting micro-batch makes training fastest, not just biggest.

Every fitting trial times its steady-state (last) step. Given those times, `choose` picks, among
the fitting micro-batches the plan's policy can run, the one with the least time per optimizer
step (accumulation steps × step time) for the planned effective batch, or the least time per sample
when there is no plan, and says how much slower the largest-that-fits choice would be. The largest
is usually fastest on a GPU; it is not when a larger batch stops improving utilisation while
accumulation steps are already equal (e.g. 100 and 128 both need two steps for 200).

`accumulation steps × step time` is an upper bound when the plan runs a smaller micro-batch than
the candidate (fewest-steps splits 256 over 3 steps as 86+85+85, not 100+100+56): we only compare
sizes that were timed. Pure logic: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from autotune.plans.plan import Policy, plan
from autotune.results import ThroughputCandidate, ThroughputChoice, TrialRecord

# Extra sizes timed for the throughput objective below the answer (halvings): a predicted search
# times only its probes and the answer, which leaves the choice nothing in between.
EXTRA_TIMED_SIZES = 3


def timed_sizes(trials: Iterable[TrialRecord], max_micro_batch: int) -> dict[int, float]:
    """Steady-state step seconds of each fitting size up to the answer (the fastest if repeated)."""
    times: dict[int, float] = {}
    for t in trials:
        if t.fits and t.step_seconds and t.batch <= max_micro_batch:
            times[t.batch] = min(t.step_seconds, times.get(t.batch, t.step_seconds))
    return times


def extra_sizes(
    max_micro_batch: int, granularity: int, known: Iterable[int], count: int = EXTRA_TIMED_SIZES
) -> list[int]:
    """Halvings of the answer, on the granularity, not tried yet: at most `count`, largest first."""
    tried = set(known)
    sizes: list[int] = []
    size = max_micro_batch
    while len(sizes) < count:
        size = size // 2 // granularity * granularity
        if size < max(granularity, 1):
            break
        if size not in tried:
            sizes.append(size)
    return sizes


def candidates(
    times: dict[int, float],
    effective_batch: int | None = None,
    world_size: int = 1,
    policy: Policy | str = Policy.FEWEST_STEPS,
) -> list[ThroughputCandidate]:
    """Cost of each timed size: per optimizer step with an effective batch, else per sample."""
    out: list[ThroughputCandidate] = []
    for size in sorted(times):
        step = times[size]
        if effective_batch is None:
            out.append(
                ThroughputCandidate(
                    micro_batch=size, step_seconds=step, samples_per_second=size / step, seconds=step / size
                )
            )
            continue
        steps = plan(effective_batch, size, world_size, policy).accumulation_steps
        out.append(
            ThroughputCandidate(
                micro_batch=size,
                step_seconds=step,
                samples_per_second=size / step,
                accumulation_steps=steps,
                seconds=steps * step,
            )
        )
    return out


def choose(
    trials: Sequence[TrialRecord],
    max_micro_batch: int,
    effective_batch: int | None = None,
    world_size: int = 1,
    policy: Policy | str = Policy.FEWEST_STEPS,
) -> ThroughputChoice | None:
    """The fastest fitting micro-batch, or None when no fitting trial was timed.

    Ties go to the larger micro-batch: fewer accumulation steps for the same measured cost."""
    options = candidates(timed_sizes(trials, max_micro_batch), effective_batch, world_size, policy)
    if not options:
        return None
    best = min(options, key=lambda c: (c.seconds, -c.micro_batch))
    largest = max(options, key=lambda c: c.micro_batch)
    return ThroughputChoice(
        micro_batch=best.micro_batch,
        basis="sample" if effective_batch is None else "optimizer-step",
        seconds=best.seconds,
        largest_micro_batch=largest.micro_batch,
        largest_seconds=largest.seconds,
        largest_slowdown=largest.seconds / best.seconds - 1,
        candidates=options,
    )


def time_and_choose(
    trial: Callable[[int], TrialRecord],
    trials: list[TrialRecord],
    max_micro_batch: int,
    granularity: int = 1,
    effective_batch: int | None = None,
    world_size: int = 1,
    policy: Policy | str = Policy.FEWEST_STEPS,
) -> ThroughputChoice | None:
    """Time up to EXTRA_TIMED_SIZES halvings of the answer (real trials, appended to `trials`),
    then choose among every fitting trial."""
    for size in extra_sizes(max_micro_batch, granularity, (t.batch for t in trials)):
        trials.append(trial(size))
    return choose(trials, max_micro_batch, effective_batch, world_size, policy)
