"""The accumulation helper: accumulated gradients equal the full-batch gradient, in float64 on CPU.

Equal windows, a ragged last window and token-weighted windows must match the gradient of the mean
loss over the whole window; the naive `loss / steps` must not, once the last window is short.
"""

from __future__ import annotations

import gc
import re
import runpy
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import autotune
from autotune.errors import ConfigError
from autotune.plans.accumulate import (
    AcrossRanks,
    MicroStep,
    accumulate,
    count_samples,
    mean_loss_weights,
    sum_loss_weight,
)
from tests.docs_text import section

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 11

Batch = tuple[torch.Tensor, torch.Tensor]


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def regression_data(n: int, seed: int = 1) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 5, generator=generator, dtype=torch.float64),
        torch.randn(n, 2, generator=generator, dtype=torch.float64),
    )


def micro_batches(data: Batch, size: int) -> list[Batch]:
    x, y = data
    return list(zip(x.split(size), y.split(size), strict=True))


def full_grad(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """The gradient of the mean loss over every sample of `batches`, in one backward."""
    model.zero_grad()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(model(x), y).backward()
    return flat_grad(model)


def accumulated_grads(model: nn.Module, batches: Sequence[Batch], steps: int) -> list[tuple[list[Batch], torch.Tensor]]:
    """Run the helper's loop; return each window's micro-batches and its accumulated gradient."""
    model.zero_grad()
    out: list[tuple[list[Batch], torch.Tensor]] = []
    window: list[Batch] = []
    for step in accumulate(batches, steps):
        window.append(step.batch)
        x, y = step.batch
        with step.sync_context(model):
            step.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step.should_step:
            out.append((window, flat_grad(model).clone()))
            window = []
            model.zero_grad()
    return out


def naive_grads(model: nn.Module, batches: Sequence[Batch], steps: int) -> list[torch.Tensor]:
    """What the usual recipe does: `loss / steps` whatever the window holds."""
    model.zero_grad()
    out = []
    for i, (x, y) in enumerate(batches):
        (nn.functional.mse_loss(model(x), y) / steps).backward()
        if (i + 1) % steps == 0 or i == len(batches) - 1:
            out.append(flat_grad(model).clone())
            model.zero_grad()
    return out


def test_equal_windows_match_the_full_batch_gradient() -> None:
    model = mlp()
    batches = micro_batches(regression_data(24), 4)  # 6 micro-batches of 4: two windows of 3
    windows = accumulated_grads(model, batches, steps=3)
    assert [len(w) for w, _ in windows] == [3, 3]
    for window, grad in windows:
        assert relative_error(grad, full_grad(model, window)) < 1e-6


def test_ragged_last_window_matches_and_naive_division_does_not() -> None:
    model = mlp()
    batches = micro_batches(regression_data(14), 3)  # sizes 3,3,3,3,2: windows [3,3,3] and [3,2]
    windows = accumulated_grads(model, batches, steps=3)
    assert [[len(b[0]) for b in w] for w, _ in windows] == [[3, 3, 3], [3, 2]]
    for window, grad in windows:
        assert relative_error(grad, full_grad(model, window)) < 1e-6

    naive = naive_grads(model, batches, steps=3)
    # The naive recipe is right for a full window of equal micro-batches...
    assert relative_error(naive[0], full_grad(model, windows[0][0])) < 1e-6
    # ...and far off for the short last window: it divides 5 samples' worth of loss by 3 steps.
    assert relative_error(naive[1], full_grad(model, windows[1][0])) > 0.2


def token_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 6), nn.Tanh(), nn.Linear(6, VOCAB)).double()


def padded(lengths: Sequence[int], seed: int) -> dict[str, torch.Tensor]:
    """Token ids, next-token labels and a mask, padded to the longest sequence of this micro-batch."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
        labels[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, :length] = True
    return {"ids": ids, "labels": labels, "mask": mask}


def token_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["ids"])
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    return losses[batch["mask"]]


def count_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["mask"].sum()


# Two sequences per micro-batch, lengths far apart so per-micro-batch means weigh tokens unequally.
TOKEN_BATCHES = [padded(lengths, seed) for seed, lengths in enumerate([[1, 2], [9, 10], [3, 8], [5, 1], [7, 7]])]


def full_token_grad(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The gradient of the mean loss over every real token of `batches`, in one backward."""
    model.zero_grad()
    torch.cat([token_losses(model, b) for b in batches]).mean().backward()
    return flat_grad(model)


