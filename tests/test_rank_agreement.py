"""Ranks agree on the OOM guard's shrink (issue 13): under DDP, when one rank runs out of memory,
every rank redoes the window at the same smaller micro-batch, none waits forever in a collective,
and the gradients stay in sync.

The two-rank tests share one job that runs this file as a script, once per rank: `python
tests/test_rank_agreement.py RANK PORT OUT_DIR` (gloo on 127.0.0.1), its cases one after another in
one group (starting the two interpreters is most of a case's cost; each case has a model and guard
of its own, the uniform one first, in processes that have run nothing else). Each rank writes what
it ran to OUT_DIR/<case>-rank<N>.json and the uniform case's final parameters to OUT_DIR/rank<N>.pt.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autotune.devices.budget import BudgetDevice
from autotune.errors import ConfigError
from autotune.plans.accumulate import OOMGuard, _RankAgreement, accumulate

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 1024  # wide hidden layer, few inputs: activations dominate, so halving the micro-batch saves memory
MICRO = 8  # the starting micro-batch: 2 per window, 2 windows per rank
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1))


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s micro-batches of MICRO samples: different on each rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(4 * MICRO, 16, generator=generator), torch.randn(4 * MICRO, 1, generator=generator)
    return [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, 4 * MICRO, MICRO)]


def _peak(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Peak of an unguarded accumulated window on an unlimited budget device."""
    device = BudgetDevice(2**30)
    device.track([*model.parameters()])
    with device.active():
        for step in accumulate(batches, len(batches)):
            x, y = step.batch
            step.scale(nn.functional.mse_loss(model(x), y)).backward()
    model.zero_grad(set_to_none=True)
    return device.peak_allocated_bytes()


def _halves(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + MICRO // 2], y[i : i + MICRO // 2]) for x, y in batches for i in (0, MICRO // 2)]


def _uniform_case(rank: int, out: Path) -> None:
    """One rank of the uniform job: DDP over gloo, rank 1 on a budget that fits micro-batches of
    MICRO / 2 but not MICRO, rank 0 on a budget that fits everything."""
    model = _model()
    batches = _data(rank)
    small = _peak(model, _halves(batches[:2]))
    large = _peak(model, batches[:2])
    assert large > small + 8192, "the test's model no longer needs more memory at MICRO"
    # Midway: gloo may still hold a few KiB of the last window's all-reduces when the next one
    # starts (its worker thread lets go of them a little later, when it gets to it).
    limit = (small + large) // 2 if rank == 1 else 2**30
    ddp = DistributedDataParallel(model)  # outside the budget: its construction broadcasts
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    device = BudgetDevice(limit)
    device.track([*model.parameters(), *(t for batch in batches for t in batch)])
    guard = OOMGuard(ddp)
    ran: list[list[int]] = []
    steps = 0
    with device.active():
        for window in guard.windows(batches, 2):
            sizes: list[int] = []

            def micro_step(step, sizes=sizes):  # type: ignore[no-untyped-def]
                sizes.append(int(step.batch[0].shape[0]))
                x, y = step.batch
                step.scale(nn.functional.mse_loss(ddp(x), y)).backward()

            window.run(micro_step)
            ran.append(sizes)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    events = [[e.window, e.old_micro_batch, e.new_micro_batch, e.ran_out, e.message] for e in guard.events]
    report = {"rank": rank, "limit": guard.micro_batch_limit, "steps": steps, "ran": ran, "events": events}
    (out / f"uniform-rank{rank}.json").write_text(json.dumps(report))
    torch.save([p.detach().clone() for p in model.parameters()], out / f"rank{rank}.pt")
    # DDP's reducer and the gradients of the attempt that ran out go before the next case.
    guard = ddp = optimizer = None  # type: ignore[assignment]
    gc.collect()
    dist.barrier()


# A mixed plan's cases: (rank 0's micro-batch, rank 1's), and the samples above which rank 0 runs out.
MIXED_CASES = {
    "mixed": ((62, 24), 40),
    "one": ((8, 1), 2),  # rank 1 at one sample already; rank 0 runs out above 2 of 8
}


def rank_main(rank: int, port: int, out: Path) -> None:
    """One rank of the two-process job: the uniform case, then each mixed plan's."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        _uniform_case(rank, out)
        for case, (sizes, over) in MIXED_CASES.items():
            _mixed_case(rank, out / f"{case}-rank{rank}.json", sizes, over)
    finally:
        dist.destroy_process_group()


def _mixed_case(rank: int, report: Path, sizes: tuple[int, int], over: int) -> None:
    """One rank of a mixed plan's job: rank 0 (a larger GPU) runs micro-batches of `sizes[0]` and runs
    out of memory above `over` samples; rank 1 runs `sizes[1]` and never runs out."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 1))
    guard = OOMGuard(ddp)
    size = sizes[rank]
    windows = [[(torch.randn(size, 4), torch.randn(size, 1))] for _ in range(2)]
    ran: list[list[int]] = []
    for window in guard.windows([b for w in windows for b in w], 1):
        sizes: list[int] = []

        def micro_step(step, sizes=sizes):  # type: ignore[no-untyped-def]
            x, y = step.batch
            sizes.append(len(x))
            if len(x) > over:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            step.scale(nn.functional.mse_loss(ddp(x), y)).backward()

        window.run(micro_step)
        ran.append(sizes)
        ddp.zero_grad(set_to_none=True)
    events = [[e.window, e.old_micro_batch, e.new_micro_batch, e.ran_out, e.message] for e in guard.events]
    report.write_text(json.dumps({"ran": ran, "events": events}))
    guard = ddp = None  # type: ignore[assignment]
    gc.collect()
    dist.barrier()


def _expected_parameters() -> list[torch.Tensor]:
    """One process, no DDP: each window's gradient is the mean loss over both ranks' samples."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = [_data(0), _data(1)]
    for window in range(2):
        pieces = [batch for rank in data for batch in rank[2 * window : 2 * window + 2]]
        x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_ranks(tmp_path: Path) -> tuple[dict[str, list[dict]], str]:  # type: ignore[type-arg]
    """Run this file as both ranks of a gloo job; (each case's reports, rank by rank; both logs)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    processes = []
    for rank, log in enumerate(logs):
        with log.open("w") as sink:
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(rank), str(port), str(tmp_path)],
                    cwd=ROOT,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + 120  # a rank left waiting in a collective would never exit
    try:
        for process in processes:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
            process.wait()
        pytest.fail("a rank hung:\n" + "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs))
    outputs = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert [p.returncode for p in processes] == [0, 0], outputs
    cases = [path.name.removesuffix("-rank0.json") for path in tmp_path.glob("*-rank0.json")]
    return {
        case: [json.loads((tmp_path / f"{case}-rank{rank}.json").read_text()) for rank in (0, 1)] for case in cases
    }, outputs


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict]], str, Path]:  # type: ignore[type-arg]
    """The two-rank job's reports by case, both ranks' logs, and its directory."""
    out = tmp_path_factory.mktemp("ranks")
    done, outputs = _two_ranks(out)
    assert done.keys() == {"uniform", *MIXED_CASES}, outputs
    return done, outputs, out


