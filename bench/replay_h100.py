"""The H100's recorded allocator traces through the predictor, offline (issue 37, item 1).

    OMP_NUM_THREADS=1 .venv/bin/python bench/replay_h100.py [--json]

For each recorded case it runs the predictor's search (`autotune.engine.predict.predicted_search`)
as a probe on the H100 would, with every trial answered from the H100's records instead of a GPU:

- the timeline trials (batch 4, then 2, then 8 if those two did not pair) give the events the H100
  recorded around them (`bench/record_cuda_trace.py`: the ops, their allocator counts, the two
  snapshots), parsed and paired as on a GPU, with the optimizer steps each trial ran;
- every other trial gives the H100's verdict at that size in that loop: the trial the H100's probe
  ran there, else what its trials imply (memory grows with the batch: a size below one that fitted
  fits, a size above one that ran out runs out; the accumulating loop never needs less than the
  one-micro-step loop). A size the records cannot answer stops the case with that said.

The accumulating loop is searched as the probe searches it (`engine.probe._search_below`: the
one-micro-step answer first). Then the fresh-process confirmation's edge rule
(`engine.confirm.EDGE_MARGIN_BYTES`) is predicted from the replay: a one-micro-step answer that
fits only by the allocator freeing its cache and retrying runs again with 4 MiB less, and steps down
(`confirm._step_down`) to the largest size that fits so; the accumulating answer follows a lowered
one-micro-step answer (`confirm.lowered`). The replay stands in for the fresh process's run: it
replays the timeline trials' common steps, from the allocator as a trial found it (the model's
parameters in their segments, the cache emptied). No trace of the accumulating loop was recorded,
so its own confirmation run (3 micro-steps) is not predicted: the accumulating answer is its search's,
lowered with the one-micro-step answer.

`predicted` is that answer after the edge rule; `searched` the predicted search's answer (what the
trials verify); `trials` the search's trials in the loop (the timeline trials count in the
one-micro-step loop); `verified` the H100's answer that held in an independent loop
(`bench/results/cuda_truth_h100.json`, today's rules). A case with no trace recorded (512 MiB with
expandable segments) is listed with `predicted: null` and says so: nothing of it is replayed.

Prints a table of the answers and one of the replay against each trial the H100's probe ran (its
verdict and reserved peak); `--json` prints the answers as a JSON list instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # record_cuda_trace: the recordings' file format
from record_cuda_trace import load  # noqa: E402

# (case, its trace in bench/results or None, the case's name in cuda_truth_h100.json)
CASES: tuple[tuple[str, str | None, str], ...] = (
    ("512MiB", "h100_trace_512MiB.pkl.gz", "gpt:512MiB"),
    ("2GiB", "h100_trace_2GiB.pkl.gz", "gpt:2GiB"),
    ("512MiB:expandable", None, "gpt:512MiB:expandable"),
)
LOOPS = (("one_micro_step", 1), ("accumulating", 2))
NO_TRACE = (
    "no allocator trace was recorded for this case (bench/record_cuda_trace.py ran at 512 MiB and 2 GiB, "
    "without expandable segments): nothing to replay"
)


def row(case: str, loop: str, verified: int | None, h100_trials: int | None, **fields: Any) -> dict[str, Any]:
    """One case's answer in one loop: every key, None where there is nothing to say."""
    keys = ("predicted", "trials", "searched", "trial_batches", "trace", "probe_batches", "fallback_reason", "note")
    return {
        "case": case,
        "loop": loop,
        "verified": verified,
        "h100_trials": h100_trials,
        **{key: None for key in keys},
        **fields,
    }


def _verified(truth: dict[str, Any], micro_steps: int) -> tuple[int, int]:
    """The H100's verified answer for one loop and the trials its probe took there."""
    if micro_steps == 1:
        return truth["max_micro_batch_without_accumulation"], truth["trials_per_loop"]["one micro-step"]
    return truth["max_micro_batch"], truth["trials_per_loop"]["accumulating"]


class NotRecorded(LookupError):
    """A trial the H100's records cannot answer."""


