"""A LightningModule (a small CNN with BatchNorm) tuned at fit start by autotune's callback. Without a
GPU the probe runs on the CPU budget device (AUTOTUNE_CPU_MEMORY bytes). The autotune lines are the
ones docs/frameworks.md shows."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune.integrations.lightning import AutotuneBatchSize


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8  # 8 x 32 accumulation steps = 256 a step; autotune sets it
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 10),
        )  # fmt: skip
        self.data = TensorDataset(torch.randn(1024, 3, 16, 16), torch.randint(0, 10, (1024,)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


module = Classifier()
tuner = AutotuneBatchSize()  # L.Trainer(..., callbacks=[tuner]): keeps batch_size x accumulate_grad_batches
trainer = L.Trainer(
    max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    accumulate_grad_batches=32, callbacks=[tuner],
)  # fmt: skip
trainer.fit(module)

print(module.batch_size, trainer.accumulate_grad_batches, trainer.global_step)
