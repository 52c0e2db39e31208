"""Many server processes on one store: two "nodes" on one PostgreSQL server, and
`autotune serve --workers 4` on one SQLite file. 100 identical concurrent requests start one probe
between them; a result stored through one process answers queries on every other."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from autotune.store import Store
from tests.serving import Server, make_result, metric, start_server, wait_for

TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}
QUERY = {"workload": "tiny", "effective_batch": 32}


def _ask_at_once(urls: Sequence[str], count: int) -> list[httpx.Response]:
    """`count` identical plan queries, spread round-robin over `urls`, as concurrently as threads go."""
    clients = [httpx.Client(base_url=url, timeout=60.0) for url in urls]
    try:
        with ThreadPoolExecutor(max_workers=32) as pool:
            return list(pool.map(lambda n: clients[n % len(clients)].get("/v1/plan", params=QUERY), range(count)))
    finally:
        for client in clients:
            client.close()


def _one_probe_answers_everyone(servers: Sequence[Server], urls: Sequence[str], db: str) -> None:
    answers = _ask_at_once(urls, 100)
    assert {a.status_code for a in answers} <= {200, 202}, [a.text for a in answers if a.status_code >= 300][:3]
    probe_ids = {a.json()["probe"]["id"] for a in answers if a.status_code == 202}
    assert len(probe_ids) == 1, probe_ids

    # Every process answers from the one result once it is stored.
    with httpx.Client(base_url=urls[0], timeout=60.0) as client:
        wait_for(lambda: client.get("/v1/plan", params=QUERY).status_code == 200, 90, "the probe's result", servers[0])
    for url in urls:
        with httpx.Client(base_url=url, timeout=60.0) as client:
            answer = client.get("/v1/plan", params=QUERY)
            assert answer.status_code == 200, answer.text

    store = Store(db)
    try:
        assert store.count_jobs() == 1
        assert store.count_jobs("succeeded") == 1
    finally:
        store.close()
    started = 0.0
    for server in servers:
        with server.client() as client:
            started += metric(client, "autotune_probes_started_total", 'device="cpu"')
    assert started == 1


def _published_on_one_is_answered_by_the_other(first: str, second: str, max_micro_batch: int) -> None:
    # The same request key as the probe's: the other process has the probe's result cached and
    # must learn of the replacement (within AUTOTUNE_CACHE_TTL, 2 s).
    published = make_result(options=TINY, max_micro_batch=max_micro_batch, max_batch_cap=16)
    with httpx.Client(base_url=first, timeout=30.0) as client:
        stored = client.post("/v1/results", json=published.model_dump(mode="json"))
        assert stored.status_code == 201, stored.text
    # No keep-alive: each query is a new connection, which any worker of a node may accept.
    with httpx.Client(base_url=second, timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:

        def answered() -> bool:
            plan = client.get("/v1/plan", params=QUERY)
            assert plan.status_code == 200, plan.text
            return bool(plan.json()["fingerprint"] == published.fingerprint)

        wait_for(answered, 10, "the published result to answer on the other process")
        # Then it is the answer whichever worker answers: 20 queries in a row, once every worker's
        # refresher has looked (one AUTOTUNE_CACHE_TTL, 2 s; a loaded machine may take longer).
        wait_for(lambda: all(answered() for _ in range(20)), 60, "every worker to answer the published result")


def test_two_nodes_on_one_postgresql_share_jobs_and_results(tmp_path: Path, postgres_db: str) -> None:
    nodes = [
        start_server(tmp_path / name, db=postgres_db, env={"AUTOTUNE_NODE": name}) for name in ("node-a", "node-b")
    ]
    try:
        urls = [node.url for node in nodes]
        _one_probe_answers_everyone(nodes, urls, postgres_db)
        _published_on_one_is_answered_by_the_other(urls[0], urls[1], 12)
        _published_on_one_is_answered_by_the_other(urls[1], urls[0], 11)
    finally:
        for node in nodes:
            node.stop()
    for node in nodes:
        assert "Traceback" not in node.output(), node.output()


def test_four_workers_on_one_sqlite_file_start_one_probe(tmp_path: Path) -> None:
    db = tmp_path / "autotune.db"
    server = start_server(tmp_path / "node", db=db, workers=4, startup_timeout=120)
    try:
        _one_probe_answers_everyone([server], [server.url], str(db))
        # Each request lands on whichever worker accepts it: a result published through one is
        # answered by all.
        _published_on_one_is_answered_by_the_other(server.url, server.url, 12)
    finally:
        server.stop()
    assert "Traceback" not in server.output(), server.output()
