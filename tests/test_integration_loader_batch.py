"""The batch the job's loader really yields (issue 36, item 3): after the plan, Lightning's train
dataloader is built again and Accelerate's given loader read once, on the host, and the first batch's
size is compared with the plan's micro-batch. Before, a Lightning loader that wrote in batch_size=16
(the module's attribute was 16 too) ran micro-batches of 16 where the plan said 32 (128 samples a
step for 64), and an Accelerate loader with a custom batch_sampler ran 12 samples a step where the
plan said 48, both without a word.

Each test runs the framework's own loop and counts the samples of every optimizer step: the job
either runs exactly the effective batch reported, or is refused, before its first step, with a fix
that the test then follows."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from autotune.errors import ConfigError

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]


class Chunks(Sampler[list[int]]):
    """A custom batch sampler: consecutive indices in batches of `size`, with no batch_size attribute."""

    def __init__(self, length: int, size: int) -> None:
        self.length, self.size = length, size

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, self.length, self.size):
            yield list(range(start, min(start + self.size, self.length)))

    def __len__(self) -> int:
        return -(-self.length // self.size)


# Lightning --------------------------------------------------------------------------------------
def _lightning_module(loader: str) -> Any:
    pytest.importorskip("lightning.pytorch")
    from tests import lightning_job

    class Counted(lightning_job.Net):
        """The tests' CNN with a train dataloader of the kind named, counting the samples it trains on."""

        def __init__(self) -> None:
            super().__init__(batch_size=16)
            self.seen: list[int] = []

        def train_dataloader(self) -> DataLoader[Any]:
            data = lightning_job.Images()
            if loader in ("batch_size=16", "fit(train_dataloaders=...)"):
                return DataLoader(data, batch_size=16)
            if loader == "batch_size=self.batch_size":
                return DataLoader(data, batch_size=self.batch_size)
            if loader == "Chunks(16)":
                return DataLoader(data, batch_sampler=Chunks(len(data), 16))
            assert loader == "Chunks(self.batch_size)"
            return DataLoader(data, batch_sampler=Chunks(len(data), self.batch_size))

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.seen.append(len(batch[0]))

    return Counted()


def _fit(root: Path, module: Any, loader: DataLoader[Any] | None = None) -> tuple[Any, Any]:
    from autotune.integrations.lightning import AutotuneBatchSize
    from tests import lightning_job

    # The job: 16 x 4 = 64 a step; at this budget the plan is 32 x 2.
    tuner = AutotuneBatchSize(memory=lightning_job.MEMORY, headroom=0)
    trainer = lightning_job.trainer(root, max_steps=2, accumulate_grad_batches=4, callbacks=[tuner])
    gc.freeze()
    try:
        trainer.fit(module, train_dataloaders=loader)
    finally:
        gc.unfreeze()
    return tuner, trainer


@pytest.mark.parametrize(
    ("loader", "fix"),
    [
        ("batch_size=16", r"build it with batch_size=self\.batch_size"),
        (
            "Chunks(16)",
            r"its batch_sampler \(Chunks\) makes batches of 16 .*build the batch_sampler from self\.batch_size",
        ),
        (
            "fit(train_dataloaders=...)",
            r"given to fit\(\) as an object, .*train_dataloader\(\), built with batch_size=",
        ),
    ],
)
def test_lightning_a_loader_that_keeps_its_batch_size_is_refused_before_the_fit(
    tmp_path: Path, loader: str, fix: str
) -> None:
    """The loader makes 16, the attribute was 16: only the loader built again after the plan tells."""
    module = _lightning_module(loader)
    given = module.train_dataloader() if loader.startswith("fit(") else None
    with pytest.raises(
        ConfigError, match=r"yields batches of 16: Lightning would run 16 x 2 x 1 = 32 .*not 64; .*" + fix
    ):
        _fit(tmp_path, module, given)
    assert module.seen == []  # refused before the first step
    assert module.batch_size == 16  # and the job as it was configured


@pytest.mark.parametrize("loader", ["batch_size=self.batch_size", "Chunks(self.batch_size)"])
def test_lightning_a_loader_that_reads_the_attribute_runs_the_effective_batch_reported(
    tmp_path: Path, loader: str
) -> None:
    """The fixes the refusals name: each optimizer step is the plan's micro-batches, 64 samples."""
    module = _lightning_module(loader)
    tuner, trainer = _fit(tmp_path, module)
    tuned = tuner.result.framework.tuned
    assert tuned.micro_batch != 16 and tuned.effective_batch == 64, tuned  # the plan changed the loader's batch
    assert trainer.global_step == 2
    assert module.seen == [tuned.micro_batch] * (2 * tuned.accumulation_steps)
    assert sum(module.seen) == 2 * 64