def test_when_one_of_two_ranks_runs_out_both_shrink_alike_and_finish(
    job: tuple[dict[str, list[dict]], str, Path],  # type: ignore[type-arg]
) -> None:
    done, outputs, out = job
    reports = done["uniform"]
    # Rank 1 ran out at the starting micro-batch; rank 0 did not, and redid the window with it.
    assert [[e[:4] for e in r["events"]] for r in reports] == [
        [[0, MICRO, MICRO // 2, False]],
        [[0, MICRO, MICRO // 2, True]],
    ], outputs
    assert reports[0]["events"][0][4] == "rank 1 ran out of memory"
    assert "out of memory" in reports[1]["events"][0][4]
    assert [r["limit"] for r in reports] == [MICRO // 2, MICRO // 2]
    assert [r["steps"] for r in reports] == [2, 2]
    # Rank 0 completed the first attempt; both ran the redo and the second window at MICRO / 2.
    assert reports[0]["ran"] == [[MICRO, MICRO] + [MICRO // 2] * 4, [MICRO // 2] * 4]
    assert reports[1]["ran"][0][-4:] == [MICRO // 2] * 4 and reports[1]["ran"][1] == [MICRO // 2] * 4

    # The gradients stayed in sync: both ranks end with the same parameters, those of the full batch.
    final = [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]
    for zero, one, want in zip(final[0], final[1], _expected_parameters(), strict=True):
        assert torch.equal(zero, one)
        torch.testing.assert_close(zero, want, rtol=1e-5, atol=1e-6)


def test_the_ranks_of_a_mixed_plan_each_halve_their_own_micro_batch(
    job: tuple[dict[str, list[dict]], str, Path],  # type: ignore[type-arg]
) -> None:
    """Rank 0 runs 62 and runs out; rank 1 runs 24 and does not. Both halve their own size (31 and
    12), as a uniform job's ranks shrink alike; before, both took the smallest proposal, 24, and the
    rank that did not run out recorded a 'shrink' from 24 to 24."""
    done, outputs, _ = job
    reports = done["mixed"]
    assert [r["events"] for r in reports] == [
        [[0, 62, 31, True, reports[0]["events"][0][4]]],
        [[0, 24, 12, False, "rank 0 ran out of memory"]],
    ], outputs
    assert "out of memory" in reports[0]["events"][0][4]
    assert reports[0]["ran"] == [[62, 31, 31], [31, 31]]
    assert reports[1]["ran"] == [[24, 12, 12], [12, 12]]
    # A rank already at one sample redoes the window as it is, and records no shrink from 1 to 1.
    reports = done["one"]
    assert [[e[1:4] for e in r["events"]] for r in reports] == [[[8, 4, True], [4, 2, True]], []], outputs
    assert reports[1]["ran"] == [[1, 1, 1], [1]]


def test_the_agreement_with_one_rank(tmp_path: Path) -> None:
    """A single-process gloo group: the verdicts, the guard's agreed shrink with the exact window
    gradient, a parameter no rank used keeping no gradient, and the refusals."""
    with pytest.raises(ConfigError, match="init_process_group"):
        OOMGuard(nn.Linear(2, 1), agree=True)._ranks()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _agree_with_one_rank()
        # DDP's reducer (in the helper's frame, gone now) and its work go before the group does: the
        # group's last reference dropped with the reducer's joins gloo's threads while holding the GIL,
        # which a thread still freeing a work item (it holds our budget device's mode) waits for.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _agree_with_one_rank() -> None:
    """The test's body, in a frame of its own: its DDP objects are gone when it returns."""
    model = _model()
    model.register_parameter("unused", nn.Parameter(torch.zeros(3)))
    ddp = DistributedDataParallel(model)
    assert OOMGuard(ddp)._ranks() is None  # one rank, not asked: nothing to agree
    agreement = OOMGuard(ddp, agree=True)._ranks()
    assert isinstance(agreement, _RankAgreement) and agreement.flags.device.type == "cpu"
    verdict = agreement.agree(ran_out=True, failed=False, current=8)
    assert (verdict.oom_rank, verdict.error_rank, verdict.size) == (0, None, 4)
    assert agreement.agree(ran_out=True, failed=False, current=1).size == 0  # nothing left to shrink
    verdict = agreement.agree(ran_out=False, failed=True, current=8)
    assert (verdict.oom_rank, verdict.error_rank) == (None, 0)
    verdict = agreement.agree(ran_out=False, failed=False, current=8)
    assert (verdict.oom_rank, verdict.error_rank, verdict.size) == (None, None, 8)

    # The guard: window [4, 8] on a budget for micro-batches of 4 shrinks through the agreement.
    x, y = torch.cat([b[0] for b in _data(0)[:2]])[:12], torch.cat([b[1] for b in _data(0)[:2]])[:12]
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    limit = _peak(model, [(x[i : i + 4], y[i : i + 4]) for i in (0, 4, 8)]) + 1024
    nn.functional.mse_loss(model(x), y).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    device = BudgetDevice(limit)
    device.track([*model.parameters(), x, y])
    guard = OOMGuard(ddp, agree=True)

    def micro_step(step):  # type: ignore[no-untyped-def]
        step.scale(nn.functional.mse_loss(ddp(step.batch[0]), step.batch[1])).backward()

    with device.active():
        for window in guard.windows(batches, 2):
            window.run(micro_step)
    assert [(e.old_micro_batch, e.new_micro_batch, e.ran_out) for e in guard.events] == [(8, 4, True)]
    for name, p in model.named_parameters():
        if name == "unused":
            assert p.grad is None  # no rank used it: as DDP leaves it
        else:
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7)
    model.zero_grad(set_to_none=True)

    class Sharded(nn.Linear):  # stands in for FSDP: syncs inside backward
        def no_sync(self) -> None: ...

    with pytest.raises(ConfigError, match="agree=False"):
        OOMGuard(Sharded(2, 1), agree=True)._ranks()
    # FSDP2 has no no_sync: its DTensor parameters tell (its backward reduce-scatters).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(nn.Sequential(nn.Linear(2, 2)), mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ConfigError, match="FSDP2"):
        OOMGuard(sharded, agree=True)._ranks()
    with pytest.raises(ConfigError, match="static_graph"):
        OOMGuard(DistributedDataParallel(nn.Linear(2, 1), static_graph=True), agree=True)._ranks()


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
