"""The caching-allocator model (autotune/devices/allocator.py) against the rules of
c10/cuda/CUDACachingAllocator.cpp: rounding, pools, segment sizes, best fit, splitting, merging,
max_split_size, release-and-retry, the cap on reserved memory, expandable segments, the settings.
No torch anywhere: the model is arithmetic."""

from __future__ import annotations

import ast
import itertools
import pickle
import random
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.devices.allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    AllocatorStats,
    CachingAllocatorModel,
    MiB,
    allocation_size,
    round_size,
)

KiB = 1 << 10
EXPANDABLE = AllocatorConfig(expandable_segments=True)

# A trace: ("alloc", id, bytes) and ("free", id) events, as a step's storages come and go.
Event = tuple[str, int] | tuple[str, int, int]


def replay(model: CachingAllocatorModel, events: Iterable[Event], live: dict[int, int] | None = None) -> dict[int, int]:
    """Run a trace through the model, continuing from `live` (id -> handle) if given; the ids
    still live at its end, with their handles."""
    live = {} if live is None else live
    for event in events:
        if event[0] == "alloc" and len(event) == 3:
            _, ident, nbytes = event
            assert ident not in live, f"id {ident} allocated twice"
            live[ident] = model.malloc(nbytes)
        elif event[0] == "free" and len(event) == 2:
            model.free(live.pop(event[1]))
        else:
            raise AssertionError(f"malformed event {event!r}")
    return live


def check_invariants(model: CachingAllocatorModel) -> None:
    """What must hold after any call: the segments add up to the counters, free neighbours are merged."""
    stats = model.stats()
    segments = model.segments()
    assert sum(size for size, _ in segments) == stats.reserved_bytes
    assert sum(size for _, blocks in segments for size, used in blocks if used) == stats.allocated_bytes
    assert stats.allocated_bytes <= stats.reserved_bytes <= model.total_bytes
    assert stats.peak_allocated_bytes >= stats.allocated_bytes
    assert stats.peak_reserved_bytes >= stats.reserved_bytes
    for size, blocks in segments:
        assert size == sum(s for s, _ in blocks)
        assert all(s % 512 == 0 for s, _ in blocks)
        for (_, used), (_, next_used) in itertools.pairwise(blocks):
            assert used or next_used, "two free neighbours were not merged"
    free_sizes = [s for _, blocks in segments for s, used in blocks if not used]
    assert stats.largest_free_block == max(free_sizes, default=0)
    if not model.config.expandable_segments:
        assert stats.segments == len(segments)


def blocks(model: CachingAllocatorModel) -> list[list[tuple[int, bool]]]:
    return [parts for _, parts in model.segments()]


# Rounding, pools and segment sizes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "rounded"), [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)]
)
def test_requests_round_up_to_a_multiple_of_512_bytes(nbytes: int, rounded: int) -> None:
    assert round_size(nbytes) == rounded
    model = CachingAllocatorModel(100 * MiB)
    model.malloc(nbytes)
    assert model.stats().allocated_bytes == rounded


def test_a_zero_byte_request_gets_a_handle_and_no_memory() -> None:
    model = CachingAllocatorModel(100 * MiB)
    handle = model.malloc(0)
    assert model.stats() == AllocatorStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
    model.free(handle)
    with pytest.raises(KeyError):
        model.free(handle)


def test_an_unknown_handle_is_a_key_error() -> None:
    model = CachingAllocatorModel(100 * MiB)
    handle = model.malloc(MiB)
    with pytest.raises(KeyError):
        model.free(handle + 1)
    model.free(handle)
    with pytest.raises(KeyError, match="freed already"):
        model.free(handle)


def test_small_requests_share_one_2mib_segment() -> None:
    model = CachingAllocatorModel(100 * MiB)
    for _ in range(10):
        model.malloc(100 * KiB)
    stats = model.stats()
    assert (stats.segments, stats.reserved_bytes, stats.allocated_bytes) == (1, 2 * MiB, 10 * 100 * KiB)
    assert blocks(model) == [[(100 * KiB, True)] * 10 + [(2 * MiB - 10 * 100 * KiB, False)]]


@pytest.mark.parametrize(
    ("nbytes", "segment"),
    [
        (MiB, 2 * MiB),  # <= kSmallSize: the small pool's 2 MiB segment
        (MiB + 1, 20 * MiB),  # the large pool: 1-10 MiB share a kLargeBuffer
        (5 * MiB, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),  # >= kMinLargeAlloc: its own size, rounded to 2 MiB
        (12 * MiB, 12 * MiB),
        (11 * MiB + 1, 12 * MiB),
    ],
)
def test_a_miss_reserves_the_segment_size_of_its_pool(nbytes: int, segment: int) -> None:
    assert allocation_size(round_size(nbytes)) == segment
    model = CachingAllocatorModel(100 * MiB)
    model.malloc(nbytes)
    assert model.stats().reserved_bytes == segment
    assert model.stats().segments == 1


