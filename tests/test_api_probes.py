"""The service against a real server: probe -> poll -> plan, deduplication, stored answers,
failures, devices, workloads, readiness and metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serving import Server, finished_probe, metric, running_server, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("probes")) as started:
        yield started


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as opened:
        yield opened


def test_probe_then_poll_then_plan(server: Server, client: httpx.Client) -> None:
    created = client.post("/v1/probes", json={"workload": "tiny"})
    assert created.status_code == 202, created.text
    probe_id = created.json()["id"]
    assert created.headers["location"] == f"/v1/probes/{probe_id}"
    assert created.json()["status"] in ("queued", "running")

    # Poll: trials appear while the probe runs, and the server keeps answering meanwhile.
    seen_running_trials = 0
    slowest_health = 0.0
    deadline = time.monotonic() + 60
    view = created.json()
    while view["status"] not in ("succeeded", "failed") and time.monotonic() < deadline:
        started = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        slowest_health = max(slowest_health, time.perf_counter() - started)
        view = client.get(f"/v1/probes/{probe_id}").json()
        if view["status"] == "running":
            seen_running_trials = max(seen_running_trials, len(view["trials"]))
        time.sleep(0.02)
    assert view["status"] == "succeeded", server.output()
    assert seen_running_trials >= 1, "no trial was visible while the probe ran"
    assert slowest_health < 1.0
    result = view["result"]
    assert result["max_micro_batch"] == 16  # the registered cap fits
    assert result["capped"] is True
    assert [t["batch"] for t in view["trials"]] == [t["batch"] for t in result["trials"]]

    answer = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 64})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["fingerprint"] == result["fingerprint"]
    assert body["plan"]["micro_batches"] == [16, 16, 16, 16]
    assert body["plan"]["loss_weights"] == [0.25] * 4
    # The stored result's verdict (the CLI's too), with the plan's micro-batch: each confirmed in a fresh process.
    verdict = body["verdict"]
    assert verdict["status"] == result["verdict"]["status"] == "confirmed"
    assert verdict["answers"][:-1] == result["verdict"]["answers"]
    assert verdict["answers"][-1]["answer"] == "plan" and verdict["answers"][-1]["micro_batch"] == 16
    assert verdict["answers"][-1]["confirmed"] is True

    picture = client.get(f"/v1/probes/{probe_id}/plot.png")
    assert picture.status_code == 200, picture.text
    assert picture.headers["content-type"] == "image/png"
    assert picture.content.startswith(b"\x89PNG\r\n\x1a\n")
    missing = client.get("/v1/probes/" + "0" * 32 + "/plot.png")
    assert missing.status_code == 404

    ragged = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 100, "world_size": 2})
    assert ragged.json()["plan"]["micro_batches"] == [13, 13, 12, 12]  # 50 per rank in 4 steps
    exact = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 100, "policy": "exact"})
    assert exact.json()["plan"]["micro_batches"] == [10] * 10

    # The same request again: the stored result, no new probe; refresh runs one.
    again = client.post("/v1/probes", json={"workload": "tiny"})
    assert again.status_code == 200
    assert again.json()["result"]["fingerprint"] == result["fingerprint"]
    refreshed = client.post("/v1/probes", json={"workload": "tiny", "refresh": True})
    assert refreshed.status_code == 202
    assert refreshed.json()["id"] != probe_id
    assert finished_probe(client, refreshed.json()["id"])["status"] == "succeeded"


def test_a_parallel_job_is_probed_and_planned_per_rank_of_its_setup(client: httpx.Client) -> None:
    base = {"workload": "tiny", "effective_batch": 64, "wait": 60}
    refused = client.get("/v1/plan", params={**base, "parallel": "fsdp"})
    assert refused.status_code == 422 and "world_size" in refused.text
    views = {
        # The client waits longer than the service may block (wait=60), so a slow probe is a 202, not a
        # timeout of the test's own.
        name: client.get("/v1/plan", params={**base, **query}, timeout=120)
        for name, query in (("plain", {}), ("ddp", {"parallel": "ddp", "world_size": 2}),
                            ("fsdp", {"parallel": "fsdp", "world_size": 2, "reshard_after_forward": "false"}))
    }  # fmt: skip
    assert all(v.status_code == 200 for v in views.values()), {k: v.text for k, v in views.items()}
    body = {name: view.json() for name, view in views.items()}
    assert body["plain"]["parallel"]["strategy"] == "none"
    assert body["ddp"]["parallel"]["strategy"] == "ddp"
    assert body["fsdp"]["parallel"] == {
        "strategy": "fsdp",
        "world_size": 2,
        "reshard_after_forward": False,
        "sharding": "per-block",
    }
    # Each setup its own probe and result: no setup answers for another.
    assert len({b["fingerprint"] for b in body.values()}) == 3
    assert body["ddp"]["plan"]["world_size"] == 2


def test_the_client_plans_a_mixed_world_from_stored_results(server: Server) -> None:
    from autotune.client import AutotuneClient
    from autotune.errors import ServiceError

    with AutotuneClient(server.url) as autotune:
        single = autotune.plan("tiny", 16)  # stored by then, or probed now
        groups = [{"device": "cpu", "ranks": 2}, {"device": "cpu", "ranks": 1, "memory": "4MiB"}]
        made = autotune.plan_mixed("tiny", 96, groups)
        assert made.world_size == 3 and made.achieved_effective_batch == 96
        assert made.for_rank(2).micro_batches[0] <= single.micro_batch
        with pytest.raises(ServiceError, match=r"groups\[0\] \(cpu\)") as missing:
            autotune.plan_mixed("tiny", 96, groups, parallel="fsdp")  # over 3 ranks: none stored
        assert missing.value.status_code == 409


def test_a_plan_with_nothing_stored_starts_a_probe_and_can_wait_for_it(server: Server, client: httpx.Client) -> None:
    params = {"workload": "tiny", "effective_batch": 32, "memory": "3MiB"}
    pending = client.get("/v1/plan", params=params)
    assert pending.status_code == 202, pending.text
    probe = pending.json()["probe"]
    assert pending.headers["location"] == f"/v1/probes/{probe['id']}"
    assert probe["status"] in ("queued", "running")
    assert client.get("/v1/plan", params=params).json()["probe"]["id"] == probe["id"]  # no second probe

    waited = client.get("/v1/plan", params={**params, "wait": 60}, timeout=90)
    assert waited.status_code == 200, waited.text
    assert waited.json()["plan"]["micro_batches"] == [16, 16]
    view = client.get(f"/v1/probes/{probe['id']}").json()
    assert view["result"]["device"]["total_bytes"] == 3 * 2**20  # the memory asked for


def test_fifty_identical_concurrent_requests_run_one_probe(server: Server, client: httpx.Client) -> None:
    started_before = metric(client, "autotune_probes_started_total", 'device="cpu"')
    body = {"workload": "tiny", "memory": "5MiB"}

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30) as many:
            return await asyncio.gather(*(many.post("/v1/probes", json=body) for _ in range(50)))

    answers = asyncio.run(burst())
    assert {a.status_code for a in answers} == {202}
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    assert finished_probe(client, ids.pop())["status"] == "succeeded"
    assert metric(client, "autotune_probes_started_total", 'device="cpu"') == started_before + 1
    assert client.post("/v1/probes", json=body).status_code == 200


def test_a_failing_probe_reports_why_and_its_plan_answers_409(server: Server, client: httpx.Client) -> None:
    created = client.post("/v1/probes", json={"workload": "nofit"})
    assert created.status_code == 202
    view = finished_probe(client, created.json()["id"])
    assert view["status"] == "failed"
    assert view["error"]["type"] == "NothingFitsError"
    assert "batch 1" in view["error"]["message"]
    assert view["result"] is None

    # The failure would repeat: a plan query answers it at once instead of probing again.
    started = metric(client, "autotune_probes_started_total", 'device="cpu"')
    answer = client.get("/v1/plan", params={"workload": "nofit", "effective_batch": 8})
    assert answer.status_code == 409
    assert answer.json()["probe"]["id"] == view["id"]
    assert "failed" in answer.json()["detail"]
    assert metric(client, "autotune_probes_started_total", 'device="cpu"') == started
    assert metric(client, "autotune_probes_total", 'outcome="nothing_fits"') >= 1


def test_unknown_probes_are_404(client: httpx.Client) -> None:
    assert client.get("/v1/probes/" + "0" * 32).status_code == 404
    assert client.get("/v1/probes/not-an-id").status_code == 404
    assert client.get("/v1/probes/" + "x" * 5000).status_code == 404


def test_workloads_lists_the_file_and_the_builtins(client: httpx.Client) -> None:
    answer = client.get("/v1/workloads")
    assert answer.status_code == 200
    by_name = {w["name"]: w for w in answer.json()}
    assert {"tiny", "nofit", "mlp", "cnn", "gpt"} <= set(by_name)
    assert by_name["tiny"]["options"] == {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}
    assert by_name["tiny"]["max_batch"] == 16
    assert by_name["cnn"]["optimizer"] == "sgd"


def test_devices_without_nvml_is_the_budget_device_with_the_reason(client: httpx.Client) -> None:
    answer = client.get("/v1/devices")
    assert answer.status_code == 200
    body = answer.json()
    assert body["nvml_available"] is False
    assert body["gpus"] == []
    assert body["reason"]
    assert body["budget_device"]["id"] == "cpu"
    assert body["budget_device"]["total_bytes"] == 4 * 2**20


def test_health_readiness_metrics_and_openapi(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["store"] is True
    assert ready.json()["devices"] == ["cpu"]
    assert ready.json()["gpus"], "readiness must say why no GPU is listed"
    text = client.get("/metrics").text
    for name in (
        "autotune_probes_total",
        "autotune_probe_seconds_bucket",
        "autotune_probe_queue_depth",
        "autotune_plan_requests_total",
        "autotune_plan_cache_hits_total",
    ):
        assert name in text
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/plan", "/v1/probes", "/v1/probes/{probe_id}", "/v1/results", "/v1/devices"} <= set(paths)


def test_plan_queries_count_requests_and_cache_hits(client: httpx.Client) -> None:
    wait_for(
        lambda: client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 64}).status_code == 200,
        60,
        "a stored tiny result",
    )
    requests, hits = metric(client, "autotune_plan_requests_total"), metric(client, "autotune_plan_cache_hits_total")
    for _ in range(5):
        assert client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 48}).status_code == 200
    assert metric(client, "autotune_plan_requests_total") == requests + 5
    assert metric(client, "autotune_plan_cache_hits_total") == hits + 5
