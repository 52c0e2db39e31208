"""Parallel jobs (issue 13): `--parallel ddp` and `--parallel fsdp` probed as they run, and the
one-device simulation against the truth, a real multi-process gloo job on CPU whose every rank has
its own budget device at the probe's limit."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from autotune.engine.probe import ProbeRequest, run_probe
from autotune.results import ProbeResult
from tests.benches import load_bench
from tests.docs_text import page, prose

BASE = {"target": "gpt", "device": "cpu", "memory": "128MiB", "headroom": 0, "confirm": False}


def _readme_command() -> list[str]:
    """docs/parallel.md's `--parallel fsdp` command: its 4-rank case is this command's answer."""
    line = re.search(r"```console\n\$ (autotune probe .*)\n```", page("docs/parallel.md"))
    assert line, "docs/parallel.md has no probe command"
    return shlex.split(line.group(1))


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, ProbeResult]]:
    command = _readme_command()
    assert command[2:] == [
        "gpt", "--device", "cpu", "--memory", BASE["memory"], "--headroom", "0", "--parallel", "fsdp",
        "--world-size", "4", "--no-confirm", "--json",
    ]  # fmt: skip
    # Through the CLI's entry point in this process: its probe's process forks from the server the
    # other probes of this process share (the CLI as a process of its own is test_cli's).
    from autotune import cli

    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        code = cli.run(command[1:])
    assert code == 0, said.getvalue()
    found = {
        "none": run_probe(ProbeRequest(**BASE)),
        "ddp": run_probe(ProbeRequest(**BASE, parallel="ddp")),
        "fsdp2": run_probe(ProbeRequest(**BASE, parallel="fsdp", world_size=2)),
        "fsdp4": ProbeResult.model_validate_json(printed.getvalue()),
    }
    yield found
    # The probe's process group lives as long as its process (a probe's own child, normally);
    # here the test process ends it, so that later tests start without one.
    from autotune import parallel

    parallel.release()
    assert not dist.is_initialized()


def _exact(result: ProbeResult) -> None:
    answer = result.max_micro_batch
    tried = {(t.batch, t.micro_steps): t.fits for t in result.evidence()}
    assert tried[(answer, result.loop.micro_steps)] is True
    # One more failed in its loop, or with one micro-step (less memory: not tried again with more).
    assert False in (tried.get((answer + 1, result.loop.micro_steps)), tried.get((answer + 1, 1)))


def test_each_setup_answers_exactly_for_its_loop_and_is_keyed_apart(results: dict[str, ProbeResult]) -> None:
    for result in results.values():
        _exact(result)
    none, ddp, fsdp2, fsdp4 = (results[k] for k in ("none", "ddp", "fsdp2", "fsdp4"))
    # DDP's rank holds the model and its buckets: no more than the plain answer. Sharding leaves
    # room for more samples the more ranks share the model.
    assert ddp.max_micro_batch <= none.max_micro_batch < fsdp2.max_micro_batch <= fsdp4.max_micro_batch
    assert len({r.fingerprint for r in results.values()}) == 4
    assert fsdp4.workload.parallel.strategy == "fsdp" and fsdp4.workload.parallel.world_size == 4
    # What docs/parallel.md says its command answers.
    text = prose(page("docs/parallel.md"))
    setup = json.dumps(fsdp4.workload.parallel.model_dump())
    answer = fsdp4.max_micro_batch
    assert f"answers {answer} per rank (`max_micro_batch`; `workload.parallel` is `{setup}`)" in text
    assert f"the real 4-rank job at {answer} and at {answer + 1}." in text
    # What a rank holds of the model: a quarter of its parameters (rows padded to divide by 4).
    assert none.breakdown is not None and fsdp4.breakdown is not None
    assert abs(fsdp4.breakdown.parameters - none.breakdown.parameters / 4) < none.breakdown.parameters * 0.01


def _real_jobs(
    result: ProbeResult, strategy: str, world: int, batches: list[int], request: dict[str, object] = BASE
) -> dict[int, list[dict]]:  # type: ignore[type-arg]
    return load_bench("parallel").real_jobs(  # type: ignore[no-any-return]
        request,
        strategy,
        world,
        batches,
        total_bytes=result.budget_bytes,
        limit_bytes=result.limit_bytes,
        micro_steps=result.loop.micro_steps,
        timeout=120,
    )


# (A 2-rank FSDP job and gpt's DDP job ran here too; the suite's time budget keeps the 4-rank job
# docs/parallel.md names. A real DDP job runs below, after the out-of-memory trials of its probe.)
@pytest.mark.parametrize(("key", "strategy", "world"), [("fsdp4", "fsdp", 4)])
def test_the_one_device_answer_holds_on_every_rank_of_a_real_job_and_one_more_does_not(
    results: dict[str, ProbeResult], key: str, strategy: str, world: int
) -> None:
    result = results[key]
    answer = result.max_micro_batch
    jobs = _real_jobs(result, strategy, world, [answer, answer + 1])
    at, over = jobs[answer], jobs[answer + 1]
    assert len(at) == len(over) == world
    assert all(r["fits"] for r in at), at
    # The simulated rank's peak is each real rank's, to the byte.
    simulated = result.trial_at_answer
    assert simulated is not None
    assert {r["peak"] for r in at} == {simulated.peak_allocated_bytes}
    assert not all(r["fits"] for r in over), over


def test_a_ddp_trial_after_one_that_ran_out_in_the_synced_backward_runs() -> None:
    """Out of memory midway through the backward that reduces the gradients leaves DDP's reducer
    waiting for the rest of that step: the next trial's forward raised "Expected to have finished
    reduction in the prior iteration" and the probe failed. Each failed trial now sets it back,
    and the answer is the real job's."""
    request: dict[str, object] = {
        "target": "tests.workloads:classifier", "device": "cpu", "memory": "1MiB", "headroom": 0, "confirm": False
    }  # fmt: skip
    from autotune import parallel

    try:
        result = run_probe(ProbeRequest.model_validate({**request, "parallel": "ddp"}))
    finally:
        parallel.release()
    _exact(result)
    assert sum(not t.fits for t in result.trials) >= 2  # trials ran after out-of-memory ones
    answer = result.max_micro_batch
    jobs = _real_jobs(result, "ddp", 2, [answer, answer + 1], request)
    at, over = jobs[answer], jobs[answer + 1]
    assert all(r["fits"] for r in at) and {r["peak"] for r in at} == {result.trial_at_answer.peak_allocated_bytes}
    assert len(over) == 2 and not all(r["fits"] for r in over)


