"""One plan across GPU types (issue 13 item 5): the arithmetic (hypothesis), the gradient it gives
(ranks simulated in one process, DDP's average over ranks done by hand), `autotune plan --group`,
docs/accumulation.md's example, and `POST /v1/plan/mixed` in-process with stored results per GPU model."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from api import create_app
from autotune import cli
from autotune.devices import nvml
from autotune.errors import PlanError
from autotune.plans.accumulate import AcrossRanks, accumulate
from autotune.plans.mixed import Group, MixedPlan, Mode, mixed_arithmetic, mixed_plan
from autotune.plans.plan import Policy, plan
from autotune.settings import Settings
from autotune.units import headroom_bytes
from tests.docs_text import blocks, section
from tests.nvml_standin import FakeGpu, FakeNvml
from tests.serving import make_result

WORLD = [Group("H100-80GB", 4, 64), Group("A100-40GB", 4, 24)]


def _sizes(p: MixedPlan) -> list[list[int]]:
    """Each rank's micro-batches, rank by rank."""
    return [p.for_rank(rank).micro_batches for rank in range(p.world_size)]


# The arithmetic ---------------------------------------------------------------------------------------
def test_the_issue_example_per_model_and_uniform() -> None:
    made = mixed_plan(1024, WORLD)
    assert (made.mode, made.accumulation_steps, made.world_size) == (Mode.PER_MODEL, 3, 8)
    h100, a100 = made.groups
    assert [(r.first_rank, r.rank_count, r.micro_batches, r.samples) for r in h100.runs] == [(0, 4, [62, 62, 62], 186)]
    assert [(r.first_rank, r.rank_count, r.micro_batches, r.samples) for r in a100.runs] == [(4, 4, [24, 23, 23], 70)]
    assert a100.runs[0].loss_weights == [8 * 24 / 1024, 8 * 23 / 1024, 8 * 23 / 1024]
    assert mixed_arithmetic(made) == "4 × (62 × 3) + 4 × (24 + 23 × 2) = effective batch 1024"
    uniform = mixed_plan(1024, WORLD, "uniform")
    assert uniform.accumulation_steps == 6
    assert _sizes(uniform) == [plan(1024, 24, 8).micro_batches] * 8
    assert any("per-model needs 3 accumulation steps instead of 6" in w for w in uniform.warnings)
    exact = mixed_plan(1024, WORLD, "uniform", "exact")
    assert _sizes(exact) == [[16] * 8] * 8


@settings(max_examples=300, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 300)), min_size=1, max_size=4),
    extra=st.integers(0, 5000),
)
def test_per_model_reaches_the_effective_batch_exactly(groups: list[tuple[int, int]], extra: int) -> None:
    world = [Group(f"gpu{i}", ranks, largest) for i, (ranks, largest) in enumerate(groups)]
    size = sum(ranks for ranks, _ in groups)
    capacity = sum(ranks * largest for ranks, largest in groups)
    effective = size + extra
    steps = -(-effective // capacity)
    if effective < steps * size:  # a micro-step would be empty: refused, saying so
        with pytest.raises(PlanError, match="a micro-step would be empty"):
            mixed_plan(effective, world)
        return
    made = mixed_plan(effective, world)
    assert made.accumulation_steps == steps  # the fewest with capacity × steps >= E
    clamped = any(effective * largest < steps * capacity for _, largest in groups)
    assert made.achieved_effective_batch == effective == sum(sum(s) for s in _sizes(made))
    for group, (ranks, largest) in zip(made.groups, groups, strict=True):
        assert sum(r.rank_count for r in group.runs) == ranks and len(group.runs) <= 2
        samples = [r.samples for r in group.runs]
        assert max(samples) - min(samples) <= 1  # ranks of one model differ by a sample at most
        for run in group.runs:
            assert len(run.micro_batches) == steps
            assert all(1 <= m <= largest for m in run.micro_batches)
            assert max(run.micro_batches) - min(run.micro_batches) <= 1
            assert run.loss_weights == [size * m / effective for m in run.micro_batches]
            # In proportion to the model's answer (exactly, up to the rounding of one sample), unless
            # a model's share is below one sample per micro-step: it then gets that, and the others less.
            assert run.samples >= steps
            if not clamped:
                assert abs(run.samples - effective * largest / capacity) < 1
    # DDP averages over the ranks: the weights of all micro-steps of all ranks sum to the world size.
    total = math.fsum(w for rank in range(size) for w in made.for_rank(rank).loss_weights)
    assert math.isclose(total, size)


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 300)), min_size=1, max_size=4),
    per_rank=st.integers(1, 3000),
    policy=st.sampled_from(list(Policy)),
)
def test_uniform_is_the_single_model_plan_at_the_smallest_answer(
    groups: list[tuple[int, int]], per_rank: int, policy: Policy
) -> None:
    world = [Group(f"gpu{i}", ranks, largest) for i, (ranks, largest) in enumerate(groups)]
    size = sum(ranks for ranks, _ in groups)
    made = mixed_plan(per_rank * size, world, Mode.UNIFORM, policy)
    single = plan(per_rank * size, min(largest for _, largest in groups), size, policy)
    assert _sizes(made) == [single.micro_batches] * size
    assert made.for_rank(0).loss_weights == pytest.approx(single.loss_weights)


