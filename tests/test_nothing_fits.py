"""When nothing fits, the message quotes what bit (issue 37): with a caching allocator the limit bites
on reserved bytes, so the message says what the allocator had reserved and what it then tried to
allocate, not the allocated bytes, which can be far below the limit ("even batch 1 does not fit
within a limit of 64.5 MiB (it needed at least 45.5 MiB)")."""

from __future__ import annotations

import pytest

from autotune.engine.probe import ProbeRequest, run_probe
from autotune.engine.search import nothing_fits
from autotune.errors import NothingFitsError
from autotune.results import AllocatorState, TrialRecord

MIB = 2**20
STATE = AllocatorState(reserved_bytes=22 * MIB, segments=2, retries=1, device_allocations=2)


def test_with_a_caching_allocator_the_reserved_bytes_and_the_allocation_that_did_not_fit_are_quoted() -> None:
    ran_out = TrialRecord(
        batch=1,
        fits=False,
        peak_allocated_bytes=int(20.8 * MIB),
        peak_reserved_bytes=22 * MIB,
        seconds=0.0,
        oom_message="CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.18 GiB",
        failure="oom",
        allocator=STATE,
    )
    error = nothing_fits(ran_out, 24 * MIB)
    assert str(error).startswith(
        "even batch 1 does not fit within a limit of 24.0 MiB (the caching allocator had reserved up to 22.0 MiB, "
        "20.8 MiB of it allocated to tensors, when it tried to allocate 20.00 MiB more)"
    )
    assert "needed at least" not in str(error)
    assert error.peak_bytes == ran_out.peak_allocated_bytes and error.limit_bytes == 24 * MIB
    # A size that did not settle says why, with what was reserved.
    thrashing = ran_out.model_copy(update={"failure": "thrashing", "oom_message": "allocation retries in a row"})
    assert "reserved up to 22.0 MiB, 20.8 MiB of it allocated to tensors, and then: allocation retries" in str(
        nothing_fits(thrashing, 24 * MIB)
    )


def test_without_one_the_bytes_needed_are_quoted() -> None:
    counted = TrialRecord(
        batch=2, fits=False, peak_allocated_bytes=3 * MIB, peak_reserved_bytes=3 * MIB, seconds=0.0, failure="oom"
    )
    assert "does not fit within a limit of 2.0 MiB (it needed at least 3.0 MiB)" in str(nothing_fits(counted, 2 * MIB))


def test_a_probe_under_the_allocator_model_says_what_bit_in_either_loop() -> None:
    """The mlp at 24 MiB under the model: batch 1 allocated 20.8 MiB, below the limit, but the model
    had 22 MiB reserved and asked for a 20 MiB segment. The cnn at 8 MiB fits batch 1 with one
    micro-step and no size with accumulation (`engine.probe._search_below`): its reason says the same."""
    with pytest.raises(NothingFitsError) as raised:
        run_probe(ProbeRequest(target="mlp", device="cpu", memory=24 * MIB, headroom=0, allocator="cuda"))
    assert "(the caching allocator had reserved up to 22.0 MiB, 20.8 MiB of it allocated to tensors, when it tried" in (
        str(raised.value)
    )
    result = run_probe(ProbeRequest(target="cnn", device="cpu", memory=8 * MIB, headroom=0, allocator="cuda"))
    assert result.max_micro_batch is None and result.max_micro_batch_without_accumulation == 1
    assert result.accumulation_failure is not None
    assert "the caching allocator had reserved up to 8.0 MiB" in result.accumulation_failure
    assert "when it tried to allocate 2.0 MiB more" in result.accumulation_failure