class RecordedDevice:
    """What the predictor sees of the H100's device: its kind, index, limit, total and allocator
    settings; `record_timeline` collects the events the recorded trials put there."""

    kind = "cuda"

    def __init__(self, trial: dict[str, Any]) -> None:
        import torch

        self.torch_device = torch.device("cuda", trial["device_index"] or 0)
        self.limit_bytes: int = trial["limit_bytes"]
        self.total_bytes: int = trial["total_bytes"]
        self.allocator_config: str | None = trial["allocator_config"]
        self.events: list[Any] | None = None

    def live_bytes(self) -> int:
        return 0  # the trace's own snapshots say what was allocated

    @contextlib.contextmanager
    def record_timeline(self) -> Iterator[list[Any]]:
        self.events = []
        try:
            yield self.events
        finally:
            self.events = None


class RecordedTrials:
    """Trials answered from the H100's records (see the module's docstring)."""

    def __init__(self, document: dict[str, Any], device: RecordedDevice) -> None:
        from autotune.results import TrialRecord

        self.device = device
        self.records = [TrialRecord.model_validate(t) for t in document["result"]["trials"]]
        self.events = {t["batch"]: t["events"] for t in document["trials"]}
        self.asked: dict[int, list[int]] = {}

    def loop(self, micro_steps: int) -> Callable[[int], Any]:
        def trial(batch: int) -> Any:
            self.asked.setdefault(micro_steps, []).append(batch)
            record = self.answer(batch, micro_steps)
            if self.device.events is not None:  # a timeline trial: what the H100 recorded around it
                if micro_steps != 1 or batch not in self.events:
                    raise NotRecorded(f"no timeline trial was recorded at batch {batch} x {micro_steps}")
                self.device.events.extend(self.events[batch])
            return record

        return trial

    def answer(self, batch: int, micro_steps: int) -> Any:
        from autotune.results import TrialRecord

        same = [r for r in self.records if r.micro_steps == micro_steps]
        ran = next((r for r in same if r.batch == batch), None)
        if ran is not None:
            return ran
        # A larger size that fitted in this loop (or, for one micro-step, with accumulation) fits here.
        fits = any(r.fits and r.batch >= batch and r.micro_steps >= micro_steps for r in self.records)
        # A smaller size that ran out in this loop (or, with accumulation, with one micro-step) runs out.
        fails = any(not r.fits and r.batch <= batch and r.micro_steps <= micro_steps for r in self.records)
        if fits == fails:
            raise NotRecorded(f"the H100's records do not say whether batch {batch} x {micro_steps} fits")
        return TrialRecord(batch=batch, fits=fits, micro_steps=micro_steps, seconds=0.0)


def edge_rule(replay: Any, answer: int, limit: int) -> int | None:
    """The one-micro-step answer after the confirmation's edge rule, with the replay standing in
    for each fresh-process run (`confirm.confirm_answers`' `run`, then `_step_down`)."""
    from autotune.engine import confirm
    from autotune.results import TrialRecord

    def run(size: int) -> TrialRecord:
        replayed = replay.run(size)
        if replayed.fits and replayed.retries and limit > confirm.EDGE_MARGIN_BYTES:
            replayed = replay.run(size, limit - confirm.EDGE_MARGIN_BYTES)
        return TrialRecord(batch=size, fits=replayed.fits, seconds=0.0, peak_reserved_bytes=replayed.reserved_peak)

    first = run(answer)
    if first.fits:
        return answer
    return confirm._step_down(run, first, limit, 1)


