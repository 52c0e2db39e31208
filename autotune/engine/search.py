"""The search for the largest micro-batch that fits: pure logic over a trial callable.

The callable runs a real trial (`fits(b) -> TrialRecord`); here we only decide which sizes to try.
Guarantees, whatever the strategy:
- the answer was tried and fitted;
- answer + granularity was tried and did not fit, unless the answer is the cap (then `capped`);
- no size is tried twice.
Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.errors import ConfigError, FlatMemoryError, NothingFitsError
from autotune.results import TrialRecord
from autotune.units import format_bytes

TrialFn = Callable[[int], TrialRecord]

# A size this many times the first that peaks no higher than the first: memory does not grow with
# the batch (make_batch ignores it), and doubling would go on until the numbers overflow.
FLAT_FACTOR = 1024
# The plain search never doubles past this many units (about 10**12 samples): memory that grows so
# little that this fits is as good as flat, and no job runs such a batch.
MAX_UNITS = 1 << 40
# The predictor (autotune.engine.predict) does not follow its fitted curve past this batch: memory that
# barely grows is as good as unbounded; a prediction there is a lower bound the search goes on from.
MAX_PREDICTED_BATCH = 1 << 24

MAKE_BATCH_HINT = "does make_batch(batch_size, device) return batch_size rows?"


@dataclass
class SearchOutcome:
    max_micro_batch: int
    capped: bool
    trials: list[TrialRecord] = field(default_factory=list)


class _Memo:
    """Runs each size at most once and keeps every trial in the order it ran."""

    def __init__(self, fits: TrialFn, granularity: int) -> None:
        self._fits = fits
        self.granularity = granularity
        self.trials: list[TrialRecord] = []
        self._by_units: dict[int, TrialRecord] = {}

    def __call__(self, units: int) -> bool:
        if units not in self._by_units:
            record = self._fits(units * self.granularity)
            self._by_units[units] = record
            self.trials.append(record)
        return self._by_units[units].fits

    def record(self, units: int) -> TrialRecord:
        return self._by_units[units]


def _validate(start: int, cap: int | None, granularity: int) -> None:
    if granularity < 1:
        raise ConfigError(f"granularity must be at least 1, got {granularity}")
    if start < 1:
        raise ConfigError(f"start batch must be at least 1, got {start}")
    if cap is not None and cap < granularity:
        raise ConfigError(f"max batch {cap} is below the granularity {granularity}: raise --max-batch")


def _nothing_fits(memo: _Memo, limit_bytes: int | None) -> NothingFitsError:
    return nothing_fits(memo.record(1), limit_bytes)


# What an out-of-memory message (CUDA's, and the allocator model's, which words it alike) says the
# allocator tried to allocate: the segment it asked for, on which the limit bit.
_TRIED = re.compile(r"Tried to allocate ([0-9.]+ ?[KMGTP]?i?B)")


def nothing_fits(record: TrialRecord, limit_bytes: int | None) -> NothingFitsError:
    """The error for the smallest size, which did not fit (`record`), saying what bit. With a caching
    allocator (CUDA, the budget device's model of it) the limit bites on reserved bytes: the message
    quotes those and what the allocator then tried to allocate, not the allocated bytes, which can
    be far below the limit; without one, the bytes the size needed."""
    needed = record.peak_allocated_bytes
    reserved = record.peak_reserved_bytes
    limit = f" within a limit of {format_bytes(limit_bytes)}" if limit_bytes else ""
    if reserved and (record.allocator is not None or reserved > (needed or 0)):
        tried = _TRIED.search(record.oom_message or "")
        if record.failure in ("thrashing", "unsettled") or (tried is None and record.oom_message):
            asked = f" and then: {record.oom_message}"
        elif tried is not None:
            asked = f" when it tried to allocate {tried.group(1)} more"
        else:
            asked = " when an allocation did not fit"
        what = (
            f"the caching allocator had reserved up to {format_bytes(reserved)}, "
            f"{format_bytes(needed or 0)} of it allocated to tensors,{asked}"
        )
    else:
        what = f"it needed at least {format_bytes(needed)}"
    return NothingFitsError(
        f"even batch {record.batch} does not fit{limit} ({what}): give the probe more memory "
        "(--memory, less --headroom), a lower precision or a smaller model",
        peak_bytes=needed,
        limit_bytes=limit_bytes or 0,
    )


def _bisect(memo: _Memo, lo: int, hi: int) -> int:
    """lo fits (or is 0), hi does not; return the boundary."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if memo(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _finish(memo: _Memo, lo: int, capped: bool, limit_bytes: int | None) -> SearchOutcome:
    if lo == 0:
        raise _nothing_fits(memo, limit_bytes)
    return SearchOutcome(lo * memo.granularity, capped, memo.trials)


def _flat(memo: _Memo, first: int, last: int) -> FlatMemoryError:
    low, high = memo.record(first), memo.record(last)
    g = memo.granularity
    low_peak, high_peak = format_bytes(low.peak_allocated_bytes or 0), format_bytes(high.peak_allocated_bytes or 0)
    if (high.peak_allocated_bytes or 0) <= (low.peak_allocated_bytes or 0):
        what = "memory does not grow with the batch"
    else:
        what = f"memory grows too little with the batch to run out below {last * g:,} samples"
    return FlatMemoryError(
        f"{what}: batch {first * g} peaked at {low_peak} and batch {last * g} at {high_peak}, so there is no "
        f"largest batch that fits: {MAKE_BATCH_HINT}"
    )


def _grow(memo: _Memo, lo: int, k: int, cap_units: int | None, factor: int) -> tuple[int, int | None]:
    """From k (untried or fitting), multiply by `factor` until a size fails or the cap fits.

    Returns (largest fitting, first failing or None when the cap fitted). Raises FlatMemoryError
    when a size `FLAT_FACTOR` times the first peaks no higher than the first, or when no cap
    stops it before `MAX_UNITS`."""
    first = k
    while True:
        if cap_units is not None:
            k = min(k, cap_units)
        elif k > MAX_UNITS:
            raise _flat(memo, first, lo)
        if not memo(k):
            return lo, k
        lo = k
        if cap_units is not None and k >= cap_units:
            return lo, None
        if k >= first * FLAT_FACTOR:
            low, high = memo.record(first).peak_allocated_bytes, memo.record(k).peak_allocated_bytes
            if low and high and high <= low:
                raise _flat(memo, first, k)
        k *= factor


def search(
    fits: TrialFn,
    *,
    start: int = 1,
    cap: int | None = None,
    granularity: int = 1,
    factor: int = 2,
    limit_bytes: int | None = None,
) -> SearchOutcome:
    """Grow geometrically from `start` until a trial fails or the cap fits, then bisect.

    With granularity g only multiples of g are tried; `start` and `cap` are rounded to them.
    `limit_bytes` only improves the message when even the smallest size does not fit.
    """
    _validate(start, cap, granularity)
    memo = _Memo(fits, granularity)
    cap_units = None if cap is None else cap // granularity
    k = max(1, -(-start // granularity))
    lo, hi = _grow(memo, 0, k, cap_units, factor)
    if hi is None:
        return SearchOutcome(lo * granularity, True, memo.trials)
    return _finish(memo, _bisect(memo, lo, hi), False, limit_bytes)


def _next_step(step: int, guess_units: int, factor: int, relative_miss: int) -> int:
    if step == 1:
        return max(2, guess_units // relative_miss)
    return step * factor


def search_from_guess(
    fits: TrialFn,
    guess: int,
    *,
    cap: int | None = None,
    granularity: int = 1,
    factor: int = 2,
    limit_bytes: int | None = None,
    relative_miss: int = 256,
) -> SearchOutcome:
    """Verify a predicted answer with two trials (guess fits, guess+g fails); when it misses,
    bracket outward from the guess, then bisect.

    The first step out is one unit, so a right guess costs exactly two trials. After that the
    steps start at `guess / relative_miss` (at least 2 units) and double: a prediction that is
    off, is off by a fraction of the answer (about 1-3% on CUDA at the scale of a whole card),
    and walking one sample at a time from 6000 would spend a dozen trials to cross 2%.
    """
    _validate(guess, cap, granularity)
    memo = _Memo(fits, granularity)
    cap_units = None if cap is None else cap // granularity
    k = max(1, guess // granularity)
    if cap_units is not None:
        k = min(k, cap_units)
    if memo(k):
        if cap_units is not None and k >= cap_units:
            return SearchOutcome(k * granularity, True, memo.trials)
        # The prediction fitted: walk up from it (k+1, then k+1+s, k+1+3s, ...).
        lo, step = k, 1
        while True:
            nxt = lo + step
            if cap_units is not None:
                nxt = min(nxt, cap_units)
            elif nxt > MAX_UNITS:  # everything fitted: no prediction should lead here, but never loop on
                raise _flat(memo, k, lo)
            if not memo(nxt):
                return _finish(memo, _bisect(memo, lo, nxt), False, limit_bytes)
            lo = nxt
            if cap_units is not None and lo >= cap_units:
                return SearchOutcome(lo * granularity, True, memo.trials)
            step = _next_step(step, k, factor, relative_miss)
    # The prediction did not fit: walk down from it (k-1, then k-1-s, k-1-3s, ...).
    hi, step = k, 1
    while True:
        nxt = max(hi - step, 0)
        if nxt == 0:
            return _finish(memo, _bisect(memo, 0, hi), False, limit_bytes)
        if memo(nxt):
            return _finish(memo, _bisect(memo, nxt, hi), False, limit_bytes)
        hi = nxt
        step = _next_step(step, k, factor, relative_miss)