def token_window_grads(
    model: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    steps: int,
    loss_of: Callable[[MicroStep[dict[str, torch.Tensor]]], torch.Tensor],
    count: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = count_tokens,
    ranks: AcrossRanks | None = None,
) -> list[torch.Tensor]:
    model.zero_grad()
    out = []
    for step in accumulate(batches, steps, count=count, ranks=ranks):
        loss_of(step).backward()
        if step.should_step:
            out.append(flat_grad(model).clone())
            model.zero_grad()
    return out


def test_token_weighted_windows_match_the_full_batch_gradient() -> None:
    model = token_model()
    windows = [TOKEN_BATCHES[:3], TOKEN_BATCHES[3:]]  # steps=3: a full window and a short one
    want = [full_token_grad(model, w) for w in windows]

    def mean_per_token(step: MicroStep[dict[str, torch.Tensor]]) -> torch.Tensor:
        return step.scale(token_losses(model, step.batch).mean())

    def summed(step: MicroStep[dict[str, torch.Tensor]]) -> torch.Tensor:
        return step.scale(token_losses(model, step.batch).sum(), reduction="sum")

    for loss_of in (mean_per_token, summed):
        got = token_window_grads(model, TOKEN_BATCHES, 3, loss_of)
        assert len(got) == 2
        for g, w in zip(got, want, strict=True):
            assert relative_error(g, w) < 1e-6

    # Counting sequences instead of tokens weighs a micro-batch of 2 tokens like one of 19.
    by_samples = token_window_grads(model, TOKEN_BATCHES, 3, mean_per_token, count=None)
    assert relative_error(by_samples[0], want[0]) > 0.05


def test_across_ranks_normalizes_by_the_global_window_total() -> None:
    """Two simulated DDP ranks with different token counts; DDP averages their gradients."""
    model = token_model()
    shards = [TOKEN_BATCHES[:2] + TOKEN_BATCHES[4:], TOKEN_BATCHES[2:4] + TOKEN_BATCHES[:1]]
    steps = 2
    local_totals = [[int(sum(count_tokens(b) for b in shard[i : i + steps])) for i in (0, 2)] for shard in shards]
    want = [full_token_grad(model, shards[0][i : i + steps] + shards[1][i : i + steps]) for i in (0, 2)]

    def rank_grads(rank: int, exact: bool) -> list[torch.Tensor]:
        other = iter(local_totals[1 - rank])
        ranks = AcrossRanks(world_size=2, total=lambda local: local + next(other)) if exact else None
        return token_window_grads(
            model, shards[rank], steps, lambda s: s.scale(token_losses(model, s.batch).sum(), "sum"), ranks=ranks
        )

    for exact, check in ((True, lambda err: err < 1e-6), (False, lambda err: err > 0.05)):
        averaged = [(a + b) / 2 for a, b in zip(rank_grads(0, exact), rank_grads(1, exact), strict=True)]
        errors = [relative_error(g, w) for g, w in zip(averaged, want, strict=True)]
        assert len(errors) == 2
        assert all(check(e) for e in errors), (exact, errors)


def test_schedule_steps_after_each_window_and_the_ragged_end() -> None:
    steps = list(accumulate([torch.zeros(2)] * 7, 3))
    assert [(s.window, s.index, s.window_size) for s in steps] == [
        (0, 0, 3),
        (0, 1, 3),
        (0, 2, 3),
        (1, 0, 3),
        (1, 1, 3),
        (1, 2, 3),
        (2, 0, 1),
    ]
    assert [s.should_step for s in steps] == [False, False, True, False, False, True, True]
    assert [s.total for s in steps] == [6] * 6 + [2]
    assert list(accumulate([], 3)) == []


def test_a_plan_gives_the_window_size_and_unequal_micro_batches_weigh_by_size() -> None:
    plan = autotune.plan(effective_batch=10, max_micro_batch=4)  # fewest-steps: 4, 3, 3
    assert plan.micro_batches == [4, 3, 3]
    steps = list(accumulate([torch.zeros(n, 1) for n in plan.micro_batches], plan))
    assert [s.weight for s in steps] == pytest.approx(plan.loss_weights)
    assert [s.should_step for s in steps] == [False, False, True]


