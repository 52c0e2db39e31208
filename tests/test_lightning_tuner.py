"""Lightning's own batch-size finder, unpatched, on the budget device: it agrees with autotune.

`Tuner(trainer).scale_batch_size(mode="binsearch", margin=0)` runs Lightning's real fit loop
(training_step, zero_grad, backward, optimizer step, 3 steps per trial) on the CPU budget device
and catches the device's `torch.OutOfMemoryError` as it would catch CUDA's. The largest size it
saw fit and the size it returns must equal autotune's exact answer for the same model, loss,
optimizer and limit.

What Lightning's loop holds beyond autotune's trial (measured below, to the byte):
- With a sized DataLoader (a map-style dataset with `__len__`) Lightning prefetches nothing:
  `_PrefetchDataFetcher` ignores `prefetch_batches` when the loader's length is known, so only the
  current batch is alive during a step, as in a trial (prefetch=0).
- Lightning keeps `loss.detach().clone()` (`ClosureResult.loss`) from the end of forward through the
  step: one 4-byte tensor, 512 bytes once rounded as CUDA's allocator rounds. The answers agree as
  long as autotune's peak at its answer is at least 512 bytes under the limit (checked below).
- Lightning zeroes gradients after forward, not before (and keeps its optimizer, state and last
  gradients from one trial to the next): forward runs with a full set of gradients alive. That
  does not move this model's peak, which is in backward, after the zeroing.
- With an unsized loader (an `IterableDataset`) the fetcher holds the next batch while a step runs:
  exactly one batch more (prefetch=1), on the budget device. On a GPU that batch is the
  DataLoader's host output (`batch_to_device` runs just before the step), so it costs no GPU memory.
  The tuner itself cannot run an unsized loader here: after the first OOM it builds the next
  trial's loader, which prefetches a batch, inside its `except` block, while the traceback still
  holds the failed step's tensors and the old fetcher its prefetched batch, and that OOM escapes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autotune.devices.budget import BudgetDevice, rounded
from autotune.engine.search import search
from autotune.engine.trial import TrialRunner
from autotune.workloads import examples

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.tuner import Tuner  # noqa: E402

IN_FEATURES, HIDDEN, LAYERS, CLASSES = 256, 256, 2, 16
WORKLOAD = examples.mlp(in_features=IN_FEATURES, hidden=HIDDEN, layers=LAYERS, classes=CLASSES, optimizer="adamw")
LIMIT = 6 * 2**20  # autotune's answer: 746 samples
STEPS = 3  # Lightning's default steps_per_trial
INIT = 2
# The 4-byte detached clone of the loss that Lightning keeps during every step.
LIGHTNING_LOSS_COPY = rounded(4)

# Lightning's CPU-training advice (num_workers, on machines with more than 2 cores) and its use of
# torch's deprecated pytree LeafSpec: not what is tested here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]


@pytest.fixture(autouse=True)
def _quick() -> Iterator[None]:
    """Speed only, no effect on memory. Lightning runs a full gc.collect() before every trial and
    after every OOM (0.2 s each with pytest's objects): freezing what exists now leaves it only the
    trials' objects to walk. One intra-op thread: the ops are tiny, and a second thread competing
    with other processes for a 2-core machine made them 5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def _sample(index: int) -> tuple[torch.Tensor, int]:
    """One sample, made when asked: a dataset in one big tensor would count whole on the device
    the first time it is indexed; this way only the batches count. Shapes match WORKLOAD's batch
    (float32 features, int64 targets after collation)."""
    return torch.full((IN_FEATURES,), (index % 7) / 7.0), index % CLASSES


class _Samples(Dataset[tuple[torch.Tensor, int]]):
    """Sized: Lightning knows the loader's length and prefetches nothing."""

    def __len__(self) -> int:
        return 1 << 20  # far more than any trial reads: the tuner stops growing at the length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return _sample(index)


class _Stream(IterableDataset[tuple[torch.Tensor, int]]):
    """Unsized: Lightning's fetcher holds the next batch while a step runs."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        index = 0
        while True:
            yield _sample(index)
            index += 1


class _Module(pl.LightningModule):
    """WORKLOAD as a LightningModule: the same model, loss and optimizer."""

    def __init__(self, batch_size: int, dataset: type[Dataset[Any]] = _Samples) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.dataset = dataset
        self.model = WORKLOAD.build_model()
        self.started: list[tuple[int, int]] = []  # (batch size, batch index)
        self.finished: list[tuple[int, int]] = []

    def train_dataloader(self) -> DataLoader[Any]:
        # shuffle=False: a RandomSampler would put a randperm of the dataset's length on the device.
        return DataLoader(self.dataset(), batch_size=self.batch_size, shuffle=False, num_workers=0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return WORKLOAD.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return WORKLOAD.make_optimizer(self.model.parameters())

    # The tuner replaces trainer.callbacks with [] during its trials: the module's own hooks record.
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.started.append((len(batch[0]), batch_idx))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.finished.append((len(batch[0]), batch_idx))


def _trainer(root: Path, **kwargs: Any) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kwargs,
    )


def _autotune(limit: int) -> tuple[int, TrialRunner]:
    runner = TrialRunner(WORKLOAD, BudgetDevice(limit), steps=STEPS)
    return search(runner, limit_bytes=limit).max_micro_batch, runner


def _lightning_peak(batch: int, dataset: type[Dataset[Any]], root: Path) -> int:
    """Peak live bytes of a plain `trainer.fit` of STEPS steps at `batch`, without a limit."""
    module = _Module(batch, dataset)
    device = BudgetDevice(2**40)
    device.track([*module.parameters(), *module.buffers()])
    trainer = _trainer(root, max_steps=STEPS)
    with device.active():
        trainer.fit(module)
    assert module.finished == [(batch, i) for i in range(STEPS)]
    return device.peak_allocated_bytes()


def _trial_peak(batch: int) -> int:
    record = TrialRunner(WORKLOAD, BudgetDevice(2**40), steps=STEPS)(batch)
    assert record.fits and record.peak_allocated_bytes is not None
    return record.peak_allocated_bytes


def test_lightning_binsearch_finds_autotunes_answer(tmp_path: Path) -> None:
    expected, runner = _autotune(LIMIT)
    # Lightning's step holds 512 B more than the trial: equality needs that much room at the answer.
    at_answer = runner(expected).peak_allocated_bytes
    assert at_answer is not None and LIMIT - at_answer >= LIGHTNING_LOSS_COPY, (
        f"the limit is within {LIGHTNING_LOSS_COPY} B of autotune's peak at {expected} ({at_answer} B): "
        "Lightning would rightly find one less; choose another limit"
    )

    module = _Module(batch_size=INIT)  # the first trial runs the module's own size, not init_val
    device = BudgetDevice(LIMIT)
    device.track([*module.parameters(), *module.buffers()])
    trainer = _trainer(tmp_path)
    with device.active():
        returned = Tuner(trainer).scale_batch_size(
            module, mode="binsearch", steps_per_trial=STEPS, init_val=INIT, margin=0
        )

    completed = {size for size, index in module.finished if index == STEPS - 1}
    failed = {size for size, _ in module.started} - completed
    assert completed and failed, "Lightning never ran out of memory: the limit is too high"
    largest_fit = max(completed)
    assert (expected, largest_fit, returned) == (expected, expected, expected), (
        f"autotune {expected}, Lightning saw {largest_fit} fit and returned {returned}; "
        f"fitted {sorted(completed)}, failed {sorted(failed)}"
    )
    assert expected + 1 in failed  # Lightning too showed that one more does not fit
    assert min(failed) > largest_fit  # nothing below the answer failed in Lightning
    assert module.batch_size == expected  # Lightning left its answer on the module


def test_a_lightning_step_holds_only_the_loss_copy_more_than_a_trial(tmp_path: Path) -> None:
    """Sized loader: no prefetched batch; the one difference is Lightning's detached loss."""
    batch = 746
    assert _lightning_peak(batch, _Samples, tmp_path) - _trial_peak(batch) == LIGHTNING_LOSS_COPY


def test_an_unsized_loader_holds_one_batch_more(tmp_path: Path) -> None:
    """IterableDataset: Lightning's fetcher holds the next batch during the step (prefetch=1)."""
    batch = 746
    one_batch = rounded(batch * IN_FEATURES * 4) + rounded(batch * 8)  # float32 features, int64 targets
    extra = _lightning_peak(batch, _Stream, tmp_path) - _trial_peak(batch)
    assert extra == one_batch + LIGHTNING_LOSS_COPY
