"""Gradient accumulation in a plain PyTorch loop with autotune's helper (the README shows this file).

tests/test_accumulate.py runs it and checks that the loss falls.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune import accumulate

torch.manual_seed(0)
inputs = torch.randn(100, 8)
targets = inputs @ torch.randn(8, 1) + 0.1 * torch.randn(100, 1)

# Effective batch 32 with at most 12 samples per micro-batch: policy exact gives 4 steps of 8.
plan = autotune.plan(effective_batch=32, max_micro_batch=12, policy="exact")
loader = DataLoader(TensorDataset(inputs, targets), batch_size=plan.micro_batch, shuffle=True)
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = nn.MSELoss()  # the mean over the micro-batch's samples

losses = []
for _epoch in range(20):
    # 100 samples per epoch: windows of 32, 32 and 32 samples, then a short one of 4.
    for step in accumulate(loader, plan):
        x, y = step.batch
        with step.sync_context(model):  # model.no_sync() under DDP, except on the window's last micro-step
            loss = loss_fn(model(x), y)
            step.scale(loss).backward()  # loss × samples in this micro-batch / samples in the window
        if step.should_step:
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        losses.append(loss_fn(model(inputs), targets).item())
print(f"loss after epoch 1: {losses[0]:.4f}, after epoch {len(losses)}: {losses[-1]:.4f}")