def test_one_micro_step_uses_the_answers_without_accumulation() -> None:
    world = [Group("a", 2, 10, without_accumulation=16), Group("b", 2, 4, without_accumulation=6)]
    made = mixed_plan(44, world)  # 2 × 16 + 2 × 6 = 44 without accumulation
    assert made.accumulation_steps == 1 and _sizes(made) == [[16], [16], [6], [6]]
    assert {g.verified_for for g in made.groups} == {"one-micro-step"}
    assert mixed_plan(45, world).accumulation_steps == 2  # past it: the accumulation answers, 2 steps
    unverified = [Group("a", 2, 10), Group("old", 2, 6, accumulation_verified=False)]
    with pytest.raises(PlanError, match="'old' was not verified with accumulation"):
        mixed_plan(40, unverified)


@pytest.mark.parametrize(
    ("effective", "groups", "mode", "policy", "message"),
    [
        (7, WORLD, "per-model", "fewest-steps", "less than the world size 8"),
        (64, [Group("a", 1, 8), Group("a", 1, 8)], "per-model", "fewest-steps", "'a' is given twice"),
        (64, [Group("a", 0, 8)], "per-model", "fewest-steps", "ranks must be at least 1"),
        (64, [Group("a", 1, 0)], "per-model", "fewest-steps", "max micro-batch must be at least 1"),
        (64, [], "per-model", "fewest-steps", "at least one group"),
        (1020, WORLD, "uniform", "fewest-steps", "not a multiple of world size 8: .* use 1016 or 1024"),
        (1024, WORLD, "per-model", "exact", "applies to mixed mode uniform only"),
        (1024, WORLD, "mixed", "fewest-steps", "unknown mixed mode 'mixed'"),
        (9, [Group("a", 8, 1)], "per-model", "fewest-steps", "a micro-step would be empty; .* at least 16"),
        (10**9, WORLD, "per-model", "fewest-steps", "more than the 10,000 planned"),
    ],
)
def test_bad_worlds_say_what_to_do(effective: int, groups: list[Group], mode: str, policy: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        mixed_plan(effective, groups, mode, policy)


# The gradient ----------------------------------------------------------------------------------------
def _ddp_gradient(made: MixedPlan, inputs: torch.Tensor, targets: torch.Tensor, weighted: bool) -> list[torch.Tensor]:
    """What the optimizer sees under DDP: each rank accumulates its micro-steps' weighted mean
    losses, then the gradients are averaged over the ranks. The ranks take the effective batch's
    samples in rank order."""
    torch.manual_seed(1)
    model = torch.nn.Linear(inputs.shape[1], 1).double()
    per_rank = []
    start = 0
    for rank in range(made.world_size):
        run = made.for_rank(rank)
        model.zero_grad()
        for size, weight in zip(run.micro_batches, run.loss_weights, strict=True):
            x, y = inputs[start : start + size], targets[start : start + size]
            start += size
            loss = torch.nn.functional.mse_loss(model(x), y)  # the mean over the micro-batch
            (loss * weight if weighted else loss / made.accumulation_steps).backward()
        per_rank.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert start == made.effective_batch
    averaged = [torch.stack(grads).mean(0) for grads in zip(*per_rank, strict=True)]  # DDP's all-reduce
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()  # the whole effective batch at once
    full = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [a - f for a, f in zip(averaged, full, strict=True)]


@pytest.mark.parametrize("mode", list(Mode))
def test_the_weighted_gradient_is_the_effective_batch_gradient(mode: Mode) -> None:
    # 2 ranks of a large model, 3 of a small one, 38 samples: 12 on each large rank, 5, 5 and 4 on
    # the small ones (a remainder within the model), micro-batches of 4, 2 and 1. Uniform: 25
    # samples, 5 per rank in micro-batches of 2, 2, 1.
    world = [Group("big", 2, 5), Group("small", 3, 2)]
    effective = 25 if mode is Mode.UNIFORM else 38
    made = mixed_plan(effective, world, mode)
    assert made.accumulation_steps == 3
    expected = [[2, 2, 1]] * 5 if mode is Mode.UNIFORM else [[4, 4, 4]] * 2 + [[2, 2, 1]] * 2 + [[2, 1, 1]]
    assert _sizes(made) == expected
    torch.manual_seed(0)
    inputs = torch.randn(effective, 6, dtype=torch.float64)
    targets = torch.randn(effective, 1, dtype=torch.float64)
    differences = _ddp_gradient(made, inputs, targets, weighted=True)
    assert all(torch.allclose(d, torch.zeros_like(d), atol=1e-12) for d in differences)
    if mode is Mode.PER_MODEL:  # the naive loss / steps is not the same gradient
        naive = _ddp_gradient(made, inputs, targets, weighted=False)
        assert not all(torch.allclose(d, torch.zeros_like(d), atol=1e-6) for d in naive)


def test_accumulate_across_ranks_computes_the_plans_weights() -> None:
    made = mixed_plan(38, [Group("big", 2, 5), Group("small", 3, 2)])
    ranks = AcrossRanks(world_size=made.world_size, total=lambda count: made.effective_batch)  # the all-reduce
    for rank in range(made.world_size):
        run = made.for_rank(rank)
        batches = [torch.zeros(size, 1) for size in run.micro_batches]
        weights = [step.weight for step in accumulate(batches, made.accumulation_steps, ranks=ranks)]
        assert weights == run.loss_weights


# The command line -------------------------------------------------------------------------------------
@pytest.fixture
def autotune(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.run(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke


def test_the_command_prints_what_each_rank_runs(autotune: Callable[..., tuple[int, str, str]]) -> None:
    args = ("plan", "--effective-batch", "1024", "--group", "H100-80GB:4:64", "--group", "A100-40GB:4:24")
    code, stdout, stderr = autotune(*args)
    assert code == 0, stderr
    assert "3 accumulation steps on every rank of 8: 4 × (62 × 3) + 4 × (24 + 23 × 2) = effective batch 1024" in stdout
    assert "H100-80GB ranks 0-3: micro-batches 62, 62, 62 (186 samples" in stdout
    assert "A100-40GB ranks 4-7: micro-batches 24, 23, 23 (70 samples" in stdout
    code, stdout, _ = autotune(*args, "--mixed", "uniform", "--json")
    assert code == 0
    document = MixedPlan.model_validate_json(stdout)
    assert document == mixed_plan(1024, WORLD, "uniform")
    code, _, stderr = autotune("plan", "--effective-batch", "1024", "--group", "nvidia:a100:x:4:24")
    assert code == 0, stderr  # a name with colons: the last two fields are the numbers


def _docs_session() -> tuple[list[str], list[str]]:
    (block,) = blocks(section("docs/accumulation.md", "Mixed GPU types"), "console")
    lines = block.splitlines()
    return [line[2:] for line in lines if line.startswith("$ ")], [line for line in lines if not line.startswith("$ ")]


def test_the_docs_example_prints_what_it_shows(autotune: Callable[..., tuple[int, str, str]]) -> None:
    commands, shown = _docs_session()
    printed = ""
    for command in commands:
        args = command.split()
        assert args[0] == "autotune"
        code, stdout, stderr = autotune(*args[1:])
        assert code == 0, stderr
        printed += stdout
    for line in shown:
        assert line in printed, f"{line!r} (docs/accumulation.md) not in the output:\n{printed}"


# The service ------------------------------------------------------------------------------------------
GiB = 2**30
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"
NET = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}
WORKLOADS = f"""\
[workloads.net]
target = "mlp"
options = {{ in_features = {NET["in_features"]}, hidden = {NET["hidden"]}, layers = 1, classes = 10 }}
"""


def _gpu_result(name: str, total: int, largest: int) -> dict[str, Any]:
    room = headroom_bytes(total, 0.05)
    result = make_result(
        options=NET,
        max_micro_batch=largest,
        total_bytes=total,
        headroom_bytes=room,
        device_kind="cuda",
        device_name=name,
        budget_policy="total",
    )
    return result.model_dump(mode="json")


def _serve(tmp_path: Path, body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS)
    settings = Settings(db=tmp_path / "mixed.db", workloads=workloads, cpu_memory=4 * 2**20)
    gpus = FakeNvml([FakeGpu(uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000", name=H100, total=80 * GiB)])
    app = create_app(settings, inventory=lambda: nvml.inventory(gpus))

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                for published in (
                    _gpu_result(H100, 80 * GiB - GiB // 2, 64),  # this node's cuda:0 (torch's total)
                    _gpu_result(A100, 40 * GiB - GiB // 2, 24),  # probed on another node, published here
                    make_result(options=NET, max_micro_batch=12).model_dump(mode="json"),  # cpu, 4 MiB
                ):
                    answer = await client.post("/v1/results", json=published)
                    assert answer.status_code == 201, answer.text
                await body(client)

    asyncio.run(scenario())


def test_the_service_plans_a_world_of_two_gpu_models(tmp_path: Path) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        groups = [{"device": "cuda:0", "ranks": 4}, {"device": "A100-SXM4-40GB", "ranks": 4}]
        query = {"workload": "net", "effective_batch": 1024, "groups": groups}
        answer = await client.post("/v1/plan/mixed", json=query)
        assert answer.status_code == 200, answer.text
        view = answer.json()
        assert [(g["name"], g["model"], g["max_micro_batch"]) for g in view["groups"]] == [
            ("cuda:0", H100, 64),
            ("A100-SXM4-40GB", A100, 24),
        ]
        made = MixedPlan.model_validate(view["plan"])
        assert _sizes(made) == [[62, 62, 62]] * 4 + [[24, 23, 23]] * 4
        uniform = {**query, "mode": "uniform"}
        assert (await client.post("/v1/plan/mixed", json=uniform)).json()["plan"]["accumulation_steps"] == 6
        # The same device twice (here the budget device at its default size): named apart.
        twice = [{"device": "cpu", "ranks": 1}, {"device": "cpu", "ranks": 1, "memory": "4MiB"}]
        answer = await client.post("/v1/plan/mixed", json={"workload": "net", "effective_batch": 30, "groups": twice})
        assert [g["name"] for g in answer.json()["plan"]["groups"]] == ["cpu [0]", "cpu [1]"]

    _serve(tmp_path, body)


def test_the_service_names_the_groups_it_cannot_answer(tmp_path: Path) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        def query(*groups: dict[str, Any], effective: int = 64) -> dict[str, Any]:
            return {"workload": "net", "effective_batch": effective, "groups": list(groups)}

        h100 = {"device": "cuda:0", "ranks": 2}
        v100 = {"device": "Tesla V100-SXM2-16GB", "ranks": 2}
        small_cpu = {"device": "cpu", "ranks": 1, "memory": "3MiB"}
        answer = await client.post("/v1/plan/mixed", json=query(h100, v100, small_cpu))
        assert answer.status_code == 409, answer.text
        missing = answer.json()
        assert missing["code"] == "no_result"
        assert [(m["index"], m["device"]) for m in missing["missing"]] == [(1, v100["device"]), (2, "cpu")]
        assert "groups[1] (Tesla V100-SXM2-16GB), groups[2] (cpu)" in missing["detail"]
        assert missing["missing"][0]["request_key"] is None and "--publish" in missing["missing"][0]["reason"]
        assert missing["missing"][1]["request_key"] and "GET /v1/plan" in missing["missing"][1]["reason"]

        # A parallel job's ranks hold something else: results of plain jobs do not answer it.
        a100 = {"device": "A100-SXM4-40GB", "ranks": 4}
        answer = await client.post("/v1/plan/mixed", json={**query(h100, a100), "parallel": "fsdp"})
        assert answer.status_code == 409, answer.text
        assert [m["index"] for m in answer.json()["missing"]] == [0, 1]
        assert "parallel fsdp over 6 ranks" in answer.json()["missing"][1]["reason"]
        answer = await client.post(
            "/v1/plan/mixed", json={**query({"device": "cuda:0", "ranks": 1}), "parallel": "fsdp"}
        )
        assert answer.status_code == 422 and "2 or more ranks" in answer.text
        answer = await client.post("/v1/plan/mixed", json=query(h100, {"device": "cuda:3", "ranks": 1}))
        assert (answer.status_code, answer.json()["code"]) == (404, "no_such_device")
        assert answer.json()["detail"].startswith("groups[1] (cuda:3): no device cuda:3")
        answer = await client.post("/v1/plan/mixed", json=query(h100, {"device": "NVIDIA", "ranks": 1}))
        assert answer.status_code == 422 and "matches several GPU models" in answer.json()["detail"]
        answer = await client.post("/v1/plan/mixed", json=query(h100, effective=1))
        assert answer.status_code == 422 and "less than the world size 2" in answer.json()["detail"]
        answer = await client.post("/v1/plan/mixed", json={**query(h100), "groups": []})
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "groups"]
        answer = await client.post("/v1/plan/mixed", json=query({"device": "cuda:0", "ranks": 2, "memory": "1TiB"}))
        assert answer.status_code == 422 and answer.json()["detail"].startswith("groups[0] (cuda:0): memory")
        assert (await client.post("/v1/plan/mixed", json={**query(h100), "workload": "nope"})).status_code == 404
        document = (await client.get("/openapi.json")).json()
        operation = document["paths"]["/v1/plan/mixed"]["post"]
        assert set(operation["responses"]) == {"200", "404", "409", "413", "422", "503"}  # 503: starting, draining
        schema = operation["responses"]["409"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/MixedPlanMissing"}

    _serve(tmp_path, body)