def test_a_5mib_request_reserves_20mib_and_a_second_one_splits_it() -> None:
    model = CachingAllocatorModel(100 * MiB)
    model.malloc(5 * MiB)
    assert blocks(model) == [[(5 * MiB, True), (15 * MiB, False)]]
    model.malloc(5 * MiB)
    assert blocks(model) == [[(5 * MiB, True), (5 * MiB, True), (10 * MiB, False)]]
    stats = model.stats()
    assert (stats.reserved_bytes, stats.segments, stats.num_device_alloc) == (20 * MiB, 1, 1)


def test_a_12mib_request_reserves_12mib_and_small_and_large_pools_do_not_mix() -> None:
    model = CachingAllocatorModel(100 * MiB)
    model.malloc(12 * MiB)
    small = model.malloc(MiB)  # a free 20 MiB block would fit, but it is not in the small pool
    assert model.stats().reserved_bytes == 14 * MiB
    model.free(small)
    model.malloc(2 * MiB)  # nor does the large pool take the free small segment
    assert model.stats().reserved_bytes == 34 * MiB


def test_a_large_block_is_split_only_when_over_1mib_would_remain() -> None:
    model = CachingAllocatorModel(100 * MiB)
    whole = model.malloc(20 * MiB)
    model.free(whole)
    model.malloc(19 * MiB + 512 * KiB)  # 512 KiB would remain: the whole 20 MiB block is used
    assert blocks(model) == [[(20 * MiB, True)]]
    assert model.stats().allocated_bytes == 20 * MiB
    other = CachingAllocatorModel(100 * MiB)
    other.free(other.malloc(20 * MiB))
    other.malloc(18 * MiB + 512 * KiB)  # 1.5 MiB would remain: split
    assert blocks(other) == [[(18 * MiB + 512 * KiB, True), (MiB + 512 * KiB, False)]]
    exact = CachingAllocatorModel(100 * MiB)
    exact.free(exact.malloc(20 * MiB))
    exact.malloc(19 * MiB)  # exactly 1 MiB would remain: not more than kSmallSize, no split
    assert blocks(exact) == [[(20 * MiB, True)]]


def test_the_small_pool_splits_down_to_512_bytes() -> None:
    model = CachingAllocatorModel(100 * MiB)
    model.malloc(MiB)
    model.malloc(MiB - 512)  # the free 1 MiB, split: 512 B remain
    assert blocks(model) == [[(MiB, True), (MiB - 512, True), (512, False)]]
    model.malloc(512)
    assert blocks(model) == [[(MiB, True), (MiB - 512, True), (512, True)]]


# Best fit, merging ----------------------------------------------------------------------------------


def test_best_fit_chooses_the_smallest_free_block_that_fits() -> None:
    model = CachingAllocatorModel(200 * MiB)
    handles = [model.malloc(n * MiB) for n in (16, 12, 14, 30)]
    for handle in handles[:3]:
        model.free(handle)
    model.malloc(13 * MiB)  # 12 is too small; 14 fits best (1 MiB would remain: no split)
    assert blocks(model) == [[(16 * MiB, False)], [(12 * MiB, False)], [(14 * MiB, True)], [(30 * MiB, True)]]
    assert model.stats().reserved_bytes == 72 * MiB  # nothing new


def test_best_fit_breaks_a_tie_by_address() -> None:
    model = CachingAllocatorModel(200 * MiB)
    first, second = model.malloc(12 * MiB), model.malloc(12 * MiB)
    model.free(second)
    model.free(first)
    model.malloc(12 * MiB)
    assert blocks(model) == [[(12 * MiB, True)], [(12 * MiB, False)]]


def test_freed_blocks_merge_with_free_neighbours_and_stay_reserved() -> None:
    model = CachingAllocatorModel(100 * MiB)
    a, b, c, d = (model.malloc(5 * MiB) for _ in range(4))
    model.free(b)
    model.free(c)
    assert blocks(model) == [[(5 * MiB, True), (10 * MiB, False), (5 * MiB, True)]]
    model.free(a)
    assert blocks(model) == [[(15 * MiB, False), (5 * MiB, True)]]
    model.free(d)
    assert blocks(model) == [[(20 * MiB, False)]]
    assert model.stats().reserved_bytes == 20 * MiB
    assert model.stats().largest_free_block == 20 * MiB


# max_split_size -------------------------------------------------------------------------------------

SPLIT_40 = AllocatorConfig.parse("max_split_size_mb:40")


def test_no_split_at_or_above_max_split_size() -> None:
    model = CachingAllocatorModel(500 * MiB, SPLIT_40)
    model.free(model.malloc(50 * MiB))
    model.malloc(40 * MiB)  # >= max_split_size: takes the 50 MiB block (within 20 MiB) whole
    assert blocks(model) == [[(50 * MiB, True)]]
    assert model.stats().allocated_bytes == 50 * MiB
    default = CachingAllocatorModel(500 * MiB)
    default.free(default.malloc(50 * MiB))
    default.malloc(40 * MiB)  # unlimited: the same request splits the block
    assert blocks(default) == [[(40 * MiB, True), (10 * MiB, False)]]


