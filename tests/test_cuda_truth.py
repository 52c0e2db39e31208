"""The CUDA allocator model on the budget device, end to end (issue: the whole run on a GPU, as CI
can see it): docs/probing.md's command under AUTOTUNE_ALLOCATOR=cuda, then `bench/cuda_truth.py`'s own
plain loop in fresh processes at the answers and one more. And its Trainer case: tune_trainer's answers
run in the Trainer's own `train()`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benches import load_bench

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def modelled() -> dict[str, Any]:
    """`autotune probe gpt --device cpu --memory 256MiB --headroom 0 --effective-batch 256 --json`
    with AUTOTUNE_ALLOCATOR=cuda, as the issue's "done when" says."""
    command = [sys.executable, "-m", "autotune.cli", "probe", "gpt", "--device", "cpu", "--memory", "256MiB"]
    command += ["--headroom", "0", "--effective-batch", "256", "--json"]
    env = {**os.environ, "AUTOTUNE_ALLOCATOR": "cuda"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.slow
def test_the_modelled_allocator_reserves_more_than_it_allocates_and_trials_settle(modelled: dict[str, Any]) -> None:
    trials = modelled["trials"]
    assert modelled["allocator_config"].startswith("model of CUDA's caching allocator")
    assert all(t["peak_reserved_bytes"] >= t["peak_allocated_bytes"] for t in trials)
    assert any(t["peak_reserved_bytes"] > t["peak_allocated_bytes"] for t in trials)
    fitting = [t for t in trials if t["fits"]]
    assert fitting and all(t["steps"] >= 3 and t["allocator"] is not None for t in fitting)
    single = modelled["max_micro_batch_without_accumulation"]
    assert modelled["max_micro_batch"] <= single
    assert modelled["confirmation"]["status"] == "passed"


# The plain loop's optimizer steps: more than twice the 3-4 steps in which the model's trials settle
# (20 took a minute of the suite; the allocator model repeats itself from the settled step on).
LOOP_STEPS = 10


@pytest.mark.slow
def test_a_plain_10_step_loop_on_the_modelled_device_fits_at_the_answer_and_not_one_more(
    modelled: dict[str, Any],
) -> None:
    bench = load_bench("cuda_truth")
    # In this process, each run on a budget device of its own (a fresh allocator model, what a fresh
    # process gives on a GPU); the script runs each in a new interpreter.
    rows = bench.truth(
        modelled, "cpu", LOOP_STEPS, {}, "cuda", run=lambda job, env: bench.plain_loop(job), one_micro_step=False
    )
    by = {r["batch"]: r for r in rows}
    answer = modelled["max_micro_batch"]
    assert by[answer]["fits"] and by[answer]["steps"] == LOOP_STEPS, by
    assert by[answer]["peak_reserved_bytes"] <= modelled["limit_bytes"]
    assert by[answer]["peak_reserved_bytes"] > by[answer]["peak_allocated_bytes"]  # the model's cache
    # One more sample, accumulating, runs out of memory in the plain loop too.
    assert not by[answer + 1]["fits"] and "out of memory" in by[answer + 1]["message"], by


# The Trainer case ---------------------------------------------------------------------------------
# Exact counting repeats itself from the second optimizer step on: a third shows it did.
TRAINER_STEPS = 3


def _in_process(bench: ModuleType) -> Callable[[dict[str, Any], dict[str, str]], dict[str, Any]]:
    """The script's jobs run in this process, each under its environment. Every run opens a budget
    device of its own (a fresh allocator, what the script's new interpreter gives); the jobs'
    imports, which a new interpreter pays for each (seconds, with transformers), are paid once."""

    def run(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            outcome = bench.JOBS[job.get("kind", "plain")](job)
        # What crosses the process boundary in the script: JSON.
        crossed: dict[str, Any] = json.loads(json.dumps(outcome))
        return crossed

    return run


@pytest.fixture(scope="module")
def trainer_row() -> dict[str, Any]:
    """The tiny GPT-2's Trainer, configured 8 x 4, tuned at 8 MiB, and its truth in 3-step train()s,
    with exact counting (the script's docstring says why not the allocator model)."""
    pytest.importorskip("transformers")
    bench = load_bench("cuda_truth")
    [row] = bench.run_cases(["trainer:8MiB:tiny"], "cpu", TRAINER_STEPS, None, run=_in_process(bench))
    return row


@pytest.mark.slow
def test_the_trainers_train_fits_at_each_answer_and_runs_out_one_above(trainer_row: dict[str, Any]) -> None:
    runs = {(r["batch"], r["micro_steps"]): r for r in trainer_row["runs"]}
    micro, accumulation = trainer_row["tuned"]
    assert micro * accumulation == 32 and accumulation > 1, trainer_row  # the job's 8 x 4, kept
    single, answer = trainer_row["max_micro_batch_without_accumulation"], trainer_row["max_micro_batch"]
    # Each loop's pair, the plan's window of `accumulation` micro-batches among them.
    for size, steps in ((single, 1), (answer, accumulation)):
        fitted, over = runs[(size, steps)], runs[(size + 1, steps)]
        assert fitted["fits"] and fitted["steps"] == TRAINER_STEPS, fitted
        assert fitted["peak_reserved_bytes"] <= trainer_row["limit_bytes"]
        assert not over["fits"] and "out of memory" in over["message"], over
        assert 1 <= over["step"] <= TRAINER_STEPS and 1 <= over["micro_step"] <= steps
    # What tune_trainer set, as the user then trains.
    assert runs[(micro, accumulation)]["fits"] and runs[(micro, accumulation)]["expected_fits"]
    assert trainer_row["holds"] and trainer_row["confirmation"] == "skipped"


def _tuned_result(answers: list[tuple[int, int | None, bool]], tuned: tuple[int, int]) -> dict[str, Any]:
    return {
        "budget_bytes": 2**23,
        "limit_bytes": 2**23 - 4096,
        "loop": {"micro_steps": tuned[1]},
        "answers": [
            {"loop": {"micro_steps": steps}, "max_micro_batch": size, "capped": capped}
            for steps, size, capped in answers
        ],
        "framework": {"tuned": {"micro_batch": tuned[0], "accumulation_steps": tuned[1]}},
    }


def test_the_trainer_truth_runs_each_claim_and_what_was_set() -> None:
    bench = load_bench("cuda_truth")
    jobs: list[dict[str, Any]] = []

    def run(job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        jobs.append(job)
        return {"fits": job["batch"] < 13}  # a device where 12 fits and 13 does not, in any loop

    # A capped answer claims nothing of one more; no size fits the 2-step loop; the plan runs 8 x 4.
    result = _tuned_result([(1, 20, True), (2, None, False), (4, 12, False)], (8, 4))
    case = bench.trainer_case("trainer:8MiB:tiny")
    rows = bench.trainer_truth(result, case, "cpu", 5, {}, None, run=run)
    assert [(r["answer"], r["batch"], r["micro_steps"], r["expected_fits"]) for r in rows] == [
        ("max_micro_batch_without_accumulation", 20, 1, True),
        ("max_micro_batch", 12, 4, True),
        ("max_micro_batch", 13, 4, False),
        ("tuned", 8, 4, True),
    ]
    # The 20 claimed for one micro-step is shown not to fit: the row says so.
    assert [r["fits"] == r["expected_fits"] for r in rows] == [False, True, True, True]
    assert all(j["kind"] == "trainer" and j["model"] == "tiny" and j["limit_bytes"] == 2**23 - 4096 for j in jobs)
    # What was set is not run twice when an answer's run is it.
    rows = bench.trainer_truth(_tuned_result([(3, 12, False)], (12, 3)), case, "cpu", 5, {}, None, run=run)
    assert [(r["batch"], r["micro_steps"]) for r in rows] == [(12, 3), (13, 3)]


def test_trainer_cases_name_a_memory_and_the_model() -> None:
    bench = load_bench("cuda_truth")
    assert "trainer:2GiB" in bench.GPU_CASES
    assert bench.trainer_case("trainer:2GiB") == ("2GiB", "small", False)
    assert bench.trainer_case("trainer:8MiB:tiny:expandable") == ("8MiB", "tiny", True)
    for bad in ("trainer:card", "trainer", "trainer:2GiB:huge"):
        with pytest.raises(SystemExit, match=r"trainer:SIZE|not tiny or expandable"):
            bench.trainer_case(bad)
