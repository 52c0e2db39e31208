"""Workloads of live objects (`Workload.from_model`) probed in this process with `probe_workload`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autotune import Workload, probe_workload
from autotune.errors import ConfigError, NotAnOOMError, WorkloadError

MEMORY = "1MiB"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 4))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Variable-length rows; sample 3 is the longest."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.ones(40 if i == 3 else 4 + i, 32), "y": torch.tensor(i % 4)}


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        "x": nn.utils.rnn.pad_sequence([s["x"] for s in samples], batch_first=True),
        "y": torch.stack([s["y"] for s in samples]),
    }


def sequence_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]).mean(1), batch["y"])


ONE_BATCH = (torch.randn(8, 32), torch.randint(0, 4, (8,)))


def test_an_optimizer_instance_is_copied_with_its_groups_and_never_stepped() -> None:
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[2].parameters(), "lr": 0.5}],
        lr=1e-3,
        fused=True,
    )
    workload = Workload.from_model(model, optimizer=optimizer, batch=ONE_BATCH, loss=loss_fn)
    copy = workload.make_optimizer(model.parameters())
    assert type(copy) is torch.optim.AdamW and copy is not optimizer
    assert [g["weight_decay"] for g in copy.param_groups] == [0.1, 0.01]
    assert [g["lr"] for g in copy.param_groups] == [1e-3, 0.5]
    assert all(g["fused"] for g in copy.param_groups)
    assert [len(g["params"]) for g in copy.param_groups] == [2, 2]

    result = probe_workload(workload, memory=MEMORY, headroom=0)
    assert result.workload.optimizer == "AdamW"
    assert optimizer.state == {}  # the job's optimizer never ran
    for p, saved in zip(model.parameters(), before, strict=True):  # the job's model is given back as it was
        assert torch.equal(p, saved) and p.grad is None


def test_the_optimizer_class_decides_the_answer() -> None:
    """SGD without momentum keeps no state: more room for the batch than AdamW's two moments."""
    answers = {}
    for make in (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda m: torch.optim.AdamW):
        model = mlp()
        workload = Workload.from_model(model, optimizer=make(model), batch=ONE_BATCH, loss=loss_fn)
        answers[workload.optimizer_name] = probe_workload(workload, memory=MEMORY, headroom=0).max_micro_batch
    assert answers["SGD"] > answers["AdamW"]


def test_an_optimizer_of_other_parameters_is_refused() -> None:
    with pytest.raises(WorkloadError, match="parameter\\(s\\) that are not the model's"):
        Workload.from_model(mlp(), optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1), batch=ONE_BATCH)


@pytest.mark.parametrize("given", ["dataset", "loader"])
def test_a_dataset_or_loader_gives_the_longest_sample_through_its_collate(given: str) -> None:
    data: Any = Sequences() if given == "dataset" else DataLoader(Sequences(), batch_size=2, collate_fn=pad)
    workload = Workload.from_model(
        mlp(), batch=data, collate=pad if given == "dataset" else None, loss=sequence_loss, optimizer=torch.optim.SGD,
        optimizer_kwargs={"lr": 0.1},
    )  # fmt: skip
    batch = workload.make_batch(5, torch.device("cpu"))
    assert batch["x"].shape == (5, 40, 32)
    result = probe_workload(workload, memory=MEMORY, headroom=0)
    assert result.workload.input_spec["worst_samples"] == "3"
    assert result.workload.input_spec["x"] == "1x40x32"
    assert result.confirmation is not None and result.confirmation.status == "skipped"
    assert "live objects" in result.confirmation.note


def test_one_batch_is_repeated_to_any_size() -> None:
    workload = Workload.from_model(mlp(), batch=ONE_BATCH, loss=loss_fn, optimizer=lambda ps: torch.optim.SGD(ps))
    x, y = workload.make_batch(20, torch.device("cpu"))
    assert x.shape == (20, 32) and torch.equal(x[8:16], ONE_BATCH[0]) and y.shape == (20,)
    assert workload.optimizer_name == "<lambda>"


