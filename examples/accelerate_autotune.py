"""A plain Accelerate loop whose micro-batch and accumulation come from autotune. Without a GPU the
probe runs on the CPU budget device (AUTOTUNE_CPU_MEMORY bytes). The autotune lines are the ones the
docs/frameworks.md shows."""

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune.integrations.accelerate import tune_accelerator

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accelerator = Accelerator()


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


plan = tune_accelerator(accelerator, model, optimizer, dataset, effective_batch=1024, loss=loss_fn).plan
loader = DataLoader(dataset, batch_size=plan.micro_batch, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

steps = 0
for batch in loader:
    with accelerator.accumulate(model):
        accelerator.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    steps += accelerator.sync_gradients
print(plan.micro_batch, accelerator.gradient_accumulation_steps, steps)