def test_below_max_split_size_a_request_does_not_take_an_oversize_block() -> None:
    model = CachingAllocatorModel(500 * MiB, SPLIT_40)
    model.free(model.malloc(50 * MiB))
    model.malloc(28 * MiB)
    assert blocks(model) == [[(50 * MiB, False)], [(28 * MiB, True)]]
    exact = CachingAllocatorModel(500 * MiB, SPLIT_40)
    exact.free(exact.malloc(40 * MiB))  # a block of exactly max_split_size is oversize too
    exact.malloc(28 * MiB)
    assert blocks(exact) == [[(40 * MiB, False)], [(28 * MiB, True)]]
    below = CachingAllocatorModel(500 * MiB, SPLIT_40)
    below.free(below.malloc(38 * MiB))  # below max_split_size, a block is still split
    below.malloc(12 * MiB)
    assert blocks(below) == [[(12 * MiB, True), (26 * MiB, False)]]


def test_an_oversize_block_serves_a_request_only_within_20mib_of_it() -> None:
    model = CachingAllocatorModel(500 * MiB, SPLIT_40)
    model.free(model.malloc(70 * MiB))
    model.malloc(51 * MiB)  # 70 < 51 + 20: taken whole
    assert blocks(model) == [[(70 * MiB, True)]]
    other = CachingAllocatorModel(500 * MiB, SPLIT_40)
    other.free(other.malloc(70 * MiB))
    other.malloc(50 * MiB)  # 70 >= 50 + 20: a new 50 MiB segment instead
    assert blocks(other) == [[(70 * MiB, False)], [(50 * MiB, True)]]


def test_with_max_split_size_a_miss_first_frees_one_oversize_block_without_a_retry() -> None:
    model = CachingAllocatorModel(70 * MiB, SPLIT_40)
    model.free(model.malloc(50 * MiB))
    model.malloc(30 * MiB)  # may not use the 50; 50 + 30 > 70; so the 50 is released
    stats = model.stats()
    assert blocks(model) == [[(30 * MiB, True)]]
    assert (stats.num_alloc_retries, stats.num_device_free, stats.reserved_bytes) == (0, 1, 30 * MiB)


def test_with_max_split_size_a_miss_frees_oversize_blocks_largest_first_until_enough() -> None:
    model = CachingAllocatorModel(100 * MiB, SPLIT_40)
    for handle in [model.malloc(45 * MiB), model.malloc(42 * MiB)]:
        model.free(handle)
    assert model.stats().reserved_bytes == 88 * MiB
    model.malloc(60 * MiB)  # no single block >= 60: free the 46 then the 42 (88 >= 60)
    stats = model.stats()
    assert blocks(model) == [[(60 * MiB, True)]]
    assert (stats.num_alloc_retries, stats.num_device_free) == (0, 2)


# Release and retry, out of memory, the cap -----------------------------------------------------------


def test_a_failed_segment_allocation_releases_cached_segments_and_retries() -> None:
    """The thrashing case: the cache holds free segments of the wrong size; they go back to the
    driver and the third alloc_block (the one counted as a retry) succeeds."""
    model = CachingAllocatorModel(40 * MiB)
    model.free(model.malloc(12 * MiB))
    model.free(model.malloc(14 * MiB))
    keep = model.malloc(MiB)  # a small-pool segment in use: not released
    assert model.stats().reserved_bytes == 28 * MiB
    model.malloc(30 * MiB)  # 28 + 30 > 40
    stats = model.stats()
    assert stats.num_alloc_retries == 1
    assert (stats.num_device_free, stats.reserved_bytes, stats.segments) == (2, 32 * MiB, 2)
    assert blocks(model) == [[(MiB, True), (MiB, False)], [(30 * MiB, True)]]
    model.free(keep)


def test_out_of_memory_when_even_a_released_cache_is_not_enough() -> None:
    model = CachingAllocatorModel(50 * MiB)
    handles = [model.malloc(5 * MiB) for _ in range(8)]
    for handle in handles[1:7]:
        model.free(handle)
    before = model.segments()
    with pytest.raises(AllocatorOutOfMemory) as caught:
        model.malloc(25 * MiB)
    oom = caught.value
    message = str(oom)
    assert message.startswith("CUDA out of memory. Tried to allocate 26.0 MiB.")  # the segment size
    assert "50.0 MiB allowed" in message
    assert "40.0 MiB is reserved" in message
    assert "10.0 MiB is allocated by PyTorch" in message
    assert "30.0 MiB is reserved by PyTorch but unallocated" in message
    assert (oom.requested, oom.alloc_size, oom.limit_bytes) == (25 * MiB, 26 * MiB, 50 * MiB)
    assert oom.stats == model.stats()
    assert model.segments() == before  # nothing was free and whole: nothing changed
    assert (oom.stats.num_alloc_retries, oom.stats.num_device_free) == (1, 0)
    model.free(handles[0])  # the model is still usable, the handles still valid
    model.free(handles[7])