class WithLoss(nn.Module):
    """A model that returns its loss when given labels, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.body(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SimpleNamespace(loss=loss, logits=logits)


def test_the_default_loss_is_the_models_own() -> None:
    batch = {"x": torch.randn(4, 32), "labels": torch.randint(0, 4, (4,))}
    result = probe_workload(Workload.from_model(WithLoss(), batch=batch), memory=MEMORY, headroom=0)
    assert result.max_micro_batch >= 1
    with pytest.raises(NotAnOOMError, match="has no loss: give the batch its labels, or pass loss="):
        probe_workload(Workload.from_model(WithLoss(), batch={"x": torch.randn(4, 32)}), memory=MEMORY)


def test_a_model_that_is_not_a_module_is_refused() -> None:
    with pytest.raises(WorkloadError, match=r"model must be a torch\.nn\.Module"):
        Workload.from_model(object(), batch=ONE_BATCH)  # type: ignore[arg-type]


def test_the_model_comes_back_in_its_mode_and_the_applications_gc_freeze_stays() -> None:
    import gc

    model = mlp().eval()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        probe_workload(Workload.from_model(model, batch=ONE_BATCH, loss=loss_fn), memory=MEMORY, headroom=0)
        # The probe did not thaw what the application froze (a thaw empties the permanent generation;
        # a frozen object that its last reference lets go of leaves it meanwhile, so not ==).
        assert gc.get_freeze_count() > frozen - 1000
    finally:
        gc.unfreeze()
    assert not model.training


def test_a_batch_the_model_does_not_take_says_to_pass_loss() -> None:
    with pytest.raises(NotAnOOMError, match="pass loss=lambda model, batch"):
        probe_workload(Workload.from_model(mlp(), batch={"x": torch.randn(4, 32)}), memory=MEMORY)


def test_a_wrapped_optimizer_is_copied_from_the_one_it_wraps() -> None:
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapper = SimpleNamespace(optimizer=inner)  # Accelerate's and Lightning's wrappers hold it so
    workload = Workload.from_model(model, optimizer=wrapper, batch=ONE_BATCH, loss=loss_fn)  # type: ignore[arg-type]
    copy = workload.make_optimizer(model.parameters())
    assert type(copy) is torch.optim.SGD and copy.param_groups[0]["momentum"] == 0.9


def test_a_parallel_probe_of_live_objects_leaves_the_job_free_to_make_its_group() -> None:
    """DDP: the job's process has no process group after the probe (its own init_process_group
    would fail twice-initialised), and its model computes as before. FSDP would shard the job's own
    model in place: refused, naming what to probe instead."""
    import torch.distributed as dist

    model = mlp()
    x = torch.randn(4, 32)
    before = model(x).detach()
    workload = Workload.from_model(model, batch=ONE_BATCH, loss=loss_fn)
    result = probe_workload(workload, memory=MEMORY, headroom=0, parallel="ddp")
    assert result.workload.parallel.strategy == "ddp" and result.max_micro_batch >= 1
    assert not dist.is_initialized()
    assert type(model) is nn.Sequential and torch.equal(model(x), before)
    with pytest.raises(ConfigError, match="parallel='fsdp' shards the model in place"):
        probe_workload(workload, memory=MEMORY, headroom=0, parallel="fsdp", world_size=2)
    assert not dist.is_initialized() and torch.equal(model(x), before)
    # A workload that builds its model may be sharded: the group is gone afterwards too.
    built = Workload(name="built", build_model=mlp, make_batch=lambda b, device: (torch.randn(b, 32, device=device),
                     torch.randint(0, 4, (b,), device=device)), loss=loss_fn)  # fmt: skip
    sharded = probe_workload(built, memory=MEMORY, headroom=0, parallel="fsdp", world_size=2)
    assert sharded.workload.parallel.world_size == 2 and not dist.is_initialized()
