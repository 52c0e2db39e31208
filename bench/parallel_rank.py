"""One rank of a real multi-process job on CPU (gloo): the truth for the one-device simulation.

    python bench/parallel_rank.py JOB_JSON RANK PORT

Joins a gloo group of the job's world size on 127.0.0.1 and, for each micro-batch of the job in
turn, builds the workload on a budget device of its own at the probe's limit, wraps it as
autotune.parallel does (FSDP2 over the real group's mesh with the workload's own sharding function
or ours, or DDP), runs the probe's loop at that micro-batch, and prints {"rank", "batch", "fits",
"peak", "message"} on a line. Every rank builds the same model from the same seed and the same
batch shapes, so ranks run out of memory at the same allocation, before the next collective: none
is left waiting (the caller has a timeout too). One group serves every size (starting N
interpreters that import torch is most of a small job's cost); a size that runs out of memory
should come last, as `bench/parallel.py` orders them: after it, the next size's model is built
with whatever the failed step left to the collector.

JOB_JSON: {"request": ProbeRequest fields, "strategy": "ddp"|"fsdp", "world_size", "total_bytes",
"limit_bytes", "batches", "micro_steps", "reshard_after_forward"}. `bench/parallel.py` writes it
(`real_jobs`), for the benchmark and for tests/test_parallel.py.
"""

from __future__ import annotations

import gc
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    rank, port = int(sys.argv[2]), int(sys.argv[3])
    world = job["world_size"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from autotune.devices.budget import BudgetDevice
    from autotune.engine.probe import ProbeRequest, load_workload
    from autotune.engine.trial import TrialRunner
    from autotune.parallel.fsdp import shard
    from autotune.results import LoopShape

    request = ProbeRequest.model_validate(job["request"])
    workload = load_workload(request.model_copy(update={"parallel": "none", "world_size": 1}))
    for batch in job["batches"]:
        device = BudgetDevice(job["total_bytes"], job["limit_bytes"])
        torch.manual_seed(0)
        with device.active():
            model = workload.build_model()
            if job["strategy"] == "fsdp":
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (world,))
                if workload.shard is not None:
                    workload.shard(model, mesh)
                else:
                    shard(model, mesh, reshard_after_forward=job.get("reshard_after_forward", True))
            else:
                from torch.nn.parallel import DistributedDataParallel

                model = DistributedDataParallel(model)
        runner = TrialRunner(workload, device, steps=request.steps, model=model)
        record = runner.run(batch, LoopShape(micro_steps=job["micro_steps"], steps=request.steps))
        line = {"rank": rank, "batch": batch, "fits": record.fits, "peak": record.peak_allocated_bytes}
        print(json.dumps({**line, "message": record.oom_message}))
        sys.stdout.flush()
        # The next size starts from nothing of this one: its model, buffers and DDP's reducer go
        # before any rank builds again.
        del runner, model
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