def test_fragmentation_fails_a_request_far_below_the_limit() -> None:
    """Allocated is a fifth of the limit, but the free 15 MiB holes lie in two split segments:
    neither holds 25 MiB, neither can be released, and a new segment passes the cap."""
    model = CachingAllocatorModel(50 * MiB)
    handles = [model.malloc(5 * MiB) for _ in range(8)]
    for handle in handles[1:7]:
        model.free(handle)
    assert blocks(model) == [[(5 * MiB, True), (15 * MiB, False)], [(15 * MiB, False), (5 * MiB, True)]]
    stats = model.stats()
    assert stats.allocated_bytes == 10 * MiB and stats.reserved_bytes == 40 * MiB
    with pytest.raises(AllocatorOutOfMemory):
        model.malloc(25 * MiB)
    model.empty_cache()
    assert model.stats().reserved_bytes == 40 * MiB  # split segments cannot be released


def test_the_cap_counts_reserved_bytes_not_allocated_bytes() -> None:
    model = CachingAllocatorModel(30 * MiB)
    model.malloc(5 * MiB)  # allocated 5 MiB, reserved 20 MiB
    with pytest.raises(AllocatorOutOfMemory, match=r"Tried to allocate 16\.0 MiB"):
        model.malloc(16 * MiB)  # 5 + 16 allocated would fit in 30; 20 + 16 reserved does not
    assert model.stats().reserved_bytes == 20 * MiB
    model.malloc(10 * MiB)  # but the free 15 MiB of the segment still serves what fits in it
    assert model.stats().reserved_bytes == 20 * MiB


def test_the_out_of_memory_error_survives_pickling() -> None:
    model = CachingAllocatorModel(10 * MiB)
    with pytest.raises(AllocatorOutOfMemory) as caught:
        model.malloc(12 * MiB)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value)
    assert (copy.requested, copy.stats, copy.limit_bytes) == (12 * MiB, caught.value.stats, 10 * MiB)


def test_empty_cache_returns_only_unsplit_free_segments() -> None:
    model = CachingAllocatorModel(100 * MiB)
    big = model.malloc(12 * MiB)
    part = model.malloc(5 * MiB)
    small = model.malloc(100 * KiB)
    model.free(big)
    model.free(small)
    model.empty_cache()
    stats = model.stats()
    assert (stats.reserved_bytes, stats.segments, stats.num_device_free) == (20 * MiB, 1, 2)
    assert stats.num_alloc_retries == 0  # empty_cache is not a retry
    model.free(part)
    model.empty_cache()
    assert model.stats().reserved_bytes == 0
    assert model.segments() == []


def test_reset_peak_makes_the_peaks_the_current_values() -> None:
    model = CachingAllocatorModel(100 * MiB)
    model.free(model.malloc(30 * MiB))
    model.empty_cache()
    stats = model.stats()
    assert (stats.peak_allocated_bytes, stats.peak_reserved_bytes) == (30 * MiB, 30 * MiB)
    model.malloc(MiB)
    model.reset_peak()
    stats = model.stats()
    assert (stats.peak_allocated_bytes, stats.peak_reserved_bytes) == (MiB, 2 * MiB)


# Existing segments (a trial's start, taken from a memory snapshot) ---------------------------------------


def test_a_taken_over_segment_is_reserved_and_its_free_block_serves_the_next_request() -> None:
    model = CachingAllocatorModel(100 * MiB)
    base = 0x7F00_0000_0000
    held = model.add_segment(base, [(4 * MiB, True), (16 * MiB, False)], small=False)
    model.add_segment(base + 20 * MiB, [(512, True), (2 * MiB - 512, False)], small=True)
    check_invariants(model)
    stats = model.stats()
    assert (stats.reserved_bytes, stats.allocated_bytes, stats.segments) == (22 * MiB, 4 * MiB + 512, 2)
    assert stats.num_device_alloc == 0  # the real allocator made them, not the model
    # Best fit takes the cached 16 MiB block (split: more than 1 MiB remains), no new segment.
    five = model.malloc(5 * MiB)
    assert model.stats().reserved_bytes == 22 * MiB
    assert model.layout()[0] == (
        base,
        False,
        [(base, 4 * MiB, held[0]), (base + 4 * MiB, 5 * MiB, five), (base + 9 * MiB, 11 * MiB, None)],
    )
    # The held block frees and merges like any other.
    model.free(held[0])
    model.free(five)
    assert blocks(model)[0] == [(20 * MiB, False)]
    # A miss makes a segment of the model's own, above the real ones.
    model.malloc(30 * MiB)
    assert model.layout()[-1][0] >= base + 22 * MiB
    check_invariants(model)


def test_taking_over_merges_free_neighbours_and_refuses_what_it_cannot_hold() -> None:
    model = CachingAllocatorModel(100 * MiB)
    (handle,) = model.add_segment(0, [(MiB, False), (MiB, False), (2 * MiB, True)], small=False)
    assert model.segments() == [(4 * MiB, [(2 * MiB, False), (2 * MiB, True)])]
    assert model.layout() == [(0, False, [(0, 2 * MiB, None), (2 * MiB, 2 * MiB, handle)])]
    with pytest.raises(ValueError, match="overlaps"):
        model.add_segment(3 * MiB, [(2 * MiB, False)], small=False)
    with pytest.raises(ValueError, match="multiples of 512"):
        model.add_segment(10 * MiB, [(1000, True)], small=True)
    with pytest.raises(ValueError, match="expandable"):
        CachingAllocatorModel(100 * MiB, EXPANDABLE).add_segment(0, [(2 * MiB, False)], small=True)


