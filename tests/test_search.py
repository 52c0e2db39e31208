"""The search, as pure logic: a threshold stands in for the memory limit."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.engine.search import MAX_UNITS, search, search_from_guess
from autotune.errors import ConfigError, FlatMemoryError, NothingFitsError
from autotune.results import TrialRecord


class Threshold:
    """Sizes up to `largest` fit; records every size it is asked to run."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.asked: list[int] = []

    def __call__(self, batch: int) -> TrialRecord:
        self.asked.append(batch)
        fits = batch <= self.largest
        return TrialRecord(batch=batch, fits=fits, peak_allocated_bytes=batch * 100, seconds=0.0)


def _check(outcome_batch: int, capped: bool, fits: Threshold, granularity: int, cap: int | None) -> None:
    tried = {b: b <= fits.largest for b in fits.asked}
    assert len(fits.asked) == len(tried), "a size was tried twice"
    assert all(b % granularity == 0 for b in tried)
    assert tried[outcome_batch] is True, "the answer was not tried, or did not fit"
    expected = fits.largest // granularity * granularity
    if cap is not None:
        expected = min(expected, cap // granularity * granularity)
    assert outcome_batch == expected
    if capped:
        assert cap is not None and outcome_batch == cap // granularity * granularity
    else:
        assert tried[outcome_batch + granularity] is False, "answer + granularity was not shown to fail"


@settings(max_examples=300, deadline=None)
@given(
    largest=st.integers(1, 5000),
    start=st.integers(1, 300),
    granularity=st.sampled_from([1, 1, 2, 8]),
    cap=st.one_of(st.none(), st.integers(8, 6000)),
)
def test_search_is_exact_and_never_returns_an_untried_size(
    largest: int, start: int, granularity: int, cap: int | None
) -> None:
    if largest < granularity:
        return
    fits = Threshold(largest)
    outcome = search(fits, start=start, cap=cap, granularity=granularity)
    assert [t.batch for t in outcome.trials] == fits.asked
    _check(outcome.max_micro_batch, outcome.capped, fits, granularity, cap)


@settings(max_examples=300, deadline=None)
@given(
    largest=st.integers(1, 5000),
    guess=st.integers(1, 6000),
    granularity=st.sampled_from([1, 8]),
    cap=st.one_of(st.none(), st.integers(8, 6000)),
)
def test_search_from_guess_keeps_the_same_guarantees(
    largest: int, guess: int, granularity: int, cap: int | None
) -> None:
    if largest < granularity:
        return
    fits = Threshold(largest)
    outcome = search_from_guess(fits, guess, cap=cap, granularity=granularity)
    _check(outcome.max_micro_batch, outcome.capped, fits, granularity, cap)


def test_a_right_guess_costs_two_trials() -> None:
    fits = Threshold(137)
    outcome = search_from_guess(fits, 137)
    assert fits.asked == [137, 138]
    assert outcome.max_micro_batch == 137


def test_nothing_fits_names_the_peak_at_batch_one_and_the_limit() -> None:
    fits = Threshold(0)
    with pytest.raises(NothingFitsError, match=r"even batch 1 does not fit within a limit of 1\.0 KiB") as info:
        search(fits, start=16, limit_bytes=1024)
    assert info.value.peak_bytes == 100
    assert 1 in fits.asked


def test_cap_reached_says_capped() -> None:
    fits = Threshold(10_000)
    outcome = search(fits, cap=100)
    assert outcome.capped and outcome.max_micro_batch == 100
    assert max(fits.asked) == 100, "a size above the cap was tried"


def test_doubling_then_bisecting_trial_count() -> None:
    fits = Threshold(100)
    search(fits)
    # 1,2,4,...,128 then bisect 64..128: 8 + 6 trials.
    assert fits.asked[:8] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert len(fits.asked) == 14


@pytest.mark.parametrize(("kwargs", "message"), [({"granularity": 0}, "granularity"), ({"start": 0}, "start")])
def test_bad_arguments(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        search(Threshold(5), **kwargs)


def test_cap_below_granularity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max batch 4 is below the granularity 8"):
        search(Threshold(50), cap=4, granularity=8)


def test_search_and_plan_do_not_import_torch() -> None:
    code = "import sys, autotune.engine.search, autotune.plans.plan; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_guess_off_by_a_few_percent_is_bracketed_in_proportion() -> None:
    # Measured on an H100: predicted 5995, verified 6144 (2.5% off).
    fits = Threshold(6144)
    outcome = search_from_guess(fits, 5995)
    assert outcome.max_micro_batch == 6144
    assert fits.asked[:2] == [5995, 5996]  # a right guess would have stopped here
    assert len(fits.asked) <= 12  # one sample at a time, then doubling, took 16
    under = Threshold(5800)
    assert search_from_guess(under, 5995).max_micro_batch == 5800
    assert len(under.asked) <= 14  # 16 the old way


# A memory curve that does not grow (issue 12): the doubling ends, naming make_batch --------------
def _constant(peak: Callable[[int], int], asked: list[int]) -> Callable[[int], TrialRecord]:
    def trial(batch: int) -> TrialRecord:
        asked.append(batch)
        return TrialRecord(batch=batch, fits=True, peak_allocated_bytes=peak(batch), seconds=0.0)

    return trial


def test_a_flat_curve_stops_the_doubling_at_1024_times_the_first() -> None:
    for cap in (None, 10**12):
        asked: list[int] = []
        flat = _constant(lambda b: 5000, asked)
        with pytest.raises(FlatMemoryError, match=r"batch 1 peaked at .* and batch 1024 at .*make_batch"):
            search(flat, cap=cap)
        assert asked == [2**k for k in range(11)]


def test_memory_that_barely_grows_stops_below_2_to_the_40() -> None:
    asked: list[int] = []
    barely = _constant(lambda b: 10**6 + b, asked)
    with pytest.raises(FlatMemoryError, match="grows too little with the batch to run out below"):
        search(barely)
    assert max(asked) == MAX_UNITS and len(asked) == 41
    # A cap above the bound is the user's: it is tried, and answered as capped.
    outcome = search(_constant(lambda b: 10**6 + b, []), cap=2**45)
    assert outcome.capped and outcome.max_micro_batch == 2**45


def test_a_guess_never_walks_up_forever() -> None:
    asked: list[int] = []
    with pytest.raises(FlatMemoryError, match="batch 5000 peaked at"):
        search_from_guess(_constant(lambda b: 100, asked), 5000)
    assert max(asked) <= MAX_UNITS and len(asked) < 50