def test_an_fsdp_trial_after_one_that_ran_out_midway_runs_as_in_a_fresh_process() -> None:
    """FSDP2 keeps a step's collective buffers (the all-gather result, reduce-scatter states) until the
    step ends: after an out-of-memory one they were left to the next trial (10 KiB kept between
    trials here), whose state then let the accumulating loop fit 1124 samples, where a fresh
    process runs out at 1119. Each failed trial now resets FSDP's iteration state, and every answer
    is the one a trial in a fresh runner gives."""
    from autotune import parallel
    from autotune.devices.budget import BudgetDevice
    from autotune.engine.probe import as_requested, load_workload
    from autotune.engine.trial import TrialRunner

    request = ProbeRequest(
        target="tests.workloads:classifier", device="cpu", memory="1MiB", headroom=0, confirm=False,
        parallel="fsdp", world_size=2,
    )  # fmt: skip
    try:
        result = run_probe(request)
        _exact(result)
        assert sum(not t.fits for t in result.trials) >= 2  # trials ran after out-of-memory ones
        workload = as_requested(load_workload(request), request)
        for answer in (result.max_micro_batch, result.max_micro_batch_without_accumulation):
            loop = result.loop if answer == result.max_micro_batch else result.answers[0].loop
            for size, fits in ((answer, True), (answer + 1, False)):
                fresh = TrialRunner(workload, BudgetDevice(result.budget_bytes, result.limit_bytes))
                assert fresh.run(size, loop).fits is fits, (size, loop)
                parallel.release()
    finally:
        parallel.release()