# Expandable segments -----------------------------------------------------------------------------------


def test_expandable_segments_avoid_that_fragmentation() -> None:
    """The same sequence as the fragmentation case: in one growing segment the two 15 MiB holes
    are neighbours, merge into 30 MiB, and the 25 MiB request fits without new memory."""
    model = CachingAllocatorModel(50 * MiB, EXPANDABLE)
    handles = [model.malloc(5 * MiB) for _ in range(8)]
    for handle in handles[1:7]:
        model.free(handle)
    assert blocks(model) == [[(5 * MiB, True), (30 * MiB, False), (5 * MiB, True)]]
    model.malloc(25 * MiB)
    assert blocks(model) == [[(5 * MiB, True), (25 * MiB, True), (5 * MiB, False), (5 * MiB, True)]]
    stats = model.stats()
    assert (stats.reserved_bytes, stats.num_alloc_retries, stats.num_device_alloc) == (40 * MiB, 0, 2)
    check_invariants(model)


def test_an_expandable_segment_grows_by_20mib_pages_and_merges_its_free_end() -> None:
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    model.malloc(15 * MiB)  # one 20 MiB page; 5 MiB free at the end
    assert blocks(model) == [[(15 * MiB, True), (5 * MiB, False)]]
    model.malloc(12 * MiB)  # the free 5 MiB and a new page: one block across the page boundary
    assert blocks(model) == [[(15 * MiB, True), (12 * MiB, True), (13 * MiB, False)]]
    stats = model.stats()
    assert (stats.reserved_bytes, stats.num_device_alloc, stats.segments) == (40 * MiB, 2, 0)


def test_a_free_end_counts_towards_the_pages_a_miss_maps() -> None:
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    model.malloc(15 * MiB)
    model.malloc(24 * MiB)  # the free 5 MiB at the end + 19 MiB: one more page, not two
    assert blocks(model) == [[(15 * MiB, True), (24 * MiB, True), (MiB, False)]]
    assert model.stats().reserved_bytes == 40 * MiB


def test_best_fit_in_an_expandable_segment_saves_the_growing_end_for_last() -> None:
    """get_free_block sizes a block followed by unmapped space as what it could grow to: a 5 MiB
    request skips the 6 MiB free end of the segment for the 8 MiB hole at its start."""
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    hole, _ = model.malloc(8 * MiB), model.malloc(6 * MiB)
    model.free(hole)
    assert blocks(model) == [[(8 * MiB, False), (6 * MiB, True), (6 * MiB, False)]]
    model.malloc(5 * MiB)
    assert blocks(model) == [[(5 * MiB, True), (3 * MiB, False), (6 * MiB, True), (6 * MiB, False)]]
    default = CachingAllocatorModel(100 * MiB)  # without expandable segments, plain best fit
    hole, _ = default.malloc(8 * MiB), default.malloc(6 * MiB)
    default.free(hole)
    default.malloc(5 * MiB)
    assert blocks(default) == [[(8 * MiB, False), (6 * MiB, True), (6 * MiB, True)]]  # 1 MiB left: no split


def test_the_small_pool_expands_by_2mib_pages() -> None:
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    for _ in range(3):
        model.malloc(MiB)
    assert blocks(model) == [[(MiB, True)] * 3 + [(MiB, False)]]
    assert model.stats().reserved_bytes == 4 * MiB


def test_releasing_an_expandable_segment_unmaps_only_wholly_free_pages() -> None:
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    a = model.malloc(15 * MiB)
    b = model.malloc(12 * MiB)  # [15 A | 12 A (across the page boundary) | 13 free]
    model.free(a)
    model.empty_cache()  # neither free range holds a whole page
    assert model.stats().reserved_bytes == 40 * MiB
    model.malloc(30 * MiB)  # a third page; the new block starts at 27 MiB
    model.free(b)  # [27 free | 30 A | 3 free]
    model.empty_cache()
    assert blocks(model) == [[(7 * MiB, False), (30 * MiB, True), (3 * MiB, False)]]
    assert model.stats().reserved_bytes == 40 * MiB  # page 0 (0-20 MiB) went back
    check_invariants(model)


def test_an_emptied_expandable_segment_is_released_whole() -> None:
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    handles = [model.malloc(15 * MiB), model.malloc(12 * MiB), model.malloc(300 * KiB)]
    for handle in handles:
        model.free(handle)
    model.empty_cache()
    stats = model.stats()
    assert (stats.reserved_bytes, stats.num_device_alloc, stats.num_device_free) == (0, 3, 2)
    assert model.segments() == []
    model.malloc(5 * MiB)  # a fresh segment maps again
    assert model.stats().reserved_bytes == 20 * MiB


