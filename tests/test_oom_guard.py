"""The accumulation helper's OOM guard: a micro-step that runs out of memory mid-window is redone
with smaller micro-batches, and the optimizer still sees exactly the window's gradient."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from autotune.devices.budget import BudgetDevice
from autotune.errors import RunOutOfMemoryError
from autotune.plans.accumulate import OOMGuard, ShrinkEvent, accumulate, split_batch
from tests.docs_text import page

# Wide hidden layer, few inputs: activations dominate, so halving the micro-batch saves memory.
WIDTH = 2048


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(n, 16), torch.randn(n, 1)


def _micro_batches(x: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def _full_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return grads


def _peak(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Peak of an unguarded accumulated window on an unlimited budget device."""
    device = BudgetDevice(2**30)
    device.track([*model.parameters()])
    with device.active():
        for step in accumulate(batches, len(batches)):
            x, y = step.batch
            step.scale(nn.functional.mse_loss(model(x), y)).backward()
    model.zero_grad(set_to_none=True)
    return device.peak_allocated_bytes()


@pytest.fixture(scope="module")
def setting() -> tuple[nn.Module, torch.Tensor, torch.Tensor, int]:
    model = _model()
    x, y = _data(12)
    # The limit: what a window of micro-batches of 4 needs. A micro-batch of 8 after one of 4
    # (gradients alive) needs more: it runs out of memory mid-window.
    limit = _peak(model, _micro_batches(x, y, [4, 4, 4]))
    assert _peak(model, _micro_batches(x, y, [4, 8])) > limit
    return model, x, y, limit


def test_an_oom_mid_window_is_redone_smaller_with_the_exact_window_gradient(
    setting: tuple[nn.Module, torch.Tensor, torch.Tensor, int], caplog: pytest.LogCaptureFixture
) -> None:
    model, x, y, limit = setting
    expected = _full_gradient(model, x, y)
    device = BudgetDevice(limit)
    device.track([*model.parameters(), x, y])
    heard: list[ShrinkEvent] = []
    guard = OOMGuard(model, on_shrink=heard.append)
    attempts: list[int] = []  # samples of each micro-step that started
    with caplog.at_level(logging.WARNING, logger="autotune"), device.active():
        # One window of two micro-batches: 4 samples, then 8.
        for window in guard.windows(_micro_batches(x, y, [4, 8]), 2):

            def micro_step(step):  # type: ignore[no-untyped-def]
                attempts.append(int(step.batch[0].shape[0]))
                xb, yb = step.batch
                step.scale(nn.functional.mse_loss(model(xb), yb)).backward()

            window.run(micro_step)
            got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    # The first attempt ran the micro-batch of 4, then ran out of memory in the one of 8 (mid-window);
    # the redo cut the window's 12 samples into micro-batches of at most 4.
    assert attempts == [4, 8, 4, 4, 4]
    assert [(e.window, e.old_micro_batch, e.new_micro_batch) for e in heard] == [(0, 8, 4)]
    assert "out of memory" in heard[0].message
    assert "window 0 ran out of memory at micro-batch 8; redoing it with micro-batches of 4" in caplog.text
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-7)
    assert guard.micro_batch_limit == 4


def test_without_the_guard_the_same_window_runs_out_of_memory(
    setting: tuple[nn.Module, torch.Tensor, torch.Tensor, int],
) -> None:
    model, x, y, limit = setting
    device = BudgetDevice(limit)
    device.track([*model.parameters(), x, y])

    def unguarded() -> None:
        for step in accumulate(_micro_batches(x, y, [4, 8]), 2):
            xb, yb = step.batch
            step.scale(nn.functional.mse_loss(model(xb), yb)).backward()

    with device.active(), pytest.raises(torch.OutOfMemoryError):
        unguarded()
    model.zero_grad(set_to_none=True)


def test_the_smaller_size_is_kept_for_later_windows(setting: tuple[nn.Module, torch.Tensor, torch.Tensor, int]) -> None:
    model, x, y, limit = setting
    device = BudgetDevice(limit)
    device.track([*model.parameters(), x, y])
    guard = OOMGuard(model)
    sizes: list[list[int]] = []
    windows = _micro_batches(x, y, [4, 8]) + _micro_batches(x, y, [8, 4])
    with device.active():
        for window in guard.windows(windows, 2):
            ran: list[int] = []

            def micro_step(step, ran=ran):  # type: ignore[no-untyped-def]
                ran.append(int(step.batch[0].shape[0]))
                xb, yb = step.batch
                step.scale(nn.functional.mse_loss(model(xb), yb)).backward()

            window.run(micro_step)
            sizes.append(ran)
            model.zero_grad(set_to_none=True)
    assert sizes == [[4, 8, 4, 4, 4], [4, 4, 4]]  # the second window starts at the smaller size
    assert len(guard.events) == 1


def test_one_sample_that_does_not_fit_is_a_clear_error() -> None:
    model = _model()
    x, y = _data(2)
    device = BudgetDevice(64 * 1024)  # less than the parameters' gradients
    device.track([*model.parameters(), x, y])
    guard = OOMGuard(model)
    (window,) = guard.windows([(x, y)], 1)

    def micro_step(step):  # type: ignore[no-untyped-def]
        step.scale(nn.functional.mse_loss(model(step.batch[0]), step.batch[1])).backward()

    with device.active(), pytest.raises(RunOutOfMemoryError, match="micro-batches of 1 sample"):
        window.run(micro_step)


def test_split_batch_cuts_tensors_tuples_and_mappings_into_views() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    batch = {"x": x, "pair": (x[:, 0], torch.zeros(5)), "name": "kept"}
    pieces = split_batch(batch, 2)
    assert [p["x"].shape[0] for p in pieces] == [2, 2, 1]
    assert pieces[2]["pair"][0].tolist() == [8.0] and pieces[0]["name"] == "kept"
    assert pieces[0]["x"].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_the_docs_example_shrinks_once_and_finishes(capsys: pytest.CaptureFixture[str]) -> None:
    import re
    import runpy
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    example = root / "examples" / "oom_guard_loop.py"
    namespace = runpy.run_path(str(example))
    assert namespace["guard"].micro_batch_limit == 32
    assert "window 0: 64 -> 32" in capsys.readouterr().out
    text = page("docs/accumulation.md")
    block = re.search(r"```python\n(.*?)```", text.split("`OOMGuard`.**", 1)[1], re.DOTALL)
    assert block is not None and block.group(1) in example.read_text(encoding="utf-8")


def test_a_redo_does_not_sum_the_window_over_ranks_again(
    setting: tuple[nn.Module, torch.Tensor, torch.Tensor, int],
) -> None:
    from autotune.plans.accumulate import AcrossRanks

    model, x, y, limit = setting
    device = BudgetDevice(limit)
    device.track([*model.parameters(), x, y])
    summed: list[int] = []  # each call is a collective under DDP: every rank must make the same number

    def total(n: int) -> int:
        summed.append(n)
        return n

    guard = OOMGuard(model, ranks=AcrossRanks(world_size=1, total=total))
    with device.active():
        for window in guard.windows(_micro_batches(x, y, [4, 8]), 2):

            def micro_step(step):  # type: ignore[no-untyped-def]
                step.scale(nn.functional.mse_loss(model(step.batch[0]), step.batch[1])).backward()

            window.run(micro_step)
    model.zero_grad(set_to_none=True)
    assert len(guard.events) == 1 and summed == [12]