def test_reads_exactly_one_window_ahead() -> None:
    pulled = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(7):
            pulled.append(i)
            yield torch.zeros(1)

    steps = accumulate(source(), 3)
    next(steps)
    assert pulled == [0, 1, 2]  # the whole first window, nothing of the second
    for _ in range(3):
        next(steps)
    assert pulled == [0, 1, 2, 3, 4, 5]


class CountingModule(nn.Module):
    """Stands in for DDP: records the micro-steps run under no_sync."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.entries = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.entries += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_no_sync_is_entered_exactly_on_non_final_micro_steps() -> None:
    model = CountingModule()
    seen = []
    for step in accumulate([torch.zeros(1)] * 7, 3):
        with step.sync_context(model):
            seen.append(model.inside)
    assert seen == [True, True, False, True, True, False, False]
    assert model.entries == 4

    # A bare module has no no_sync: a plain context on every micro-step.
    bare = nn.Linear(1, 1)
    for step in accumulate([torch.zeros(1)] * 3, 3):
        with step.sync_context(bare) as entered:
            assert entered is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_ddp_world_size_one_matches_the_full_batch_gradient() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ddp = DistributedDataParallel(mlp())
    try:
        batches = micro_batches(regression_data(14), 3)
        ranks = AcrossRanks.from_process_group()
        assert ranks.world_size == 1
        assert ranks.total(5) == 5
        windows = accumulated_grads(ddp, batches, steps=3)
        assert len(windows) == 2
        for window, grad in windows:
            assert relative_error(grad, full_grad(ddp.module, window)) < 1e-6
    finally:
        # The model goes before its group. Were DDP's reducer the group's last holder, the group's
        # destructor would join gloo's threads with the GIL held, and a thread still freeing the
        # last backward's allreduce needs the GIL: a worker hung here once, under load (torch 2.13).
        del ddp
        gc.collect()
        dist.destroy_process_group()


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8), st.integers(0, 5000), st.integers(1, 8))
def test_mean_loss_weights_arithmetic(counts: list[int], extra: int, world_size: int) -> None:
    local = sum(counts)
    total = local + extra
    weights = mean_loss_weights(counts, total, world_size)
    if total == 0:
        assert weights == [0.0] * len(counts)
        assert sum_loss_weight(total, world_size) == 0.0
        return
    assert sum(weights) == pytest.approx(world_size * local / total)
    for n, w in zip(counts, weights, strict=True):
        assert w == pytest.approx(n * sum_loss_weight(total, world_size))


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="accumulation steps"):
        list(accumulate([torch.zeros(1)], 0))
    with pytest.raises(ConfigError, match="whole number"):
        list(accumulate([torch.zeros(1)], 1, count=lambda b: torch.tensor(2.5)))
    with pytest.raises(ConfigError, match="whole number"):
        list(accumulate([torch.zeros(1)], 1, count=lambda b: -1))
    with pytest.raises(ConfigError, match="pass count="):
        count_samples(object())
    with pytest.raises(ConfigError, match="less than"):
        mean_loss_weights([3, 4], total=5)
    step = next(accumulate([torch.zeros(1)], 1))
    with pytest.raises(ConfigError, match="reduction"):
        step.scale(torch.ones(()), "max")  # type: ignore[arg-type]


def test_count_samples_reads_the_first_dimension() -> None:
    x = torch.zeros(5, 3)
    assert count_samples(x) == 5
    assert count_samples((x, torch.zeros(5))) == 5
    assert count_samples({"input_ids": x}) == 5
    assert count_samples([[x]]) == 5


def test_the_readme_example_runs_and_learns() -> None:
    example = ROOT / "examples" / "accumulate_loop.py"
    namespace = runpy.run_path(str(example))
    losses = namespace["losses"]
    assert len(losses) == 20
    assert losses[-1] < 0.05 * losses[0]

    # The README shows the example file itself, so what readers copy is what runs here: the block
    # after the sentence naming it (the section's first block is the saved plan's script).
    text = section("README.md", "Using the plan in your training loop").split("`examples/accumulate_loop.py`", 1)[1]
    block = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert block is not None
    source = example.read_text(encoding="utf-8")
    assert block.group(1) in source
    assert "for step in accumulate(loader, plan):" in block.group(1)
