"""Record, on a GPU, the caching allocator's whole history of one loop at one size, in a fresh process
each: bench/cuda_truth.py's plain loop (the batch and loss freed before the optimizer step) or
autotune's trial runner (the loop a confirmation runs), so that two loops that part at the limit
(one fits, the other runs out) can be compared allocation by allocation on the CPU.

    PYTHONPATH=. python bench/trace_loops.py --memory 2GiB --batch 137 --loop plain --steps 20 --out F.pkl.gz

The file is a gzipped pickle (bench/record_cuda_trace.py's `save` and `load`): the loop, the size,
whether it fitted (else the optimizer step and the message), and `torch.cuda.memory._snapshot()`
taken at the end (its trace holds every allocation, free and segment from the model's build on, and
the 'oom' entry where it ran out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The bench scripts beside this one (the plain loop, the recording's file format), also when a test
# loads this file by its path.
sys.path.insert(0, str(ROOT / "bench"))
from record_cuda_trace import load, save  # noqa: E402

__all__ = ["load", "run", "save"]


def run(loop: str, memory: int, batch: int, micro_steps: int, steps: int) -> dict[str, Any]:
    import torch

    torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=1 << 21)
    if loop == "plain":
        import cuda_truth

        row = cuda_truth.plain_loop(
            {
                "target": "gpt",
                "options": {},
                "device": "cuda:0",
                "limit_bytes": memory,
                "batch": batch,
                "micro_steps": micro_steps,
                "steps": steps,
            }
        )
    else:
        from autotune.devices.cuda import CudaDevice
        from autotune.engine.trial import TrialRunner
        from autotune.results import LoopShape
        from autotune.workloads.targets import resolve

        runner = TrialRunner(resolve("gpt"), CudaDevice(0, memory), max_steps=steps)
        record = runner.run(batch, LoopShape(micro_steps=micro_steps, steps=steps))
        row = {"fits": record.fits, "steps": runner.steps_run, "message": record.oom_message}
    return {"loop": loop, "batch": batch, "micro_steps": micro_steps, **row, "snapshot": torch.cuda.memory._snapshot()}


def main() -> None:
    from autotune.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", choices=("plain", "trial"), required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--micro-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    document = run(args.loop, parse_size(args.memory), args.batch, args.micro_steps, args.steps)
    save(args.out, document)
    print({k: v for k, v in document.items() if k != "snapshot"})


if __name__ == "__main__":
    main()