# Accelerate (the `accelerate` fixture: tests/conftest.py) ----------------------------------------


def _samples_per_step(accelerator: Any, model: Any, loader: DataLoader[Any], steps: int) -> list[int]:
    """Accelerate's own loop over `loader`: the samples of each optimizer step."""
    from tests.test_integration_accelerate import mse

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counted, samples = [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(mse(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        samples += len(batch[0])
        if accelerator.sync_gradients:
            counted.append(samples)
            samples = 0
            if len(counted) == steps:
                break
    return counted


@pytest.mark.parametrize("effective_batch", [48, None])
def test_accelerate_a_batch_sampler_loader_is_refused_and_its_fix_runs_the_effective_batch(
    accelerate: Any, effective_batch: int | None
) -> None:
    """12 a batch x 4 steps; the plan for 48 (asked, or the job's own: the first batch is counted,
    the sampler has no batch_size) is one micro-batch of 48, which the sampler cannot make."""
    from autotune.integrations.accelerate import tune_accelerator
    from tests.test_integration_accelerate import MEMORY, Rows, mlp, mse

    data = Rows(512)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_sampler=Chunks(len(data), 12))
    with pytest.raises(
        ConfigError,
        match=r"yields batches of 12 from its batch_sampler \(Chunks\), and the plan for the effective batch 48 runs "
        r"micro-batches of 48 x 1 accumulation step: .* would run 12 x 1 = 12 samples a step .* instead of 48.*"
        r"batch_sampler=result\.plan\.sampler\(len\(dataset\)\)",
    ):
        tune_accelerator(accelerator, model, optimizer, loader, effective_batch, loss=mse, memory=MEMORY, headroom=0)
    assert accelerator.gradient_accumulation_steps == 4  # nothing set

    # The fix the refusal names: tune with the Dataset, give the loader the plan's sampler.
    result = tune_accelerator(accelerator, model, optimizer, data, 48, loss=mse, memory=MEMORY, headroom=0)
    fixed = DataLoader(data, batch_sampler=result.plan.sampler(len(data)))
    assert _samples_per_step(accelerator, model, fixed, steps=3) == [48, 48, 48]


def test_accelerate_a_batch_sampler_of_the_plans_size_runs_as_it_is(accelerate: Any) -> None:
    from autotune.integrations.accelerate import tune_accelerator
    from tests.test_integration_accelerate import MEMORY, Rows, mlp, mse

    data = Rows(512)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = mlp()
    loader = DataLoader(data, batch_sampler=Chunks(len(data), 48))
    result = tune_accelerator(
        accelerator, model, torch.optim.SGD(model.parameters(), lr=0.01), loader, 48, loss=mse, memory=MEMORY,
        headroom=0,
    )  # fmt: skip
    assert result.plan.micro_batches == [48] and not [w for w in result.plan.warnings if "DataLoader" in w]
    assert _samples_per_step(accelerator, model, loader, steps=3) == [48, 48, 48]


# The Trainer ------------------------------------------------------------------------------------
def test_trainer_a_loader_that_keeps_its_batch_size_is_refused_before_the_probe(tmp_path: Path) -> None:
    """get_train_dataloader writes in 8, per_device_train_batch_size is 8: comparing at 8 cannot tell,
    and every trial ran batches of 8 (the probe failed: memory did not grow with the batch)."""
    transformers = pytest.importorskip("transformers")
    from autotune.integrations.transformers import tune_trainer
    from tests.test_integration_transformers import MEMORY, collate, examples, make_trainer

    class FixedBatches(transformers.Trainer):
        def get_train_dataloader(self) -> Any:
            return DataLoader(self.train_dataset, batch_size=8, collate_fn=collate)

    transformers.logging.set_verbosity_error()
    base = make_trainer(tmp_path, examples(16), per_device_train_batch_size=8, gradient_accumulation_steps=6)
    trainer = FixedBatches(model=base.model, args=base.args, train_dataset=base.train_dataset, data_collator=collate)
    seen: list[Any] = []
    with pytest.raises(
        ConfigError,
        match=r"makes batches of 8 with per_device_train_batch_size=9 as with 8: it ignores the argument.*"
        r"build it with self\._train_batch_size",
    ):
        tune_trainer(trainer, memory=MEMORY, headroom=0, on_trial=seen.append)
    assert seen == []  # before the first trial
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 6)
