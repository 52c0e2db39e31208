"""Accumulation that survives an out-of-memory error mid-run (docs/accumulation.md shows this file).

A budget device of 640 KiB stands in for a GPU that a long sequence or fragmentation fills: the
window of micro-batches of 64 runs out of memory, the guard redoes it with micro-batches of 32,
and the optimizer still sees the gradient of the whole window's mean loss.
tests/test_oom_guard.py runs it.
"""

import torch
from torch import nn

import autotune
from autotune import OOMGuard
from autotune.devices.budget import BudgetDevice

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 1024), nn.GELU(), nn.Linear(1024, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = [(torch.randn(64, 16), torch.randn(64, 1)) for _ in range(8)]
device = BudgetDevice(640 << 10)  # on a GPU: nothing of this, the card is the limit
device.track([*model.parameters(), *(t for batch in data for t in batch)])

plan = autotune.plan(effective_batch=256, max_micro_batch=64)  # 4 micro-steps of 64
guard = OOMGuard(model, on_shrink=lambda e: print(f"window {e.window}: {e.old_micro_batch} -> {e.new_micro_batch}"))
with device.active():
    for window in guard.windows(data, plan):
        window.run(lambda step: step.scale(nn.functional.mse_loss(model(step.batch[0]), step.batch[1])).backward())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
print(f"micro-batches now at most {guard.micro_batch_limit}")
