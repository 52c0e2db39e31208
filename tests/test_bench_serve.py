"""bench/serve.py at its smallest: 2 workers (the multi-process path), one client count, half a second
of load per endpoint (the load keeps both cores busy; the assertions need only some answers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_serve_smallest_run(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = ["--workers", "2", "--clients", "2", "--duration", "0.5", "--warmup", "0.1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())

    cores = doc["machine"]["cpus"]
    assert cores >= 1
    assert f"{cores} CPU cores" in done.stdout
    assert doc["settings"]["workers"] == [2]
    assert doc["settings"]["clients"] == [2]
    assert doc["plan"]["micro_batches"]

    results = {(m["endpoint"], m["workers"], m["clients"]): m for m in doc["results"]}
    assert set(results) == {(e, w, 2) for e in ("bare", "plan") for w in (2,)}
    for m in results.values():
        assert m["requests"] > 0
        assert m["errors"] == 0
        assert m["requests_per_second"] > 0
        assert 0 < m["p50_ms"] <= m["p99_ms"] <= m["max_ms"]
        assert m["server_cpu_us_per_request"] is None or m["server_cpu_us_per_request"] > 0

    # Every plan query answered from a stored result, counted over all of the service's workers.
    assert [run["workers"] for run in doc["runs"]] == [2]
    for run in doc["runs"]:
        assert run["plan_requests_sent"] > 0
        assert run["plan_queries"] == run["plan_requests_sent"] == run["plan_cache_hits"]

    assert set(doc["plan_vs_bare"]) == {"2"}
    assert doc["plan_vs_bare"]["2"]["2"] > 0
    assert set(doc["server_cpu_per_request_plan_vs_bare"]) == {"2"}
    scaling = doc["scaling_vs_fewest_workers"]
    assert scaling["base_workers"] == 2
    assert scaling["plan"]["2"]["2"] == scaling["bare"]["2"]["2"] == 1.0
