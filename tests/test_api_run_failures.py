"""A run that ran out of memory at a planned micro-batch tells the service, which lowers the stored
answer for that query below the size, keeps the report with the result, and survives a restart."""

from __future__ import annotations

from pathlib import Path

from autotune.client import AutotuneClient
from autotune.plans.accumulate import ShrinkEvent
from tests.serving import make_result, running_server, start_server

TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}
PLAN = "/v1/plan?workload=tiny&effective_batch=48&device=cpu"


def test_a_run_oom_lowers_the_answer_for_later_plans_and_persists(tmp_path: Path, database: str) -> None:
    with running_server(tmp_path, db=database) as server:
        with server.client() as http:
            published = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16)
            assert http.post("/v1/results", json=published.model_dump(mode="json")).status_code == 201
            assert http.get(PLAN).json()["plan"]["micro_batches"] == [12, 12, 12, 12]
        with AutotuneClient(server.url) as client:
            answer = client.report_run_oom(
                "tiny", 12, message="CUDA out of memory. Tried to allocate 2.0 MiB.", device="cpu"
            )
            assert answer["max_micro_batch"] == 11
            # The guard's callback reports what it shrank from, without raising into the loop.
            report = client.shrink_reporter("tiny", device="cpu")
            report(ShrinkEvent(window=3, old_micro_batch=11, new_micro_batch=6, message="out of memory", micro_steps=4))
            # A rank that shrank because another rank ran out did not fail at its size: not reported.
            report(ShrinkEvent(4, old_micro_batch=10, new_micro_batch=5, message="rank 1 ran out", ran_out=False))
        with server.client() as http:
            plan = http.get(PLAN).json()
            assert plan["max_micro_batch"] == 10
            assert plan["plan"]["micro_batches"] == [10, 10, 10, 9, 9]
            stored = http.get(f"/v1/results/{published.fingerprint}").json()["result"]
            assert [f["micro_batch"] for f in stored["run_failures"]] == [12, 11]
            missing = http.post(
                "/v1/run-failures", json={"workload": "tiny", "micro_batch": 4, "device": "cpu", "memory": "8MiB"}
            )
            assert missing.status_code == 404, missing.text
    restarted = start_server(tmp_path, db=server.db)
    try:
        with restarted.client() as http:
            assert http.get(PLAN).json()["max_micro_batch"] == 10
    finally:
        restarted.stop()
