"""The CPU budget device: exact live-byte counts and a genuine torch.OutOfMemoryError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.devices.budget import BudgetDevice, rounded
from autotune.workloads.examples import EXAMPLES


def _two_steps(name: str, batch_size: int) -> tuple[int, int]:
    """Peak of two training steps counted by the budget device and by torch's MemTracker."""
    workload = EXAMPLES[name]()
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.make_optimizer(model.parameters())
    batch = workload.make_batch(batch_size, torch.device("cpu"))
    device = BudgetDevice(2**40)
    device.track([*model.parameters(), *model.buffers(), *batch])
    with device.active():
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            workload.loss(model, batch).backward()
            optimizer.step()
    ours = device.peak_allocated_bytes()

    model = workload.build_model()
    optimizer = workload.make_optimizer(model.parameters())
    from torch.distributed._tools.mem_tracker import MemTracker  # 1.3 s of imports: only where it is used

    tracker = MemTracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            workload.loss(model, batch).backward()
            optimizer.step()
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return ours, theirs


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_peak_matches_torch_memtracker_within_one_percent(name: str) -> None:
    ours, theirs = _two_steps(name, 8)
    assert ours == pytest.approx(theirs, rel=0.01)


def test_counts_what_was_created_before_the_mode_once_tracked() -> None:
    device = BudgetDevice(2**30)
    weight = torch.empty(1000)  # 4000 bytes, rounded to 4096
    device.track([weight, weight.view(10, 100)])  # a view shares the storage: counted once
    assert device.live_bytes() == rounded(4000) == 4096
    del weight
    assert device.live_bytes() == 0


def test_an_op_past_the_limit_raises_a_genuine_out_of_memory_error() -> None:
    device = BudgetDevice(total_bytes=1 << 20, limit_bytes=1 << 19)
    with device.active():
        small = torch.ones(1000)
        with pytest.raises(torch.OutOfMemoryError, match="CPU budget device") as info:
            torch.ones(1 << 18)  # 1 MiB
    assert isinstance(info.value, torch.cuda.OutOfMemoryError)
    # Nothing of the failed op is counted, even while the exception (and its traceback) lives.
    assert device.live_bytes() == rounded(small.nbytes)
    del info
    assert device.live_bytes() == rounded(small.nbytes)


def test_the_message_reads_as_cudas_so_frameworks_see_an_oom() -> None:
    device = BudgetDevice(total_bytes=1 << 20)
    with device.active(), pytest.raises(torch.OutOfMemoryError) as info:
        torch.ones(1 << 19)
    text = str(info.value)
    assert text.startswith("CUDA out of memory. Tried to allocate 2.0 MiB.")
    # Lightning: one argument, "CUDA" and "out of memory"; Accelerate: " out of memory." with the period.
    assert len(info.value.args) == 1 and "CUDA" in text and " out of memory." in text
    assert "budget device" in text


def test_code_in_an_except_block_runs_as_on_a_gpu() -> None:
    device = BudgetDevice(total_bytes=1 << 20)
    with device.active():
        held = torch.ones(200_000)  # 800 KB of the 1 MiB
        try:
            torch.ones(100_000)  # 400 KB more: out of memory
        except torch.OutOfMemoryError:
            # Inside the block a GPU would have freed nothing and allocated nothing for the failed
            # op: small allocations, views and 0-byte ops still run.
            view = held[:10]
            empty = torch.empty(0)
            scalar = torch.zeros(())
            recovered = torch.ones(1000)
        assert view.shape == (10,) and empty.numel() == 0 and scalar.item() == 0 and recovered.sum() == 1000
        assert device.live_bytes() == rounded(held.nbytes) + 512 + rounded(4000)  # the scalar: one block


def test_an_op_that_allocates_nothing_never_raises_even_above_the_limit() -> None:
    device = BudgetDevice(total_bytes=1 << 20, limit_bytes=1 << 20)
    big = torch.ones(300_000)  # 1.2 MB, made outside the mode: the device is already over its limit
    device.track([big])
    with device.active():
        big.mul_(2)  # in place: nothing new
        part = big[:100].view(10, 10)  # a view: nothing new
        nothing = big[:0].clone()  # 0 bytes
        with pytest.raises(torch.OutOfMemoryError):
            big[:10].clone()  # 512 B more than the limit allows
    assert part.sum() == 200 and nothing.numel() == 0


@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_oom_surfaces_from_each_phase_of_a_step(phase: str) -> None:
    model = nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256)
    probe = BudgetDevice(2**30)
    probe.track([*model.parameters(), x])
    with probe.active():  # measure where each phase ends
        out = model(x).square().mean()
        after_forward = probe.peak_allocated_bytes()
        out.backward()
        after_backward = probe.peak_allocated_bytes()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.Adam(model.parameters())
    limit = {"forward": after_forward - 1, "backward": after_backward - 1, "step": after_backward + 1}[phase]
    device = BudgetDevice(2**30, limit_bytes=limit)
    device.track([*model.parameters(), x])
    with device.active(), pytest.raises(torch.OutOfMemoryError):  # noqa: PT012 - which phase raises is the test
        loss = model(x).square().mean()
        assert phase != "forward"
        loss.backward()
        assert phase != "backward"
        optimizer.step()


def _adam_state(model: nn.Module, dtype: torch.dtype) -> dict:
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        for key, value in state.items():
            if key != "step":
                state[key] = value.to(dtype)  # as a checkpoint written in another dtype
    return saved


def test_optimizer_state_recreated_by_load_state_dict_is_counted() -> None:
    model = nn.Linear(512, 512)
    saved = _adam_state(model, torch.float64)
    device = BudgetDevice(2**30)
    device.track(model.parameters())
    params = device.live_bytes()
    fresh = torch.optim.Adam(model.parameters())
    with device.active():
        fresh.load_state_dict(saved)  # converts to the parameters' dtype: new tensors
    # exp_avg and exp_avg_sq: two more copies of the parameters
    assert device.live_bytes() - params >= 2 * params


def test_state_loaded_without_copies_is_counted_when_the_step_reads_it() -> None:
    model = nn.Linear(512, 512)
    saved = _adam_state(model, torch.float32)  # same dtype and device: load_state_dict keeps the tensors
    device = BudgetDevice(2**30)
    device.track(model.parameters())
    params = device.live_bytes()
    fresh = torch.optim.Adam(model.parameters())
    with device.active():
        fresh.load_state_dict(saved)
        model(torch.randn(4, 512)).sum().backward()
        fresh.step()
    assert device.live_bytes() - params >= 3 * params  # grads + two moments


def test_an_ops_values_flatten_as_torchs_pytree_flattens_them() -> None:
    """The budget device's own walk of an op's arguments and outputs finds what torch's pytree finds."""
    from collections import OrderedDict, namedtuple

    from torch.utils._pytree import tree_flatten

    from autotune.devices.budget import leaves_of

    pair = namedtuple("pair", "a b")
    t = torch.ones(2)
    values = [
        ((t, [t, 1, None], {"x": t}), {"k": [t, (t,)]}),  # args and kwargs: Tensor[] and optional entries
        pair(t, [t]),
        OrderedDict(a=t, b=(t, 2.0)),
        (torch.Size([2, 3]), t),
        3,
        t,
    ]
    for value in values:
        ours, theirs = leaves_of(value), tree_flatten(value)[0]
        assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs, strict=True)), value
