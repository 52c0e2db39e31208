"""The allocator model's streams on the budget device (issue 37 item 3): a storage is allocated on
the stream current when it is made and freed into that stream's pool; one that another stream used
(`Tensor.record_stream`) waits for the end of the optimizer step before its memory serves again.
A DDP probe of a job that prefetches its batches on a side stream answers for that, and the answer of
the model without streams runs out of memory in the job's own loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from autotune import parallel
from autotune.devices.budget import BudgetDevice
from autotune.engine.probe import ProbeRequest, load_workload, run_probe
from autotune.results import ParallelSpec, ProbeResult

MIB = 2**20
MEMORY = 64 * MIB
PREFETCHED = "tests.stream_workloads:prefetched"


def _probe(target: str, streams: str, monkeypatch: pytest.MonkeyPatch) -> ProbeResult:
    monkeypatch.setenv("AUTOTUNE_ALLOCATOR_STREAMS", streams)
    request = ProbeRequest(
        target=target, device="cpu", memory=MEMORY, headroom=0, parallel="ddp", allocator="cuda", confirm=False
    )
    return run_probe(request)


@pytest.fixture(scope="module")
def probed() -> Iterator[dict[str, ProbeResult]]:
    with pytest.MonkeyPatch.context() as patch:
        yield {
            "prefetched": _probe(PREFETCHED, "model", patch),
            "prefetched-one-stream": _probe(PREFETCHED, "one", patch),
            "plain": _probe("tests.stream_workloads:plain", "model", patch),
        }


def _ddp_loop(batch: int, steps: int) -> bool:
    """The job's own loop (DDP over a one-rank group, batches from the side stream) on a fresh budget
    device with the stream model: True when all `steps` optimizer steps ran."""
    workload = load_workload(ProbeRequest(target=PREFETCHED, device="cpu"))
    device = BudgetDevice(MEMORY, allocator="cuda")
    try:
        with device.active():
            model = workload.build_model()
            model = parallel.wrap(model, ParallelSpec(strategy="ddp"), torch.device("cpu"), None)
            optimizer = torch.optim.AdamW(model.parameters())
            for _ in range(steps):
                data = workload.make_batch(batch, torch.device("cpu"))
                workload.loss(model, data).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del data
    except torch.OutOfMemoryError:
        return False
    finally:
        parallel.release()
    return True


@pytest.mark.slow
def test_a_ddp_probe_answers_for_the_side_stream_s_pool_and_the_waits(probed: dict[str, ProbeResult]) -> None:
    streams, one = probed["prefetched"], probed["prefetched-one-stream"]
    assert "one stream" in (one.allocator_config or "") and "one stream" not in (streams.allocator_config or "")
    # The batches' memory is the side stream's, and each waits out its step: the answer is lower.
    assert streams.max_micro_batch < one.max_micro_batch
    # Without a side stream the streams change nothing: the same model's answer as with one stream.
    assert probed["plain"].max_micro_batch == one.max_micro_batch
    # The answer fits in the job's loop and one more does not; the one-stream answer runs out there.
    answer = streams.max_micro_batch
    assert _ddp_loop(answer, steps=4)
    assert not _ddp_loop(answer + 1, steps=4)
    assert not _ddp_loop(one.max_micro_batch, steps=4)


def test_a_block_another_stream_used_serves_again_only_after_the_optimizer_step() -> None:
    device = BudgetDevice(64 * MIB, allocator="cuda")
    side = torch.cpu.Stream()
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with device.active():
        used = torch.empty(12 * MIB, dtype=torch.uint8)
        used.record_stream(side)
        del used
        reserved = device.allocator_state()
        torch.empty(12 * MIB, dtype=torch.uint8)  # the freed block still waits: a new segment
        assert reserved is not None and device.allocator_state().reserved_bytes == reserved.reserved_bytes + 12 * MIB
        weight.grad = torch.ones(4)
        optimizer.step()  # the step's end: the streams' work is done
        before = device.allocator_state().reserved_bytes
        kept = torch.empty(12 * MIB, dtype=torch.uint8)
        assert device.allocator_state().reserved_bytes == before  # the block serves again
        del kept


def test_storages_made_in_a_stream_s_context_use_that_stream_s_pool() -> None:
    """FSDP2 and loaders switch streams with the device module's `stream(...)`: on the budget
    device, torch.cpu.stream. A block freed on the side stream does not serve the default one."""
    device = BudgetDevice(64 * MIB, allocator="cuda")
    with device.active():
        with torch.cpu.stream(torch.cpu.Stream()):
            made = torch.empty(12 * MIB, dtype=torch.uint8)
        del made
        before = device.allocator_state().reserved_bytes
        torch.empty(12 * MIB, dtype=torch.uint8)
        assert device.allocator_state().reserved_bytes == before + 12 * MIB


def test_one_stream_puts_every_storage_on_the_default_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_ALLOCATOR_STREAMS", "one")
    device = BudgetDevice(64 * MIB, allocator="cuda")
    with device.active():
        with torch.cpu.stream(torch.cpu.Stream()):
            made = torch.empty(12 * MIB, dtype=torch.uint8)
        made.record_stream(torch.cpu.Stream())
        del made
        before = device.allocator_state().reserved_bytes
        torch.empty(12 * MIB, dtype=torch.uint8)
        assert device.allocator_state().reserved_bytes == before


def test_a_bad_streams_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.errors import ConfigError

    monkeypatch.setenv("AUTOTUNE_ALLOCATOR_STREAMS", "two")
    with pytest.raises(ConfigError, match="AUTOTUNE_ALLOCATOR_STREAMS='two' is not model or one"):
        BudgetDevice(64 * MIB, allocator="cuda")
