"""What the allocator model's streams change: each case probed with the stream model and with every
allocation on one stream (the model before streams), side by side.

    .venv/bin/python bench/streams.py [--json bench/results/streams.json]

Each case is `autotune probe TARGET --device cpu --memory M --headroom 0 --parallel P --json` with
AUTOTUNE_ALLOCATOR=cuda, run twice as a user runs it (a new process each): with
AUTOTUNE_ALLOCATOR_STREAMS=model (the default: a pool per stream, record_stream's waits to the end
of the optimizer step) and =one. The cases: the `gpt` example under DDP (one stream: its buckets'
allreduces record nothing) and under FSDP2 over 2 and 4 ranks (its all-gather, copy-in and
reduce-scatter buffers are allocated on FSDP's own streams: `torch.cpu.stream` on the budget
device, as `torch.cuda.stream` on a GPU), and tests/stream_workloads.py's `prefetched` MLP under
DDP (its batches made on a side stream and recorded on the default one, as a prefetching loader
does). It prints a table (both answers of each, the trials, the reserved peak at the accumulating
answer) and writes JSON. No GPU has checked these figures: the model follows the allocator's source.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AUTOTUNE = str(Path(sys.executable).parent / "autotune")
CASES: list[tuple[str, str, list[str]]] = [
    ("gpt", "128MiB", ["--parallel", "ddp"]),
    ("gpt", "128MiB", ["--parallel", "fsdp", "--world-size", "2"]),
    ("gpt", "128MiB", ["--parallel", "fsdp", "--world-size", "4"]),
    ("gpt", "256MiB", ["--parallel", "fsdp", "--world-size", "4"]),
    ("tests.stream_workloads:prefetched", "64MiB", ["--parallel", "ddp"]),
]


def probe(target: str, memory: str, extra: list[str], streams: str) -> dict[str, Any]:
    command = [AUTOTUNE, "probe", target, "--device", "cpu", "--memory", memory, "--headroom", "0", *extra]
    command += ["--no-confirm", "--json"]
    env = {**os.environ, "AUTOTUNE_ALLOCATOR": "cuda", "AUTOTUNE_ALLOCATOR_STREAMS": streams}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[1:])} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    result = json.loads(done.stdout)
    answer, micro_steps = result["max_micro_batch"], result["loop"]["micro_steps"]
    at = [t for t in result["trials"] if t["batch"] == answer and t["micro_steps"] == micro_steps and t["fits"]]
    return {
        "answers": [answer, result["max_micro_batch_without_accumulation"]],
        "trials": len(result["trials"]),
        "peak_reserved_bytes": at[-1]["peak_reserved_bytes"] if at else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "streams.json"))
    args = parser.parse_args()
    rows = []
    print(f"{'case':44} {'streams':>9} {'one stream':>10} {'trials':>7} {'reserved MiB':>14}")
    for target, memory, extra in CASES:
        case = f"{target.rsplit(':', 1)[-1]} {memory} {' '.join(extra[1:])}"
        modelled, one = probe(target, memory, extra, "model"), probe(target, memory, extra, "one")
        rows.append({"case": case, "streams": modelled, "one_stream": one})
        peaks = [r["peak_reserved_bytes"] for r in (modelled, one)]
        print(
            f"{case:44} {'/'.join(map(str, modelled['answers'])):>9} {'/'.join(map(str, one['answers'])):>10} "
            f"{modelled['trials']:>3}/{one['trials']:<3} "
            f"{'/'.join('-' if p is None else f'{p / 2**20:.1f}' for p in peaks):>14}"
        )
    document = {
        "date": datetime.now(UTC).date().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
