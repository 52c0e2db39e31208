"""With AUTOTUNE_TOKEN set, every /v1 endpoint needs the bearer token; /healthz, /readyz and
/metrics stay open."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.serving import Server, running_server

TOKEN = "s3cret-token"
ENDPOINTS = [
    ("GET", "/v1/devices", None),
    ("GET", "/v1/workloads", None),
    ("GET", "/v1/plan?workload=nope&effective_batch=8", None),
    ("GET", "/v1/probes/" + "0" * 32, None),
    ("GET", "/v1/results/" + "0" * 64, None),
    ("POST", "/v1/probes", {"workload": "nope"}),
    ("POST", "/v1/results", {}),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("auth"), token=TOKEN) as started:
        yield started


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer wrong",
        f"Basic {TOKEN}",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
    ],
)
def test_v1_refuses_a_missing_or_wrong_token(
    server: Server, method: str, path: str, body: object, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    answer = httpx.request(method, server.url + path, json=body, headers=headers, timeout=10)
    assert answer.status_code == 401, answer.text
    assert answer.headers["www-authenticate"] == "Bearer"
    assert "token" in answer.json()["detail"]


def test_a_header_outside_ascii_is_a_401_not_an_error(server: Server) -> None:
    headers = [(b"Authorization", b"Bearer \xff\xfe\xc3\xa9")]
    answer = httpx.get(server.url + "/v1/workloads", headers=headers, timeout=10)
    assert answer.status_code == 401


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
def test_v1_accepts_the_token(server: Server, method: str, path: str, body: object) -> None:
    with server.client(token=TOKEN) as client:
        answer = client.request(method, path, json=body)
    assert answer.status_code != 401, answer.text
    assert answer.status_code < 500, answer.text


def test_the_scheme_is_case_insensitive(server: Server) -> None:
    answer = httpx.get(server.url + "/v1/workloads", headers={"Authorization": f"bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_operations_endpoints_stay_open(server: Server, path: str) -> None:
    assert httpx.get(server.url + path, timeout=10).status_code == 200
