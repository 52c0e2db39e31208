"""A Lightning job for the tests: a small CNN with BatchNorm on synthetic images.

Imported by tests/test_integration_lightning.py, and run as a script for the 2-process DDP test:
`python tests/lightning_job.py OUT_DIR` starts rank 0, Lightning's launcher starts rank 1 by running
this script again, and each rank writes the values it trains with to OUT_DIR/rank<N>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

MEMORY = 3 * 2**20
EFFECTIVE_BATCH = 48
IMAGE = 16


class Images(Dataset[tuple[torch.Tensor, int]]):
    """Images made when asked, so that only batches count on the budget device."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, IMAGE, IMAGE, generator=generator), index % 10


class Net(pl.LightningModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 10),
        )
        self.steps_run = 0

    def train_dataloader(self) -> DataLoader[Any]:
        # shuffle=False: a RandomSampler would put a randperm of the dataset on the budget device.
        return DataLoader(Images(), batch_size=self.batch_size, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps_run += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(root: Path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **kwargs,
    )


def main(out: Path) -> None:
    from autotune.integrations.lightning import AutotuneBatchSize

    tuner = AutotuneBatchSize(effective_batch=EFFECTIVE_BATCH, memory=MEMORY, headroom=0)
    job = trainer(out, strategy="ddp", devices=2, max_steps=2, callbacks=[tuner])
    module = Net()
    job.fit(module)
    values = {
        "rank": job.global_rank,
        "batch_size": module.batch_size,
        "accumulate_grad_batches": job.accumulate_grad_batches,
        "probed": tuner.result is not None,
        "steps": job.global_step,
    }
    (out / f"rank{job.global_rank}.json").write_text(json.dumps(values))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
