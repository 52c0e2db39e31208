"""The throughput objective as pure logic: measured step times in, the fastest plan out."""

from __future__ import annotations

import pytest

from autotune.engine.objective import choose, extra_sizes, timed_sizes
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.results import TrialRecord


def _trial(batch: int, step: float | None, fits: bool = True) -> TrialRecord:
    return TrialRecord(batch=batch, fits=fits, seconds=1.0, step_seconds=step if fits else None)


def test_only_fitting_timed_sizes_up_to_the_answer_are_candidates() -> None:
    trials = [_trial(2, 0.1), _trial(4, 0.2), _trial(8, None, fits=False), _trial(6, 0.25), _trial(7, 0.3)]
    assert timed_sizes(trials, max_micro_batch=6) == {2: 0.1, 4: 0.2, 6: 0.25}


def test_the_largest_is_chosen_when_time_grows_slower_than_the_batch() -> None:
    trials = [_trial(16, 0.10), _trial(32, 0.15), _trial(64, 0.25)]
    choice = choose(trials, 64, effective_batch=256)
    assert choice is not None
    assert choice.micro_batch == 64 and choice.largest_slowdown == 0
    assert [c.accumulation_steps for c in choice.candidates] == [16, 8, 4]
    assert choice.seconds == pytest.approx(4 * 0.25)


def test_a_smaller_micro_batch_wins_when_the_largest_saturates_and_needs_as_many_steps() -> None:
    """200 takes 2 steps of 100 or 2 of at most 128; 100 is faster per step, so 100 wins. The
    largest (128) is 30% slower per optimizer step."""
    trials = [_trial(100, 0.50), _trial(128, 0.65)]
    choice = choose(trials, 128, effective_batch=200)
    assert choice is not None
    assert choice.micro_batch == 100 and choice.basis == "optimizer-step"
    assert choice.largest_micro_batch == 128
    assert choice.largest_slowdown == pytest.approx(0.65 / 0.50 - 1)


def test_without_an_effective_batch_the_cost_is_time_per_sample() -> None:
    trials = [_trial(10, 0.10), _trial(20, 0.25)]
    choice = choose(trials, 20)
    assert choice is not None
    assert choice.basis == "sample" and choice.micro_batch == 10
    assert choice.seconds == pytest.approx(0.01)
    assert choice.largest_slowdown == pytest.approx(0.0125 / 0.01 - 1)


def test_the_policy_decides_the_steps() -> None:
    # 96 with max 40: fewest-steps runs 3 steps (32 each); exact needs a divisor <= 40: 32, 3 steps.
    # With max 50: fewest-steps 2 steps of 48; exact also 48 (2 steps).
    trials = [_trial(40, 0.4), _trial(50, 0.5)]
    fewest = choose(trials, 50, effective_batch=96, policy="fewest-steps")
    assert fewest is not None
    assert [c.accumulation_steps for c in fewest.candidates] == [3, 2]
    assert fewest.micro_batch == 50  # 2 × 0.5 < 3 × 0.4


def test_ties_go_to_the_larger_micro_batch() -> None:
    trials = [_trial(32, 0.2), _trial(64, 0.4)]
    choice = choose(trials, 64)
    assert choice is not None and choice.micro_batch == 64


def test_nothing_timed_means_no_choice() -> None:
    assert choose([_trial(8, None, fits=False)], 4) is None


@pytest.mark.parametrize(
    ("answer", "granularity", "known", "expected"),
    [
        (100, 1, {2, 4, 100, 101}, [50, 25, 12]),
        (7, 1, {2, 4, 7, 8}, [3, 1]),
        (64, 8, {8, 16, 64, 72}, [32]),
        (6, 1, {1, 2, 3, 4, 6}, []),
    ],
)
def test_extra_sizes_are_untried_halvings_on_the_granularity(
    answer: int, granularity: int, known: set[int], expected: list[int]
) -> None:
    assert extra_sizes(answer, granularity, known) == expected


def test_throughput_objective_end_to_end_on_the_budget_device() -> None:
    result = run_probe(
        ProbeRequest(
            target="tests.predict_workloads:plain",
            device="cpu",
            memory=2**20,
            headroom=0,
            objective="throughput",
            effective_batch=1000,
        )
    )
    choice = result.throughput
    assert choice is not None and result.objective == "throughput"
    fitting = {t.batch for t in result.loop_trials() if t.fits}
    assert {c.micro_batch for c in choice.candidates} == fitting
    assert choice.micro_batch in fitting and choice.largest_micro_batch == result.max_micro_batch
    assert result.plan is not None and result.plan.micro_batch <= choice.micro_batch
    assert result.plan.achieved_effective_batch == 1000