def replay_case(case: str, trace: str, truth: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(a row per loop, a row per trial the H100's probe ran) for a case with a trace."""
    from autotune.engine.predict import ReplayModel, predicted_search
    from autotune.engine.probe import _search_below
    from autotune.errors import NothingFitsError
    from autotune.request import ProbeRequest
    from autotune.results import LoopAnswer, LoopShape

    document = load(RESULTS / trace)
    device = RecordedDevice(document["trials"][0])
    trials = RecordedTrials(document, device)
    limit = device.limit_bytes
    note = ""
    found = predicted_search(trials.loop(1), device, limit_bytes=limit)  # type: ignore[arg-type]
    model, prediction = found.model, found.prediction
    single = found.outcome.max_micro_batch
    single_loop = LoopShape(micro_steps=1, steps=2)
    request = ProbeRequest(target="gpt", device="cuda:0", memory=limit, headroom=0)
    try:
        accumulating, _ = _search_below(
            trials.loop(2),
            device,  # type: ignore[arg-type]
            request,
            LoopAnswer(loop=single_loop, max_micro_batch=single, capped=found.outcome.capped),
        )
        searched_acc: int | None = accumulating.max_micro_batch
    except NothingFitsError:
        searched_acc = None
    if isinstance(model, ReplayModel):
        confirmed = edge_rule(model, single, limit)
    else:
        confirmed = None
        note = f"the predictor did not replay the trace ({prediction.fallback_reason or type(model).__name__})"
    lowered = None if confirmed is None or searched_acc is None else min(searched_acc, confirmed)
    answers = {"one_micro_step": (single, confirmed), "accumulating": (searched_acc, lowered)}
    rows = []
    for loop, micro_steps in LOOPS:
        searched, predicted = answers[loop]
        asked = trials.asked.get(micro_steps, [])
        rows.append(
            row(
                case,
                loop,
                *_verified(truth, micro_steps),
                predicted=predicted,
                trials=len(asked),
                searched=searched,
                trial_batches=asked,
                trace=trace,
                probe_batches=prediction.probe_batches if micro_steps == 1 else None,
                fallback_reason=prediction.fallback_reason if micro_steps == 1 else None,
                note=note
                or (
                    "the replay of the one-micro-step loop predicts the edge rule"
                    if micro_steps == 1
                    else "no trace of this loop: its search's answer, lowered with the one-micro-step answer"
                ),
            )
        )
    checks = []
    if isinstance(model, ReplayModel):
        for record in trials.records:
            if record.micro_steps != 1:
                continue
            replayed = model.run(record.batch)
            checks.append(
                {
                    "case": case,
                    "batch": record.batch,
                    "h100_fits": record.fits,
                    "replay_fits": replayed.fits,
                    "h100_reserved_peak": record.peak_reserved_bytes,
                    "replay_reserved_peak": replayed.reserved_peak,
                    "replay_retries": replayed.retries,
                    "replay_request": replayed.segment,
                }
            )
    return rows, checks


def replay_all() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    truth = {c["case"]: c for c in json.loads((RESULTS / "cuda_truth_h100.json").read_text())["cases"]}
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for case, trace, name in CASES:
        if trace is None:
            rows += [
                row(case, loop, *_verified(truth[name], micro_steps), note=NO_TRACE) for loop, micro_steps in LOOPS
            ]
            continue
        try:
            more_rows, more_checks = replay_case(case, trace, truth[name])
        except NotRecorded as exc:
            more_rows = [
                row(case, loop, *_verified(truth[name], steps), trace=trace, note=str(exc)) for loop, steps in LOOPS
            ]
            more_checks = []
        rows += more_rows
        checks += more_checks
    return rows, checks


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [
        "| case | loop | trials (sizes) | H100's trials | searched | predicted | verified |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        sizes = row.get("trial_batches")
        tried = "-" if row["trials"] is None else f"{row['trials']} ({', '.join(map(str, sizes or []))})"
        lines.append(
            f"| {row['case']} | {row['loop']} | {tried} | {row.get('h100_trials', '-')} | "
            f"{row.get('searched') if row.get('searched') is not None else '-'} | "
            f"{row['predicted'] if row['predicted'] is not None else '-'} | {row['verified']} |"
        )
    notes = {row["note"] for row in rows if row.get("note") and row["predicted"] is None}
    lines += [""] + [f"- {note}" for note in sorted(notes)]
    lines += [
        "",
        "The replay against each one-micro-step trial the H100's probe ran (reserved MiB; retries; the segment "
        "an OOM asked for):",
        "",
        "| case | batch | H100 | replay | H100 reserved | replay reserved | replay retries | replay asked |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for c in sorted(checks, key=lambda c: (c["case"], c["batch"])):
        lines.append(
            f"| {c['case']} | {c['batch']} | {'fits' if c['h100_fits'] else 'OOM'} | "
            f"{'fits' if c['replay_fits'] else 'OOM'} | {_mib(c['h100_reserved_peak'])} | "
            f"{_mib(c['replay_reserved_peak'])} | {c['replay_retries']} | {_mib(c['replay_request'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the answers as a JSON list")
    args = parser.parse_args(argv)
    rows, checks = replay_all()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(table(rows, checks))


if __name__ == "__main__":
    main()
