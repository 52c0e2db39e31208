"""Record, on a GPU, what the predictor's timeline trials gave a probe: the caching allocator's own
trace (the two `torch.cuda.memory._snapshot()`s around each trial) and the ops the trial ran, so
that the CPU can replay them later through `parse_snapshots` and the allocator model.

    PYTHONPATH=. python bench/record_cuda_trace.py --memory 512MiB --out bench/results/h100_trace_512MiB.pkl.gz

It runs `autotune probe gpt --memory SIZE --headroom 0` in this process (no confirmation: the
traces are what is kept) and wraps `autotune.engine.predict.traced_timeline` to keep each call's
inputs: the batch, the events recorded around the trial (ops, their code sites, the allocator's
counts, the two snapshots), the device's limit, total bytes and allocator settings; and what the
probe answered, with every trial's peaks; and each other trial of the search (those near the limit,
those that ran out) with the allocator's history recorded around it alone (`searched`: its two
snapshots, whether it fitted, its reserved peak and out-of-memory message). The file is a gzipped
pickle of plain Python values (dicts, lists, tuples, strings, numbers): `load(path)` reads it back.
The snapshots are recorded without stack traces (the predictor records none), so they hold sizes,
addresses and actions only.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def record(memory: str) -> dict[str, Any]:
    import torch

    from autotune.engine import predict
    from autotune.engine.probe import ProbeRequest, run_probe
    from autotune.engine.trial import TrialRunner

    trials: list[dict[str, Any]] = []
    original = predict.traced_timeline

    def keeping(batch: int, device: Any, events: Any) -> Any:
        trials.append(
            {
                "batch": batch,
                "events": list(events),
                "device_index": device.torch_device.index,
                "limit_bytes": device.limit_bytes,
                "total_bytes": device.total_bytes,
                "allocator_config": device.allocator_config,
            }
        )
        return original(batch, device, events)

    # Every other trial (the search's, near the limit, those that ran out) with the allocator's
    # history around it alone: its entries, its segments before, and whether it fitted.
    searched: list[dict[str, Any]] = []
    run_trial = TrialRunner.run

    def tracing(runner: TrialRunner, batch: int, loop: Any) -> Any:
        if timeline:  # a timeline trial, recorded by the predictor: `keeping` has it
            return run_trial(runner, batch, loop)
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=1 << 20)
        try:
            before = torch.cuda.memory._snapshot()
            record = run_trial(runner, batch, loop)
            after = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(None)
        searched.append(
            {
                "batch": batch,
                "micro_steps": loop.micro_steps,
                "fits": record.fits,
                "peak_reserved_bytes": record.peak_reserved_bytes,
                "oom_message": record.oom_message,
                "before": before,
                "after": after,
            }
        )
        return record

    timeline: list[bool] = []
    recording = predict.recording

    @contextlib.contextmanager
    def marked(device: Any) -> Iterator[Any]:
        timeline.append(True)
        try:
            with recording(device) as events:
                yield events
        finally:
            timeline.pop()

    predict.traced_timeline = keeping
    predict.recording = marked  # type: ignore[assignment]
    TrialRunner.run = tracing  # type: ignore[method-assign]
    try:
        result = run_probe(
            ProbeRequest(target="gpt", device="cuda:0", memory=memory, headroom=0, min_free_memory=0, confirm=False)
        )
    finally:
        predict.traced_timeline = original
        predict.recording = recording  # type: ignore[assignment]
        TrialRunner.run = run_trial  # type: ignore[method-assign]
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "memory": memory,
        "trials": trials,
        "searched": searched,
        "result": result.model_dump(mode="json"),
    }


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rb") as f:
        document: dict[str, Any] = pickle.load(f)  # our own recording (trusted input)
    return document


def save(path: Path | str, document: dict[str, Any]) -> None:
    with gzip.open(path, "wb") as f:
        pickle.dump(document, f, protocol=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory", default="512MiB")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    document = record(args.memory)
    save(args.out, document)
    result = document["result"]
    print(
        f"{args.memory}: {len(document['trials'])} traced trials, answers "
        f"{result['max_micro_batch']} / {result.get('max_micro_batch_without_accumulation')}, "
        f"prediction {result.get('prediction')}, {Path(args.out).stat().st_size} bytes"
    )


if __name__ == "__main__":
    main()
