"""Faults leave the truth intact: a store that cannot be written (a full disk), a damaged or empty
database file at start-up.

The full disk is made real for the server's process alone: its file-size limit (RLIMIT_FSIZE,
set from outside with prlimit) drops to one byte, so every write SQLite attempts fails as on a
full disk while reads go on; raising the limit again is the disk freed.
"""

from __future__ import annotations

import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving import ROOT, finished_probe, free_port, make_result, running_server, wait_for, with_held

TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}


def _row_status(db: Path, job_id: str) -> str:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = con.execute("SELECT status FROM jobs WHERE id=?", (job_id,)).fetchone()
    finally:
        con.close()
    return str(row[0])


def test_a_full_disk_keeps_job_states_true_and_readiness_honest(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # the probe stays after its first trial until the disk is full
    with running_server(tmp_path, workloads=with_held(gate)) as server, server.client() as client:
        db = Path(server.db)
        published = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16)
        assert client.post("/v1/results", json=published.model_dump(mode="json")).status_code == 201
        probe = client.post("/v1/probes", json={"workload": "held"}).json()
        wait_for(
            lambda: client.get(f"/v1/probes/{probe['id']}").json()["trials"], 60, "the probe's first trial", server
        )

        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (1, hard))  # the disk is full
        try:
            ready = client.get("/readyz")
            assert ready.status_code == 503
            assert "cannot be written" in ready.json()["problems"][0]

            # The probe finishes while nothing can be written: its answer is still the truth.
            gate.unlink()
            done = finished_probe(client, probe["id"], timeout=120)
            assert done["status"] == "succeeded", done["error"]
            assert done["result"]["max_micro_batch"] >= 1
            assert _row_status(db, probe["id"]) == "running"  # the database could not say so yet
            plan = client.get("/v1/plan", params={"workload": "held", "effective_batch": 8})
            assert plan.status_code == 200, plan.text  # answered from memory
            assert plan.json()["fingerprint"] == done["result"]["fingerprint"]

            # What needs a write is refused plainly, and nothing stored before is lost.
            refused = client.post("/v1/probes", json={"workload": "nofit"})
            assert refused.status_code == 503
            assert "database" in refused.json()["detail"]
            old = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 32})
            assert old.status_code == 200
            assert old.json()["fingerprint"] == published.fingerprint
        finally:
            resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (hard, hard))  # space again

        wait_for(lambda: client.get("/readyz").status_code == 200, 15, "readiness after the disk has room", server)
        wait_for(lambda: _row_status(db, probe["id"]) == "succeeded", 15, "the outcome to be recorded", server)
        assert client.get(f"/v1/probes/{probe['id']}").json()["status"] == "succeeded"
        assert client.post("/v1/probes", json={"workload": "nofit"}).status_code == 202


def _serve(tmp_path: Path, db: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "AUTOTUNE_DB": str(db), "HOME": str(tmp_path)}
    # A free port: `serve` checks that it can listen before it opens the store (a fixed one collided
    # when two suites ran on one machine).
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", "serve", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _scribble_over_pages(path: Path) -> None:
    """Bytes overwritten inside every page after the first: quick_check then reports several
    findings in one row of several lines ("*** in database main ***", then one per finding)."""
    data = bytearray(path.read_bytes())
    noise = bytes((n * 97 + 13) % 256 for n in range(50))
    for page in range(2, len(data) // 4096):
        data[page * 4096 + 100 : page * 4096 + 150] = noise
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(b""), "is an empty file (0 bytes)"),
        (lambda p: p.write_bytes(p.read_bytes()[:4096] + b"\x00garbage" * 2000), "is damaged"),
        (_scribble_over_pages, "more such findings): restore it from a backup"),
    ],
    ids=["empty", "damaged", "damaged-pages"],
)
def test_serve_refuses_a_damaged_or_empty_database_in_one_line(tmp_path: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    from autotune.store import Store

    db = tmp_path / "autotune.db"
    store = Store(db)
    for n in range(50):
        store.put_result(make_result(fingerprint=f"{n:064x}"), f"k{n}", source="probe")
    store.close()
    sqlite3.connect(db).execute("PRAGMA wal_checkpoint(TRUNCATE)").close()
    damage(db)
    done = _serve(tmp_path, db)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(db) in lines[0]
    assert message in lines[0]
    assert lines[0].rstrip().endswith("to start an empty store"), lines[0]  # whole, not cut mid-word
    assert "***" not in lines[0]
    assert "Traceback" not in done.stderr