def test_an_expandable_miss_passes_the_cap_with_the_allocation_size() -> None:
    # alloc_block checks reserved + get_allocation_size(size) against the cap before mapping.
    model = CachingAllocatorModel(40 * MiB, EXPANDABLE)
    model.malloc(15 * MiB)
    with pytest.raises(AllocatorOutOfMemory, match=r"Tried to allocate 22\.0 MiB"):
        model.malloc(22 * MiB)  # 20 + 22 > 40
    model.malloc(12 * MiB)  # 20 + 12 <= 40: one more page
    assert model.stats().reserved_bytes == 40 * MiB


def test_on_a_card_larger_than_the_cap_a_page_can_pass_the_cap() -> None:
    model = CachingAllocatorModel(30 * MiB, EXPANDABLE, total_bytes=80 * MiB)
    model.malloc(15 * MiB)
    model.malloc(10 * MiB)  # the check is 20 + 10 <= 30; the page mapped is 20 MiB
    assert model.stats().reserved_bytes == 40 * MiB
    exact = CachingAllocatorModel(30 * MiB, EXPANDABLE)  # the card is exactly the cap
    exact.malloc(15 * MiB)
    with pytest.raises(AllocatorOutOfMemory):
        exact.malloc(10 * MiB)


# Streams ---------------------------------------------------------------------------------------------------


def test_a_stream_s_freed_block_serves_only_that_stream() -> None:
    model = CachingAllocatorModel(100 * MiB)
    model.free(model.malloc(5 * MiB, stream=0))
    side = model.malloc(5 * MiB, stream=1)  # the default stream's free 20 MiB segment is not its
    assert model.stats().reserved_bytes == 40 * MiB
    model.free(side)
    model.malloc(5 * MiB, stream=0)
    model.malloc(5 * MiB, stream=1)  # each takes its own stream's block back: nothing new reserved
    assert (model.stats().reserved_bytes, model.stats().num_device_alloc) == (40 * MiB, 2)
    check_invariants(model)


def test_another_stream_s_cache_comes_back_only_when_a_miss_releases_it() -> None:
    """A side stream's free segment is reserved memory the default stream cannot use: a miss passes
    the cap, the cache is released, and the third alloc_block (a retry) succeeds."""
    model = CachingAllocatorModel(40 * MiB)
    model.free(model.malloc(30 * MiB, stream=1))
    model.malloc(30 * MiB, stream=0)
    stats = model.stats()
    assert (stats.num_alloc_retries, stats.num_device_free, stats.reserved_bytes) == (1, 1, 30 * MiB)
    check_invariants(model)


def test_a_block_used_by_another_stream_waits_for_its_work_before_reuse() -> None:
    model = CachingAllocatorModel(100 * MiB)
    used = model.malloc(12 * MiB)
    model.record_stream(used, 1)
    model.free(used)
    stats = model.stats()
    assert (stats.allocated_bytes, stats.reserved_bytes, model.pending_bytes()) == (0, 12 * MiB, 12 * MiB)
    model.malloc(12 * MiB)  # the freed block still waits: a new segment
    assert model.stats().reserved_bytes == 24 * MiB
    model.synchronize()
    assert model.pending_bytes() == 0
    model.malloc(12 * MiB)  # now it serves
    assert model.stats().reserved_bytes == 24 * MiB
    check_invariants(model)


def test_recording_the_block_s_own_stream_changes_nothing() -> None:
    model = CachingAllocatorModel(100 * MiB)
    used = model.malloc(12 * MiB, stream=2)
    model.record_stream(used, 2)
    model.free(used)
    assert model.pending_bytes() == 0
    model.malloc(12 * MiB, stream=2)
    assert model.stats().reserved_bytes == 12 * MiB
    with pytest.raises(KeyError, match="unknown allocator handle"):
        model.record_stream(used, 1)


def test_a_miss_that_would_fail_waits_for_every_stream_first() -> None:
    """release_cached_blocks synchronizes first: the waiting block returns and its segment is released."""
    model = CachingAllocatorModel(40 * MiB)
    used = model.malloc(30 * MiB)
    model.record_stream(used, 1)
    model.free(used)
    model.malloc(30 * MiB)
    stats = model.stats()
    assert (stats.num_alloc_retries, stats.num_device_free, model.pending_bytes()) == (1, 1, 0)
    check_invariants(model)


def test_a_waiting_block_merges_with_its_neighbours_only_once_it_is_back() -> None:
    model = CachingAllocatorModel(100 * MiB)
    first, second = model.malloc(KiB), model.malloc(KiB)
    model.record_stream(first, 3)
    model.free(first)
    model.free(second)
    assert blocks(model) == [[(KiB, False), (2 * MiB - KiB, False)]]  # shown free, not yet merged
    model.synchronize()
    assert blocks(model) == [[(2 * MiB, False)]]
    check_invariants(model)


def test_each_stream_has_an_expandable_segment_of_its_own() -> None:
    model = CachingAllocatorModel(100 * MiB, EXPANDABLE)
    model.free(model.malloc(5 * MiB, stream=0))
    model.malloc(5 * MiB, stream=1)
    assert model.stats().reserved_bytes == 40 * MiB  # a 20 MiB page in each stream's segment
    assert len(model.segments()) == 2
    check_invariants(model)


