"""Probe a job's own objects, with no module to import: its model, its optimizer instance (fused,
per-group weight decay), its Dataset and collate function. The autotune lines are the ones the
docs/frameworks.md shows."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune import Workload, probe_workload

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
optimizer = torch.optim.AdamW(
    [{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[2].parameters(), "weight_decay": 0.0}],
    lr=3e-4,
)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


loader = DataLoader(dataset, batch_size=32)
workload = Workload.from_model(model, optimizer=optimizer, batch=loader, loss=loss_fn)
result = probe_workload(workload, effective_batch=4096)
print(result.max_micro_batch, result.plan.micro_batches[:2], result.workload.input_spec["worst_samples"])
