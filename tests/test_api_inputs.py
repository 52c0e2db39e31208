"""Bad input against a real server: 404 for unknown things, 422 with details for invalid ones,
404 (code no_such_device) for a device the node lacks, 413 for a body over the bound, and never a
500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import Server, make_result, running_server

TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A small body bound, so the 413 test need not send a megabyte.
    with running_server(tmp_path_factory.mktemp("inputs"), env={"AUTOTUNE_MAX_BODY": "16KiB"}) as started:
        with started.client() as client:
            # A stored result for tiny on the default 4 MiB device: plan queries are answered from it.
            published = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16)
            answer = client.post("/v1/results", json=published.model_dump(mode="json"))
            assert answer.status_code == 201, answer.text
        yield started


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client() as opened:
        yield opened


def _locs(answer: httpx.Response) -> list[list[Any]]:
    return [e["loc"] for e in answer.json()["detail"]]


@pytest.mark.parametrize(
    ("body", "code", "where"),
    [
        ({"workload": "nope"}, 404, None),
        ({"workload": "../etc/passwd"}, 422, ["body", "workload"]),
        ({"workload": "tiny", "target": "os:system"}, 422, ["body", "target"]),  # no request may name code
        ({"workload": "tiny", "options": {"hidden": 10**6}}, 422, ["body", "options"]),
        ({"workload": "tiny", "memory": "lots"}, 422, ["body", "memory"]),
        ({"workload": "tiny", "memory": True}, 422, ["body", "memory"]),
        ({"workload": "tiny", "memory": -5}, 422, ["body", "memory"]),
        ({"workload": "tiny", "memory": [1]}, 422, ["body", "memory"]),
        ({"workload": "tiny", "memory": "1TiB"}, 422, None),  # more than AUTOTUNE_MAX_CPU_MEMORY
        ({"workload": "tiny", "memory": "4MiB", "headroom": "8MiB"}, 422, None),  # leaves nothing
        ({"workload": "tiny", "headroom": 1.5}, 422, ["body", "headroom"]),
        ({"workload": "tiny", "headroom": "200%"}, 422, ["body", "headroom"]),
        ({"workload": "tiny", "headroom": -1}, 422, ["body", "headroom"]),
        ({"workload": "tiny", "steps": 0}, 422, ["body", "steps"]),
        ({"workload": "tiny", "steps": 1000}, 422, ["body", "steps"]),
        ({"workload": "tiny", "max_batch": 0}, 422, ["body", "max_batch"]),
        ({"workload": "tiny", "precision": "fp8"}, 422, ["body", "precision"]),
        ({"workload": "tiny", "optimizer": "lion"}, 422, ["body", "optimizer"]),
        ({"workload": "tiny", "budget": "some"}, 422, ["body", "budget"]),
        ({"workload": "tiny", "device": "gpu"}, 422, ["body", "device"]),
        ({"workload": "tiny", "device": "cuda"}, 404, None),
        ({"workload": "tiny", "device": "cuda:3"}, 404, None),
        ({"workload": "tiny", "refresh": "maybe"}, 422, ["body", "refresh"]),
        ({}, 422, ["body", "workload"]),
        ([], 422, ["body"]),
        ("tiny", 422, ["body"]),
    ],
)
def test_bad_probe_requests(client: httpx.Client, body: Any, code: int, where: list[Any] | None) -> None:
    answer = client.post("/v1/probes", json=body)
    assert answer.status_code == code, answer.text
    detail = answer.json()["detail"]
    if where is not None:
        assert where in _locs(answer)
    else:
        assert isinstance(detail, str)
        assert detail  # a message a person can act on


@pytest.mark.parametrize("headroom", [5, 5.0, 1, 2**30])
def test_a_bare_number_of_headroom_is_refused_as_the_command_line_refuses_it(
    client: httpx.Client, headroom: Any
) -> None:
    """ "headroom": 5 was 5 bytes, where `--headroom 5` is refused: 5 is more likely 5% than 5 bytes."""
    shown = f"{headroom:g}" if isinstance(headroom, float) else str(headroom)
    answers = [
        client.post("/v1/probes", json={"workload": "tiny", "headroom": headroom}),
        client.post("/v1/run-failures", json={"workload": "tiny", "micro_batch": 12, "headroom": headroom}),
        client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 24, "headroom": shown}),
    ]
    for answer, where in zip(answers, (["body", "headroom"], ["body", "headroom"], ["query", "headroom"]), strict=True):
        assert answer.status_code == 422, answer.text
        errors = [e for e in answer.json()["detail"] if e["loc"] == where]
        assert errors, answer.text
        assert f"did you mean {float(shown):g}%?" in errors[0]["msg"], errors[0]["msg"]
    # A fraction, a percentage and a size with its unit are what headroom is: here the stored
    # result's 5% of 4 MiB, spelled three ways.
    for fine in ("0.05", "5%", "209715B"):
        answer = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 24, "headroom": fine})
        assert answer.status_code == 200, (fine, answer.text)


def test_a_request_for_a_gpu_on_a_node_without_one_says_why(client: httpx.Client) -> None:
    answer = client.post("/v1/probes", json={"workload": "tiny", "device": "cuda:0"})
    assert answer.status_code == 404
    assert answer.json()["code"] == "no_such_device"
    assert "no device cuda:0" in answer.json()["detail"]
    assert "NVML" in answer.json()["detail"] or "GPU" in answer.json()["detail"]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"not json at all",
        b'{"workload": "tiny", "headroom": NaN}',
        b'{"workload": "tiny", "headroom": Infinity}',
        b'{"workload": "tiny", "memory": 1e400}',
        b'{"workload": "\xff\xfe"}',
        b"\xff\xfe\xfd",
        b'{"workload": "tiny", "memory": 99999999999999999999999999999999999999}',
    ],
)
def test_malformed_bodies_are_422_not_500(client: httpx.Client, raw: bytes) -> None:
    answer = client.post("/v1/probes", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"]


def test_a_body_over_the_bound_is_413(client: httpx.Client) -> None:
    big = {"workload": "tiny", "padding": "x" * 20_000}
    assert client.post("/v1/probes", json=big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"workload": "tiny", "padding": "'
        for _ in range(40):
            yield b"x" * 1000
        yield b'"}'

    streamed = client.post("/v1/probes", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


@pytest.mark.parametrize(
    ("params", "code", "where"),
    [
        ({"workload": "tiny"}, 422, ["query", "effective_batch"]),
        ({"workload": "tiny", "effective_batch": 0}, 422, ["query", "effective_batch"]),
        ({"workload": "tiny", "effective_batch": -3}, 422, ["query", "effective_batch"]),
        ({"workload": "tiny", "effective_batch": "many"}, 422, ["query", "effective_batch"]),
        ({"workload": "tiny", "effective_batch": 2**40}, 422, ["query", "effective_batch"]),
        ({"workload": "tiny", "effective_batch": 64, "world_size": 0}, 422, ["query", "world_size"]),
        ({"workload": "tiny", "effective_batch": 64, "policy": "fastest"}, 422, ["query", "policy"]),
        ({"workload": "tiny", "effective_batch": 64, "wait": -1}, 422, ["query", "wait"]),
        ({"workload": "tiny", "effective_batch": 64, "wait": "nan"}, 422, ["query", "wait"]),
        ({"workload": "tiny", "effective_batch": 64, "wait": 10**6}, 422, ["query", "wait"]),
        ({"workload": "tiny", "effective_batch": 64, "memory": "lots"}, 422, ["query", "memory"]),
        ({"workload": "tiny", "effective_batch": 64, "headroom": "x%"}, 422, ["query", "headroom"]),
        ({"workload": "tiny", "effective_batch": 64, "device": "tpu"}, 422, ["query", "device"]),
        ({"workload": "tiny", "effective_batch": 64, "precision": "int4"}, 422, ["query", "precision"]),
        ({"workload": "nope", "effective_batch": 64}, 404, None),
        ({"workload": "", "effective_batch": 64}, 422, ["query", "workload"]),
        ({"workload": "tiny", "effective_batch": 64, "device": "cuda:1"}, 404, None),
        ({"workload": "tiny", "effective_batch": 65, "world_size": 2}, 422, None),  # not a multiple
        ({"workload": "tiny", "effective_batch": 2**20}, 422, None),  # 87382 steps of 12
        ({"workload": "tiny", "effective_batch": 1048573, "policy": "exact", "world_size": 1}, 422, None),
    ],
)
def test_bad_plan_queries(client: httpx.Client, params: dict[str, Any], code: int, where: list[Any] | None) -> None:
    answer = client.get("/v1/plan", params=params)
    assert answer.status_code == code, answer.text
    if where is not None:
        assert where in _locs(answer)
    else:
        assert isinstance(answer.json()["detail"], str)


def test_an_impossible_plan_fails_before_any_probe_starts(client: httpx.Client) -> None:
    # Nothing is stored for 3.5 MiB; the plan's arithmetic is checked before a probe would start.
    answer = client.get(
        "/v1/plan", params={"workload": "tiny", "effective_batch": 7, "world_size": 2, "memory": "3.5MiB"}
    )
    assert answer.status_code == 422
    assert "multiple of world size" in answer.json()["detail"]
    assert client.get("/v1/devices").json()["budget_device"]["queue_depth"] == 0


def test_the_stored_result_answers_plan_queries(client: httpx.Client) -> None:
    answer = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 24})
    assert answer.status_code == 200
    assert answer.json()["plan"]["micro_batches"] == [12, 12]


def _valid_result(**changes: Any) -> dict[str, Any]:
    document = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16)
    body = document.model_dump(mode="json")
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"limit_bytes": 5}, "limit_bytes must equal"),
        ({"fingerprint": "not-hex"}, "fingerprint"),
        ({"schema_version": 7}, "schema_version"),
        ({"max_micro_batch": 13}, "no fitting trial"),
        ({"trials": []}, "no fitting trial"),
    ],
)
def test_published_results_that_break_the_searchs_guarantees_are_422(
    client: httpx.Client, changes: dict[str, Any], message: str
) -> None:
    answer = client.post("/v1/results", json=_valid_result(**changes))
    assert answer.status_code == 422, answer.text
    assert any(message in e["msg"] for e in answer.json()["detail"])


def test_published_results_must_validate_and_be_for_a_registered_workload(client: httpx.Client) -> None:
    missing = _valid_result()
    del missing["device"]
    assert client.post("/v1/results", json=missing).status_code == 422
    assert client.post("/v1/results", json={"fingerprint": "ab"}).status_code == 422
    nan = json.dumps(_valid_result()).replace('"step_seconds": 0.05', '"step_seconds": NaN')
    assert "NaN" in nan
    answer = client.post("/v1/results", content=nan, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    unknown = client.post("/v1/results", json=_valid_result(workload={**_valid_result()["workload"], "target": "x:y"}))
    assert unknown.status_code == 404
    assert "register it" in unknown.json()["detail"]


def test_a_published_result_is_stored_and_readable(client: httpx.Client) -> None:
    answer = client.post("/v1/results", json=_valid_result())
    assert answer.status_code == 201, answer.text
    assert answer.headers["location"] == "/v1/results/" + _valid_result()["fingerprint"]
    assert answer.json()["workload"] == "tiny"
    stored = client.get(answer.headers["location"])
    assert stored.status_code == 200
    assert stored.json()["source"] == "published"
    assert client.get("/v1/results/" + "ef" * 32).status_code == 404
    assert client.get("/v1/results/zz").status_code == 404


def test_unknown_paths_and_methods(client: httpx.Client) -> None:
    assert client.get("/v2/plan").status_code == 404
    assert client.delete("/v1/probes").status_code == 405
    assert client.put("/v1/results").status_code == 405


_jsonish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
_fields = st.sampled_from(
    ["workload", "device", "memory", "headroom", "budget", "precision", "optimizer", "steps", "max_batch", "refresh"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(_fields, _jsonish, max_size=5) | _jsonish | st.binary(max_size=64))
def test_no_probe_body_produces_a_500(client: httpx.Client, body: Any) -> None:
    if isinstance(body, dict) and body.get("workload") in ("tiny", "nofit", "mlp", "cnn", "gpt"):
        body["workload"] = "unregistered"  # valid requests would start real probes
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = client.post("/v1/probes", content=content, headers={"content-type": "application/json"})
    assert answer.status_code < 500, answer.text


_query_value = st.text(max_size=12) | st.integers(-(2**70), 2**70).map(str) | st.sampled_from(["nan", "inf", "1e9"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    params=st.dictionaries(
        st.sampled_from(["effective_batch", "world_size", "policy", "wait"]),
        _query_value,
        max_size=6,
    )
)
def test_no_plan_query_produces_a_500(client: httpx.Client, params: dict[str, str]) -> None:
    # Always the stored workload and device, so that no valid query starts a probe.
    params = {**params, "workload": "tiny", "wait": "0"}
    answer = client.get("/v1/plan", params=params)
    assert answer.status_code in (200, 422), answer.text