# Settings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, AllocatorConfig()),
        ("", AllocatorConfig()),
        ("max_split_size_mb:256", AllocatorConfig(max_split_size=256 * MiB)),
        ("expandable_segments:True", AllocatorConfig(expandable_segments=True)),
        ("expandable_segments:False", AllocatorConfig()),
        (" max_split_size_mb : 128 , expandable_segments:True ", AllocatorConfig(128 * MiB, True)),
        (
            "garbage_collection_threshold:0.6,max_split_size_mb:20",
            AllocatorConfig(max_split_size=20 * MiB, garbage_collection_threshold=0.6),
        ),
        ("expandable_segments:True,expandable_segments:False", AllocatorConfig()),  # the last one wins
        ("backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True", AllocatorConfig()),
    ],
)
def test_parse_reads_the_allocator_settings(text: str | None, expected: AllocatorConfig) -> None:
    assert AllocatorConfig.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_split_mb:128", "'max_split_mb'"),
        ("expandable_segments:True,colour:blue", "'colour'"),
        ("expandable_segments:yes", "True or False"),
        ("expandable_segments", "needs ':'"),
        ("max_split_size_mb:19", "must be >= 20"),
        ("max_split_size_mb:1.5", "whole number"),
        ("garbage_collection_threshold:1.5", r"\(0.0, 1.0\)"),
        ("roundup_power2_divisions:[256:1,>:4]", "'roundup_power2_divisions'.*not modelled"),
        ("backend:cudaMallocAsync", "not modelled"),
        ("expandable_segments:True:False", "expected ','"),
    ],
)
def test_parse_refuses_what_it_cannot_follow(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AllocatorConfig.parse(text)


def test_describe_names_the_settings() -> None:
    assert AllocatorConfig().describe() == "default (no max_split_size, no expandable segments)"
    assert EXPANDABLE.describe() == "expandable_segments:True"
    both = AllocatorConfig.parse("max_split_size_mb:64,expandable_segments:True")
    assert both.describe() == "max_split_size_mb:64,expandable_segments:True"
    assert AllocatorConfig.parse(both.describe()) == both
    with pytest.raises(ValueError, match="positive"):
        AllocatorConfig(max_split_size=0)


# Traces ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "events", "reserved"),
    [
        # Two 5 MiB tensors share a 20 MiB segment; a 12 MiB one gets its own.
        (AllocatorConfig(), [("alloc", 1, 5 * MiB), ("alloc", 2, 5 * MiB), ("alloc", 3, 12 * MiB)], 32 * MiB),
        # Freed, the 12 MiB segment serves an 11 MiB tensor (1 MiB would remain: no split).
        (AllocatorConfig(), [("alloc", 1, 12 * MiB), ("free", 1), ("alloc", 2, 11 * MiB)], 12 * MiB),
        # Growing tensors: each is too big for the freed one before it; nothing returns to the driver.
        (
            AllocatorConfig(),
            [("alloc", 1, 12 * MiB), ("free", 1), ("alloc", 2, 14 * MiB), ("free", 2), ("alloc", 3, 16 * MiB)],
            42 * MiB,
        ),
        # The same in one expandable segment: 20 MiB pages, the freed space reused at the start.
        (
            EXPANDABLE,
            [("alloc", 1, 12 * MiB), ("free", 1), ("alloc", 2, 14 * MiB), ("free", 2), ("alloc", 3, 16 * MiB)],
            20 * MiB,
        ),
    ],
)
def test_replaying_a_trace_ends_with_the_reserved_bytes_worked_out_by_hand(
    config: AllocatorConfig, events: list[Event], reserved: int
) -> None:
    model = CachingAllocatorModel(200 * MiB, config)
    replay(model, events)
    assert model.stats().reserved_bytes == reserved
    check_invariants(model)


def training_step_trace(first_id: int, *, first_step: bool) -> list[Event]:
    """One step of a small MLP (fp32, batch 1536, hidden 1024, 4 layers, Adam): forward activations,
    backward gradients freeing the activations in reverse, the optimizer, zero_grad(set_to_none)."""
    ids = iter(range(first_id, first_id + 10_000))
    events: list[Event] = []
    weights = [(4 * MiB, 4 * KiB)] * 4  # (weight, bias) of each Linear(1024, 1024)
    if first_step:  # the parameters and their Adam state live across steps: ids 0..
        for n, (w, b) in enumerate(weights):
            events += [("alloc", 10 * n, w), ("alloc", 10 * n + 1, b)]
    batch = next(ids)
    events.append(("alloc", batch, 6 * MiB))  # the input, 1536 x 1024
    activations = []
    for _ in weights:
        out, temp = next(ids), next(ids)
        events += [("alloc", out, 6 * MiB), ("alloc", temp, 64 * KiB), ("free", temp)]  # + a reduction
        activations.append(out)
    loss = next(ids)
    events.append(("alloc", loss, 4))
    grads = []
    grad_out = next(ids)
    events.append(("alloc", grad_out, 6 * MiB))
    for n in reversed(range(len(weights))):
        w, b = weights[n]
        grad_w, grad_b, grad_in = next(ids), next(ids), next(ids)
        events += [("alloc", grad_w, w), ("alloc", grad_b, b), ("alloc", grad_in, 6 * MiB)]
        events += [("free", grad_out), ("free", activations[n])]
        grads += [grad_w, grad_b]
        grad_out = grad_in
    events += [("free", grad_out), ("free", loss), ("free", batch)]
    for n, (w, b) in enumerate(weights):
        if first_step:  # exp_avg and exp_avg_sq
            events += [("alloc", 10 * n + 2, w), ("alloc", 10 * n + 3, w), ("alloc", 10 * n + 4, b)]
            events += [("alloc", 10 * n + 5, b)]
        temp = next(ids)
        events += [("alloc", temp, w), ("free", temp)]  # the update's temporary
    events += [("free", g) for g in grads]  # zero_grad(set_to_none=True)
    return events


