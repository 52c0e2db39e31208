"""The service's memory: plot PNGs drawn once per result and kept (bounded), and the plan-query
memo bounded in entries and in the size of what it keys on, keyed by the normalised query."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path

import httpx
from starlette.requests import Request

from api import create_app, v1
from api.cache import PlotCache, ResultCache
from api.schemas import PlanQuery
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.plot import render_plot
from autotune.results import ProbeResult, RunFailure
from autotune.settings import Settings
from autotune.store import StoredResult
from tests.serving import WORKLOADS_TOML, make_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}


def _probed() -> ProbeResult:
    """A real probe's result (trials, prediction, curve): what the service draws."""
    return run_probe(
        ProbeRequest(target="tests.predict_workloads:plain", device="cpu", memory=2**20, headroom=0, search="predict")
    )


def test_the_second_fetch_of_a_plot_is_served_from_the_cache() -> None:
    result = _probed()
    cache = PlotCache()

    async def twice() -> tuple[bytes, bytes, float, float]:
        started = time.perf_counter()
        first = await cache.get(result, render_plot)
        drawn = time.perf_counter() - started
        started = time.perf_counter()
        second = await cache.get(result, render_plot)
        return first, second, drawn, time.perf_counter() - started

    first, second, drawn, cached = asyncio.run(twice())
    assert first.startswith(PNG_MAGIC)
    assert second == first
    assert (cache.stats.renders, cache.stats.hits) == (1, 1)
    assert cached < drawn / 10  # a dictionary lookup against a quarter of a second of drawing


def test_concurrent_requests_for_one_plot_draw_it_once() -> None:
    result = _probed()
    cache = PlotCache()

    async def together() -> list[bytes]:
        return await asyncio.gather(*(cache.get(result, render_plot) for _ in range(5)))

    pictures = asyncio.run(together())
    assert len(set(pictures)) == 1
    assert (cache.stats.renders, cache.stats.joined, cache.stats.hits) == (1, 4, 0)


def test_a_changed_result_is_drawn_again_and_the_cache_is_bounded() -> None:
    result = _probed()
    cache = PlotCache(size=2)
    lowered = result.lowered_by_run(RunFailure(micro_batch=result.max_micro_batch, accumulates=True))
    assert lowered.fingerprint == result.fingerprint  # same model, new answer: a new picture

    async def draw_all() -> None:
        await cache.get(result, render_plot)
        await cache.get(lowered, render_plot)
        await cache.get(make_result(fingerprint="cd" * 32), render_plot)
        await cache.get(make_result(fingerprint="cd" * 32), render_plot)  # another created_at: drawn again

    asyncio.run(draw_all())
    assert cache.stats.renders == 4
    assert len(cache) == 2


def test_the_same_result_stored_again_keeps_its_version_and_a_new_one_does_not() -> None:
    """A worker caches its probe's result, then the store records it a moment later; the refresher
    reads that record back. The plans made in between must stay the result's plans (the status page
    lists them by version): only a new probe or a lowering is a new version."""
    result = make_result(max_micro_batch=12)
    cache = ResultCache()
    first = cache.put("k", StoredResult(result=result, source="probe", stored_at=result.created_at))
    later = result.created_at + timedelta(milliseconds=3)
    again = cache.put("k", StoredResult(result=result.model_copy(deep=True), source="probe", stored_at=later))
    assert again.version == first.version and again.stored.stored_at == later
    lowered = result.lowered_by_run(RunFailure(micro_batch=12, accumulates=True))
    assert cache.put("k", StoredResult(result=lowered, source="probe", stored_at=later)).version > first.version
    newer = make_result(max_micro_batch=12)  # probed again: another created_at
    assert cache.put("k", StoredResult(result=newer, source="probe", stored_at=later)).version > first.version + 1
    assert cache.put("other", StoredResult(result=result, source="probe", stored_at=later)).version != first.version
    # Two results with the same answer and as many run failures, lowered differently: their plans differ.
    capped = newer.model_copy(update={"capped": not newer.capped})
    assert cache.put("k", StoredResult(result=capped, source="published", stored_at=later)).version > first.version + 2


def _request(query: bytes) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/v1/plan", "query_string": query, "headers": []})


def test_padded_plan_queries_leave_the_memo_bounded() -> None:
    """5,000 distinct queries, padded with unknown parameters and '+' (spaces): the memo keeps at
    most MEMO_ENTRIES of them, none longer than MEMO_MAX_QUERY, in about 2 MiB."""
    v1._QUERIES.clear()
    base = b"workload=tiny&effective_batch=64&memory=128MiB"
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        for i in range(5_000):
            if i % 2:  # a long unknown parameter: never memoised
                query = base + b"&pad=" + str(i).encode() + b"x" * 600
            else:  # short enough to be memoised, all distinct, up to the bound
                query = base + b"&p" + str(i).encode() + b"=1" + b"+" * (i % 400)
            assert v1._plan_query(_request(query)).memory == 128 * 2**20
        seconds = time.perf_counter() - started
        gc.collect()
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(v1._QUERIES) == v1.MEMO_ENTRIES
    assert all(len(raw) <= v1.MEMO_MAX_QUERY for raw in v1._QUERIES)
    assert held < 3 * 2**20, held  # bytes still allocated after 5,000 queries: the memo's entries
    assert seconds < 10, seconds
    v1._QUERIES.clear()


def test_a_long_query_is_answered_but_not_memoised() -> None:
    v1._QUERIES.clear()
    long = b"workload=tiny&effective_batch=8&" + b"+" * 1000
    assert v1._plan_query(_request(long)).effective_batch == 8
    assert long not in v1._QUERIES
    assert len(v1._QUERIES) == 0


def test_two_spellings_of_one_size_are_one_query_and_one_plan(tmp_path: Path) -> None:
    """memory=4MiB and memory=4194304: equal normalised queries, one resolved key, one cached plan."""
    v1._QUERIES.clear()
    spellings = (b"memory=4MiB", b"memory=4194304", b"memory=4096KiB")
    queries = [v1._plan_query(_request(b"workload=tiny&effective_batch=24&" + s)) for s in spellings]
    assert queries[0] == queries[1] == queries[2]
    assert len({hash(q) for q in queries}) == 1
    assert isinstance(queries[0], PlanQuery)

    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS_TOML)
    settings = Settings(db=str(tmp_path / "plans.db"), workloads=workloads, cpu_memory=4 * 2**20, token=None)
    app = create_app(settings)
    published = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16).model_dump(mode="json")

    async def scenario() -> tuple[list[httpx.Response], int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                assert (await client.post("/v1/results", json=published)).status_code == 201
                answers = []
                for spelling in spellings:
                    query = b"workload=tiny&effective_batch=24&" + spelling
                    answers.append(await client.get("/v1/plan?" + query.decode()))
                return answers, len(app.state.service.plans._entries)

    answers, plans = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].content == answers[1].content == answers[2].content
    assert plans == 1
    v1._QUERIES.clear()
