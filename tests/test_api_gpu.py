"""The service on a (simulated) GPU node: NVML through the stand-in module, probes through a fake
runner, the app in-process over httpx's ASGI transport with its lifespan. There is no GPU on CI;
what is tested is the service's side: device numbering, one probe at a time per GPU and GPUs in
parallel, request keys for GPU models, and 404s for GPUs the node lacks.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from api import create_app
from api.devices import snapshot
from autotune.devices import nvml
from autotune.engine.probe import ProbeRequest
from autotune.results import DeviceInfo, LoopShape, ProbeResult, TrialRecord, Versions, WorkloadRef
from autotune.settings import Settings
from autotune.units import headroom_bytes
from tests.nvml_standin import FakeGpu, FakeNvml
from tests.serving import WORKLOADS_TOML, make_result

GiB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
UUIDS = ("GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000")


def _fake_nvml() -> FakeNvml:
    return FakeNvml([FakeGpu(uuid=u, name=H100, total=80 * GiB, reserved=GiB // 2, used=GiB) for u in UUIDS])


def _torch_total() -> int:
    return 80 * GiB - GiB // 2  # what torch reports: NVML's total minus the driver's reserved memory


class FakeRunner:
    """Stands in for run_isolated: reports two trials, sleeps, answers as a CUDA probe would."""

    def __init__(self, seconds: float = 0.3) -> None:
        self.seconds = seconds
        self.calls: list[tuple[ProbeRequest, float, float]] = []
        self._lock = threading.Lock()

    def __call__(self, request: ProbeRequest, timeout: float, on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
        started = time.monotonic()
        for batch in (1, 2):
            on_trial(TrialRecord(batch=batch, fits=True, seconds=0.01))
        time.sleep(self.seconds)
        with self._lock:
            self.calls.append((request, started, time.monotonic()))
        total = _torch_total()
        budget = request.memory or total
        assert request.headroom is not None
        room = headroom_bytes(budget, request.headroom)
        return ProbeResult(
            fingerprint=hashlib.sha256(request.model_dump_json().encode()).hexdigest(),
            workload=WorkloadRef(
                target=request.target,
                options=request.options,
                precision=request.precision or "fp32",
                optimizer=request.optimizer or "adamw",
                steps=request.steps,
            ),
            device=DeviceInfo(kind="cuda", name=H100, index=0, total_bytes=total),
            budget_policy="memory" if request.memory else "total",
            budget_bytes=budget,
            headroom_bytes=room,
            limit_bytes=budget - room,
            max_micro_batch=16,
            capped=True,
            max_batch_cap=request.max_batch,
            loop=LoopShape(micro_steps=2),
            trials=[TrialRecord(batch=b, fits=True, seconds=0.01, micro_steps=2) for b in (1, 2, 4, 8, 16)],
            versions=Versions(autotune="0.1.0", torch="2.13.0", cuda="13.0", python="3.12"),
        )


def _run(tmp_path: Path, runner: FakeRunner, body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS_TOML)
    settings = Settings(db=tmp_path / "gpu.db", workloads=workloads)
    app = create_app(settings, inventory=lambda: nvml.inventory(_fake_nvml()), runner=runner)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                await body(client)

    asyncio.run(scenario())


async def _finished(client: httpx.AsyncClient, probe_id: str) -> dict[str, Any]:
    for _ in range(200):
        view: dict[str, Any] = (await client.get(f"/v1/probes/{probe_id}")).json()
        if view["status"] in ("succeeded", "failed"):
            return view
        await asyncio.sleep(0.02)
    raise AssertionError(f"probe {probe_id} did not finish")


def test_devices_lists_the_gpus_as_cuda_will_number_them(tmp_path: Path) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        answer = (await client.get("/v1/devices")).json()
        assert answer["nvml_available"] is True
        assert [g["id"] for g in answer["gpus"]] == ["cuda:0", "cuda:1"]
        assert [g["uuid"] for g in answer["gpus"]] == list(UUIDS)
        assert answer["gpus"][0]["total_bytes"] == 80 * GiB
        assert answer["gpus"][0]["reserved_bytes"] == GiB // 2
        assert answer["budget_device"]["id"] == "cpu"
        assert (await client.get("/readyz")).json()["devices"] == ["cuda:0", "cuda:1", "cpu"]
        assert (await client.get("/readyz")).json()["gpus"] is None

    _run(tmp_path, FakeRunner(), body)


def test_a_request_without_a_device_probes_cuda_0_with_everything_explicit(tmp_path: Path) -> None:
    runner = FakeRunner(seconds=0.0)

    async def body(client: httpx.AsyncClient) -> None:
        created = await client.post("/v1/probes", json={"workload": "tiny"})
        assert created.status_code == 202
        view = await _finished(client, created.json()["id"])
        assert (view["status"], view["device"]) == ("succeeded", "cuda:0")
        assert [t["batch"] for t in view["trials"]] == [1, 2]

    _run(tmp_path, runner, body)
    (request, _, _), *_ = runner.calls
    assert (request.device, request.budget, request.memory, request.headroom) == ("cuda:0", "total", None, 0.05)
    assert (request.precision, request.optimizer, request.max_batch) == ("fp32", "adamw", 16)


def test_one_probe_at_a_time_per_gpu_and_gpus_in_parallel(tmp_path: Path) -> None:
    runner = FakeRunner(seconds=0.3)

    async def body(client: httpx.AsyncClient) -> None:
        requests = [
            {"workload": "tiny", "device": "cuda:0", "memory": "10GiB"},
            {"workload": "tiny", "device": "cuda:0", "memory": "20GiB"},
            {"workload": "tiny", "device": "cuda:1", "memory": "30GiB"},
        ]
        created = await asyncio.gather(*(client.post("/v1/probes", json=r) for r in requests))
        assert [c.status_code for c in created] == [202, 202, 202]
        depth = (await client.get("/v1/devices")).json()["gpus"]
        assert [g["queue_depth"] for g in depth] == [2, 1]
        views = [await _finished(client, c.json()["id"]) for c in created]
        assert {v["status"] for v in views} == {"succeeded"}
        metrics = (await client.get("/metrics")).text
        assert 'autotune_probes_started_total{device="cuda:0"} 2.0' in metrics
        assert 'autotune_probe_queue_depth{device="cuda:0"} 0.0' in metrics

    _run(tmp_path, runner, body)
    spans = {device: [(s, e) for r, s, e in runner.calls if r.device == device] for device in ("cuda:0", "cuda:1")}
    (a_start, a_end), (b_start, _) = sorted(spans["cuda:0"])
    assert b_start >= a_end  # the second probe of cuda:0 started after the first ended
    (c_start, c_end) = spans["cuda:1"][0]
    assert c_start < a_end and a_start < c_end  # cuda:1 ran while cuda:0 did


def test_the_same_request_for_two_gpus_of_one_model_shares_one_probe(tmp_path: Path) -> None:
    runner = FakeRunner(seconds=0.2)

    async def body(client: httpx.AsyncClient) -> None:
        first = await client.post("/v1/probes", json={"workload": "tiny", "device": "cuda:0"})
        second = await client.post("/v1/probes", json={"workload": "tiny", "device": "cuda:1"})
        assert second.json()["id"] == first.json()["id"]  # same model, same limit: the same answer
        await _finished(client, first.json()["id"])
        stored = await client.post("/v1/probes", json={"workload": "tiny", "device": "cuda:1"})
        assert stored.status_code == 200

    _run(tmp_path, runner, body)
    assert len(runner.calls) == 1


def test_a_gpu_the_node_lacks_is_a_404_refusal(tmp_path: Path) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        answer = await client.post("/v1/probes", json={"workload": "tiny", "device": "cuda:2"})
        assert answer.status_code == 404
        assert answer.json()["code"] == "no_such_device"
        assert "this node has 2 GPU(s)" in answer.json()["detail"]
        plan = await client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 8, "device": "cuda:7"})
        assert plan.status_code == 404
        assert plan.json()["code"] == "no_such_device"
        too_much = await client.post("/v1/probes", json={"workload": "tiny", "memory": "100GiB"})
        assert too_much.status_code == 422
        assert "more than the device has" in too_much.json()["detail"]

    _run(tmp_path, FakeRunner(), body)


def _published(name: str, total: int) -> dict[str, Any]:
    room = headroom_bytes(total, 0.05)
    # Its fingerprint is the one a probe of tiny's model would report: POST /v1/results checks it.
    result = make_result(
        options={"in_features": 64, "hidden": 64, "layers": 1, "classes": 10},
        total_bytes=total,
        headroom_bytes=room,
        device=DeviceInfo(kind="cuda", name=name, index=0, uuid="GPU-elsewhere", total_bytes=total),
        budget_policy="total",
        max_micro_batch=16,
        capped=True,
        max_batch_cap=16,
        trials=[TrialRecord(batch=b, fits=True, seconds=0.01, micro_steps=2) for b in (1, 2, 4, 8, 16)],
        versions=Versions(autotune="0.1.0", torch="2.13.0", cuda="13.0", python="3.12"),
    )
    return result.model_dump(mode="json")


def test_a_result_probed_in_a_pod_on_the_same_gpu_model_answers_every_gpu_of_the_node(tmp_path: Path) -> None:
    runner = FakeRunner()

    async def body(client: httpx.AsyncClient) -> None:
        stored = await client.post("/v1/results", json=_published(H100, _torch_total()))
        assert stored.status_code == 201, stored.text
        for device in ("cuda:0", "cuda:1"):
            plan = await client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 64, "device": device})
            assert plan.status_code == 200, plan.text
            assert plan.json()["plan"]["micro_batches"] == [16, 16, 16, 16]

    _run(tmp_path, runner, body)
    assert runner.calls == []


def test_a_result_from_another_gpu_model_does_not(tmp_path: Path) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        other = _published("NVIDIA A100-SXM4-80GB", 79 * GiB)
        assert (await client.post("/v1/results", json=other)).status_code == 201
        plan = await client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 64})
        assert plan.status_code == 202  # a probe of this node's H100 is needed

    _run(tmp_path, FakeRunner(seconds=0.0), body)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("1", [1]),
        ("GPU-cccc", [2]),  # a UUID prefix, as CUDA accepts
        ("0,7,1", [0]),  # CUDA stops at the first entry it cannot match
        ("", []),
    ],
)
def test_cuda_visible_devices_numbers_the_gpus(visible: str | None, expected: list[int]) -> None:
    gpus = [FakeGpu(uuid=f"GPU-{c * 8}-0000", total=40 * GiB, reserved=GiB) for c in "abc"]
    numbered = snapshot(nvml.inventory(FakeNvml(gpus)), visible)
    assert [d.nvml_index for d in numbered.devices] == expected
    assert [d.id for d in numbered.devices] == [f"cuda:{i}" for i in range(len(expected))]
    assert all(d.total_bytes == 39 * GiB for d in numbered.devices)


def test_a_gpu_in_mig_mode_is_its_first_instance() -> None:
    instance = FakeGpu(uuid="MIG-1111", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", total=10 * GiB, reserved=0)
    gpu = FakeGpu(uuid="GPU-2222", mig_mode=1, mig_slots=[instance])
    (device,) = snapshot(nvml.inventory(FakeNvml([gpu])), None).devices
    assert (device.mig, device.uuid, device.total_bytes) == (True, "MIG-1111", 10 * GiB)


def test_without_nvml_the_node_has_the_budget_device_and_says_why() -> None:
    numbered = snapshot(nvml.Inventory(available=False, reason="no driver here"))
    assert numbered.devices == ()
    assert numbered.reason == "no driver here"