@pytest.mark.parametrize("config", [AllocatorConfig(), EXPANDABLE, SPLIT_40], ids=lambda c: c.describe())
def test_a_training_loop_s_reserved_memory_stops_changing(config: AllocatorConfig) -> None:
    """Worked out by hand with the default settings: the first step ends with four 20 MiB segments
    (the weights; the input and activations; the activations and gradient outputs; the gradient
    inputs) and the 2 MiB small segment of the biases, 82 MiB; Adam's state is allocated after the
    activations are gone, into those segments. From the second step on the state is live during
    the forward pass, the fourth activation misses, and a fifth 20 MiB segment makes 102 MiB, which
    every later step reuses. No block reaches 40 MiB, so max_split_size_mb:40 changes nothing; the
    expandable segment maps the same five 20 MiB pages."""
    model = CachingAllocatorModel(200 * MiB, config)
    live: dict[int, int] = {}
    reserved, device_allocs = [], []
    for step in range(4):
        replay(model, training_step_trace(1000 * (step + 1), first_step=step == 0), live)
        reserved.append(model.stats().reserved_bytes)
        device_allocs.append(model.stats().num_device_alloc)
        check_invariants(model)
    assert sorted(live) == [10 * n + k for n in range(4) for k in range(6)]  # the parameters and Adam state
    assert model.stats().allocated_bytes == 4 * 3 * (4 * MiB + 4 * KiB)
    # The first step shapes the cache; from the second on, nothing new is reserved or released.
    assert reserved == [82 * MiB, 102 * MiB, 102 * MiB, 102 * MiB]
    assert device_allocs[1] == device_allocs[2] == device_allocs[3], device_allocs
    assert model.stats().num_alloc_retries == 0
    assert reserved[3] >= model.stats().peak_allocated_bytes


# Scale and properties -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [AllocatorConfig(), EXPANDABLE, SPLIT_40], ids=lambda c: c.describe())
def test_20000_malloc_free_pairs_of_mixed_sizes_run(config: AllocatorConfig) -> None:
    rng = random.Random(2024)
    model = CachingAllocatorModel(4 << 30, config)
    live: list[int] = []
    sizes = [(0, 4 * KiB), (4 * KiB, MiB), (MiB, 12 * MiB), (12 * MiB, 64 * MiB)]
    for _ in range(20_000):
        low, high = rng.choice(sizes)
        live.append(model.malloc(rng.randrange(low, high)))
        if len(live) > 64 or rng.random() < 0.5:
            model.free(live.pop(rng.randrange(len(live))))
    check_invariants(model)
    for handle in live:
        model.free(handle)
    model.empty_cache()  # everything is free, so every segment and page goes back
    assert model.stats().allocated_bytes == model.stats().reserved_bytes == 0
    assert model.segments() == []


operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 40 * MiB)),
        st.tuples(st.just("free"), st.integers(0, 63)),
        st.tuples(st.just("empty"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=operations, config=st.sampled_from([AllocatorConfig(), EXPANDABLE, SPLIT_40]))
def test_the_invariants_hold_after_every_call(ops: list[tuple[str, int]], config: AllocatorConfig) -> None:
    model = CachingAllocatorModel(160 * MiB, config)
    live: list[int] = []
    for kind, value in ops:
        before = model.stats()
        if kind == "alloc":
            failure = None
            try:
                live.append(model.malloc(value))
            except AllocatorOutOfMemory as oom:
                failure = oom
            if failure is not None:  # only the releases and the retry count changed
                after = model.stats()
                assert failure.stats == after
                assert after.allocated_bytes == before.allocated_bytes
                assert after.num_alloc_retries == before.num_alloc_retries + 1
                assert after.reserved_bytes <= before.reserved_bytes
        elif kind == "free" and live:
            model.free(live.pop(value % len(live)))
        elif kind == "empty":
            model.empty_cache()
        check_invariants(model)
    for handle in live:
        model.free(handle)
    model.empty_cache()
    assert model.stats().reserved_bytes == 0


def test_the_model_imports_no_torch() -> None:
    """Not at the top, not lazily: the module names no torch, and importing it loads none."""
    source = Path(__file__).resolve().parent.parent / "autotune" / "devices" / "allocator.py"
    tree = ast.parse(source.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] == "torch"}
    code = "import sys, autotune.devices.allocator; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]"
