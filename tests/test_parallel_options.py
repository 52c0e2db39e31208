"""FSDP as the job shards (issue 13): the workload's own sharding function, `reshard_after_forward`,
and a parallel setup in the service's request key. A small MLP of four blocks, ranks simulated
against PyTorch's fake process group, on the budget device."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from autotune.engine.probe import ProbeRequest, load_workload, run_probe
from autotune.engine.trial import TrialRunner
from autotune.errors import ConfigError, WorkloadError
from autotune.results import LoopShape, ParallelSpec, ProbeResult
from autotune.workloads.probekey import DeviceKey, key_for_request, key_from_result
from autotune.workloads.registry import register
from tests.docs_text import page

JOB = """
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

WIDTH = 512


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def shard_root(model, mesh):
    # One FSDP unit: every parameter is gathered at once, for the whole forward and backward.
    fully_shard(model, mesh=mesh)


def shard_nothing(model, mesh):
    return model


def _workload(shard):
    from autotune import Workload

    return Workload(
        name="blocks",
        build_model=Net,
        make_batch=lambda b, device: torch.randn(b, WIDTH, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="adam",
        shard=shard,
    )


def per_block():
    return _workload(None)


def root():
    return _workload(shard_root)


def broken():
    return _workload(shard_nothing)
"""

BASE = {"device": "cpu", "memory": "24MiB", "headroom": 0, "confirm": False, "parallel": "fsdp", "world_size": 4}


def _readme_shard_function() -> str:
    """docs/parallel.md's example of a job's own sharding function (its `def shard_model`)."""
    (block,) = re.findall(r"```python\n(.*?)```", page("docs/parallel.md"), re.S)
    return block[block.index("def shard_model") : block.index("\nworkload =")]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("job")
    readme = f"\n\n{_readme_shard_function()}\n\ndef readme():\n    return _workload(shard_model)\n"
    (folder / "sharded_job.py").write_text(textwrap.dedent(JOB) + readme)
    sys.path.insert(0, str(folder))
    try:
        yield "sharded_job"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("sharded_job", None)
        from autotune import parallel

        parallel.release()
        assert not dist.is_initialized()


def _peak(request: ProbeRequest, batch: int) -> int:
    from autotune.devices.budget import BudgetDevice

    workload = load_workload(request)
    runner = TrialRunner(workload, BudgetDevice(1 << 30), steps=2)
    record = runner.run(batch, LoopShape(micro_steps=1, steps=2))
    assert record.fits
    return record.peak_allocated_bytes


@pytest.fixture(scope="module")
def probed(job: str) -> dict[str, ProbeResult]:
    names = ("per_block", "root", "readme")
    return {name: run_probe(ProbeRequest(target=f"{job}:{name}", **BASE)) for name in names}


def test_the_jobs_own_sharding_is_probed_and_named(probed: dict[str, ProbeResult]) -> None:
    ours, theirs = probed["per_block"], probed["root"]
    assert ours.workload.parallel.sharding == "per-block"
    assert theirs.workload.parallel.sharding == "sharded_job.shard_root"
    assert ours.fingerprint != theirs.fingerprint
    # One unit gathers all four blocks at once: less room for samples than one block at a time.
    assert theirs.max_micro_batch < ours.max_micro_batch
    tried = {(t.batch, t.micro_steps): t.fits for t in theirs.evidence()}
    assert tried[(theirs.max_micro_batch, theirs.loop.micro_steps)] is True
    above = theirs.max_micro_batch + 1  # failed in its loop, or with one micro-step (less memory)
    assert False in (tried.get((above, theirs.loop.micro_steps)), tried.get((above, 1)))


def test_the_readmes_sharding_function_keeps_gathered_blocks_for_backward(probed: dict[str, ProbeResult]) -> None:
    readme, ours = probed["readme"], probed["per_block"]
    assert readme.workload.parallel.sharding == "sharded_job.shard_model"
    assert readme.max_micro_batch < ours.max_micro_batch


def test_a_sharding_function_that_shards_nothing_is_named(job: str) -> None:
    with pytest.raises(WorkloadError, match=r"shard function sharded_job\.shard_nothing left the model unsharded"):
        run_probe(ProbeRequest(target=f"{job}:broken", **BASE))


def test_reshard_after_forward_is_the_sharding_functions_choice(job: str) -> None:
    with pytest.raises(ConfigError, match="its own function, which passes reshard_after_forward"):
        load_workload(ProbeRequest(target=f"{job}:root", **BASE, reshard_after_forward=False))


def test_keeping_gathered_parameters_for_backward_costs_memory(job: str) -> None:
    # ZeRO-2 style: each block's gathered parameters stay from its forward to its backward.
    resharding = _peak(ProbeRequest(target=f"{job}:per_block", **BASE), 64)
    keeping = _peak(ProbeRequest(target=f"{job}:per_block", **BASE, reshard_after_forward=False), 64)
    block = (512 * 512 + 512) * 4
    assert keeping - resharding > block


def test_the_request_key_holds_the_parallel_setup_and_matches_the_results(
    job: str, probed: dict[str, ProbeResult]
) -> None:
    entry = register("blocks", {"target": f"{job}:root"})
    assert entry.sharding == "sharded_job.shard_root"
    device = DeviceKey(kind="cpu-budget", total_bytes=24 * 2**20)

    def key(spec: ParallelSpec | None) -> str:
        return key_for_request(entry, device, budget="total", memory=None, headroom=0, parallel=spec).digest()

    setups = [
        None,
        ParallelSpec(strategy="ddp"),
        ParallelSpec(strategy="fsdp", world_size=2),
        ParallelSpec(strategy="fsdp", world_size=4),
        ParallelSpec(strategy="fsdp", world_size=4, reshard_after_forward=False),
    ]
    assert len({key(spec) for spec in setups}) == len(setups)
    # No parallel setup (nor checkpointing) digests as keys did before there was one: stored results keep answering.
    plain = key_for_request(entry, device, budget="total", memory=None, headroom=0)
    old_fields = plain.model_dump(mode="json", exclude={"parallel", "checkpointing"})
    before = json.dumps(old_fields, sort_keys=True, separators=(",", ":"))
    assert key(None) == plain.digest() == hashlib.sha256(before.encode()).hexdigest()
    # A probe's result answers the request that asked for its setup (the entry's own sharding).
    derived = key_from_result(probed["root"], entry)
    assert derived is not None and derived.digest() == key(ParallelSpec(strategy="fsdp", world_size=4))


def test_each_answer_holds_in_a_fresh_runner_and_one_more_runs_out(job: str, probed: dict[str, ProbeResult]) -> None:
    """One FSDP unit over the whole model runs out of memory while it gathers or reduces; the trials
    after such a one ran with the sharded gradients of the failed step still set (the gradients were
    dropped from the gathered parameters FSDP had put on the modules), and the accumulating answer
    was 966 where a fresh runner runs out at 910. Each failed trial now resets FSDP first."""
    from autotune import parallel
    from autotune.devices.budget import BudgetDevice

    result = probed["root"]
    workload = load_workload(ProbeRequest(target=f"{job}:root", **BASE))
    checks = [(result.max_micro_batch, result.loop), (result.max_micro_batch_without_accumulation, LoopShape())]
    for answer, loop in checks:
        assert answer is not None
        for size, fits in ((answer, True), (answer + 1, False)):
            fresh = TrialRunner(workload, BudgetDevice(result.budget_bytes, result.limit_bytes))
            assert fresh.run(size, loop).fits is fits, (size, loop)
            parallel.release()
