"""Run a plan as a user's training loop would, in its own process: `python -m tests.plan_run JOB.json ...`.

Each optimizer step runs the plan's micro-batches in order (fresh inputs each; the previous ones
are dropped when the next are made, so the last micro-batch is alive during the optimizer step, as
the loop variable of `for batch in loader` is), every loss multiplied by its plan weight, then
`optimizer.step()` and
`zero_grad(set_to_none=True)`, on a budget device of the given size and limit. Prints one JSON
line a job: whether it fitted, the peak, and the OOM message. Several jobs run in turn, each with a
budget device and a model of its own (a fresh allocator's start: the budget device keeps no cache),
so one interpreter's imports serve them all.
"""

from __future__ import annotations

import json
import sys

import torch

from autotune.devices.budget import BudgetDevice
from autotune.workloads.targets import resolve


def run(job: dict) -> dict:  # type: ignore[type-arg]
    device = BudgetDevice(job["total_bytes"], job["limit_bytes"])
    workload = resolve(job["target"], job.get("options", {}))
    model = workload.build_model()
    device.track([*model.parameters(), *model.buffers()])
    try:
        with device.active():
            optimizer = workload.make_optimizer(model.parameters())
            for _ in range(job["steps"]):
                for size, weight in zip(job["micro_batches"], job["loss_weights"], strict=True):
                    batch = None
                    batch = workload.make_batch(size, device.torch_device)
                    (workload.loss(model, batch) * weight).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError as exc:
        return {"fits": False, "peak": device.peak_allocated_bytes(), "message": str(exc)}
    return {"fits": True, "peak": device.peak_allocated_bytes(), "message": None}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as handle:
            print(json.dumps(run(json.load(handle))), flush=True)
