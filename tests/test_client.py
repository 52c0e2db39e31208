"""The client: status codes to our exceptions, waiting with backoff, retries, the local fallback,
and against a real server, `autotune probe --publish` answering a later job's plan query."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from autotune import errors
from autotune.client import AutotuneClient
from autotune.plans.plan import Policy, plan
from tests.serving import ROOT, WORKLOADS_TOML, Server, free_port, make_result, metric, running_server

PLAN = plan(64, 16).model_dump(mode="json")


class FakeTime:
    """The client's clock and sleep: a sleep is recorded and moves the clock, at once."""

    def __init__(self, sleeps: list[float]) -> None:
        self.sleeps = sleeps
        self.now = 1000.0

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def _client(
    handler: Callable[[httpx.Request], httpx.Response], sleeps: list[float] | None = None, **kwargs: Any
) -> AutotuneClient:
    fake = FakeTime(sleeps if sleeps is not None else [])
    return AutotuneClient(
        "http://autotune.test",
        token=kwargs.pop("token", None),
        transport=httpx.MockTransport(handler),
        sleep=fake.sleep,
        clock=fake.clock,
        backoff=kwargs.pop("backoff", 0.25),
        **kwargs,
    )


def _no_local_probe(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Local probes the client would start (each raises): the test asserts there were none."""
    started: list[str] = []

    def local(_client: AutotuneClient, workload: str, *_args: object, **_kwargs: object) -> None:
        started.append(workload)
        raise AssertionError("probed locally while the service was up")

    monkeypatch.setattr(AutotuneClient, "_local_plan", local)
    return started


def _degraded(code: str, retry_after: int = 2) -> httpx.Response:
    body = {"detail": f"{code} for a while", "code": code, "retry_after": retry_after}
    return httpx.Response(503, json=body, headers={"Retry-After": str(retry_after)})


def _pending(status: str = "running") -> httpx.Response:
    probe = {"id": "a" * 32, "status": status, "workload": "tiny", "device": "cpu", "request_key": "k", "trials": []}
    return httpx.Response(202, json={"status": status, "detail": "probing", "probe": probe})


def test_a_stored_plan_is_returned_and_the_query_says_what_was_asked() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"plan": PLAN, "workload": "tiny"})

    with _client(handler, token="t0k") as client:
        got = client.plan("tiny", 64, world_size=1, policy="exact", device="cpu", memory="4MiB")
    assert got.micro_batches == [16, 16, 16, 16]
    assert client.last_source == "service"
    query = dict(seen[0].url.params)
    assert query["workload"] == "tiny"
    assert query["effective_batch"] == "64"
    assert query["policy"] == "exact"
    assert query["memory"] == "4MiB"
    assert float(query["wait"]) > 0
    assert seen[0].headers["authorization"] == "Bearer t0k"


def test_a_plan_whose_answers_were_not_confirmed_is_refused_unless_allowed() -> None:
    verdict = {"status": "not-confirmed", "exit_code": 4, "answers": [], "note": "the fresh process peaked lower"}
    answer = {"plan": PLAN, "workload": "tiny", "verdict": verdict}
    with _client(lambda _r: httpx.Response(200, json=answer)) as client:
        with pytest.raises(errors.UnconfirmedError, match=r"not confirmed \(the fresh process peaked lower\).*allow_"):
            client.plan("tiny", 64, device="cpu")
        assert client.plan("tiny", 64, device="cpu", allow_unconfirmed=True).micro_batches == [16, 16, 16, 16]
    confirmed = {**answer, "verdict": {**verdict, "status": "confirmed", "exit_code": 0}}
    with _client(lambda _r: httpx.Response(200, json=confirmed)) as client:
        assert client.plan("tiny", 64, device="cpu").micro_batch == 16


def test_a_running_probe_is_waited_for_with_growing_backoff() -> None:
    answers = iter([_pending("queued"), _pending(), _pending(), httpx.Response(200, json={"plan": PLAN})])
    sleeps: list[float] = []
    with _client(lambda _r: next(answers), sleeps) as client:
        assert client.plan("tiny", 64).accumulation_steps == 4
    assert sleeps == [0.25, 0.5, 1.0]


def test_a_probe_still_running_at_the_timeout_raises_and_is_not_a_reason_to_fall_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_local(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("fell back while the service was probing")

    monkeypatch.setattr(AutotuneClient, "_local_plan", no_local)
    with (
        _client(lambda _r: _pending()) as client,
        pytest.raises(errors.ServiceUnavailableError, match="still running"),
    ):
        client.plan("tiny", 64, timeout=0, fallback="local")


def test_a_failed_probe_raises_the_error_it_failed_with() -> None:
    probe = {
        "id": "b" * 32,
        "status": "failed",
        "error": {"type": "NothingFitsError", "message": "even batch 1 does not fit"},
    }
    answer = httpx.Response(409, json={"detail": "the probe for this plan failed", "probe": probe})
    with _client(lambda _r: answer) as client, pytest.raises(errors.NothingFitsError, match=r"b{32}.*batch 1"):
        client.plan("tiny", 64)


@pytest.mark.parametrize(
    ("status", "body", "exception", "message"),
    [
        (401, {"detail": "wrong bearer token"}, errors.AuthError, "wrong bearer token"),
        (404, {"detail": "workload 'x' is not registered"}, errors.ServiceError, "not registered"),
        (
            422,
            {"detail": [{"loc": ["query", "effective_batch"], "msg": "must be >= 1"}]},
            errors.ServiceError,
            "query.effective_batch: must be >= 1",
        ),
        (500, {"detail": "boom"}, errors.ServiceUnavailableError, "500"),
    ],
)
def test_refusals_become_our_exceptions(
    status: int, body: dict[str, Any], exception: type[errors.ServiceError], message: str
) -> None:
    with (
        _client(lambda _r: httpx.Response(status, json=body)) as client,
        pytest.raises(exception, match=message) as info,
    ):
        client.plan("x", 64)
    assert info.value.status_code == status
    if status != 500:
        assert not isinstance(info.value, errors.ServiceUnavailableError)


def test_an_unreachable_service_is_retried_with_backoff_then_unavailable() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    sleeps: list[float] = []
    with (
        _client(handler, sleeps, retries=3) as client,
        pytest.raises(errors.ServiceUnavailableError, match="cannot reach"),
    ):
        client.plan("tiny", 64)
    assert calls == 4
    assert sleeps == [0.25, 0.5, 1.0]


def test_a_503_then_an_answer_is_retried() -> None:
    answers = iter([httpx.Response(503, json={"detail": "busy"}), httpx.Response(200, json={"plan": PLAN})])
    with _client(lambda _r: next(answers)) as client:
        assert client.plan("tiny", 64).micro_batch == 16


def test_a_device_the_node_lacks_is_a_refusal_not_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_local(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("probed locally for a device the service's node does not have")

    monkeypatch.setattr(AutotuneClient, "_local_plan", no_local)
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(
            404, json={"detail": "no device cuda:5: this node has 1 GPU(s)", "code": "no_such_device"}
        )

    sleeps: list[float] = []
    with (
        _client(handler, sleeps) as client,
        pytest.raises(errors.NoSuchDeviceError, match="no device cuda:5") as info,
    ):
        client.plan("tiny", 64, device="cuda:5", fallback="local")
    assert info.value.status_code == 404
    assert not isinstance(info.value, errors.ServiceUnavailableError)
    assert (len(requests), sleeps) == (1, [])  # at once: no retry


def test_a_store_outage_is_waited_for_up_to_the_deadline_and_never_probed_beside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """503 store_unavailable is the service saying it is up: its probe goes on. The client asks
    again after Retry-After (or its backoff, whichever is longer, at most max_backoff) until its own
    timeout, then raises; fallback="local" does not start a probe beside the service's."""
    local = _no_local_probe(monkeypatch)
    calls = 0

    def handler(_request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return _degraded("store_unavailable", retry_after=2)

    sleeps: list[float] = []
    with (
        _client(handler, sleeps, retries=2, max_backoff=8) as client,
        pytest.raises(errors.ServiceUnavailableError, match=r"store_unavailable.*no local probe") as info,
    ):
        client.plan("tiny", 64, timeout=120, fallback="local")
    assert local == []
    assert info.value.status_code == 503
    assert calls > 10  # far beyond the 3 tries (2 retries) that a store outage used to get
    assert sleeps[:6] == [2, 2, 2, 2, 4, 8] and max(sleeps) == 8  # Retry-After, then the backoff, capped
    assert sum(sleeps) == pytest.approx(120)


def test_a_lost_worker_is_waited_for_through_cut_connections_409_interrupted_and_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker running the probe is killed (issue 38): the long poll's connection is cut, the
    node's workers restart (refused, then `starting`), an older service says 409 `Interrupted`.
    The client, told 202 a moment before, waits through all of it and never probes locally."""
    local = _no_local_probe(monkeypatch)
    interrupted = {
        "id": "c" * 32,
        "status": "failed",
        "error": {"type": "Interrupted", "message": "interrupted: the worker running it stopped; ask for it again"},
    }
    answers: list[Any] = [_pending(), "cut", *["refused"] * 6, _degraded("starting", 1)]
    answers += [httpx.Response(409, json={"detail": "the probe for this plan failed", "probe": interrupted})]
    answers += [_pending("queued"), httpx.Response(200, json={"plan": PLAN})]
    steps = iter(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(steps)
        if answer == "cut":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if answer == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        return answer  # type: ignore[no-any-return]

    with _client(handler, retries=1) as client:
        assert client.plan("tiny", 64, fallback="local", timeout=300).micro_batch == 16
    assert (local, client.last_source) == ([], "service")
    assert next(steps, None) is None  # every answer was asked for


@pytest.mark.parametrize("code", ["store_unavailable", "starting", "draining", "device_unavailable"])
def test_a_degraded_service_is_waited_for_until_it_answers(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _no_local_probe(monkeypatch)
    answers = iter([_degraded(code)] * 6 + [_pending(), httpx.Response(200, json={"plan": PLAN})])
    with _client(lambda _r: next(answers), retries=0) as client:
        assert client.plan("tiny", 64, fallback="local").micro_batch == 16
    assert (local, client.last_source) == ([], "service")


def test_a_restart_is_not_an_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The service said "draining", then refused connections while it restarted: still waited for."""
    local = _no_local_probe(monkeypatch)
    answers: list[Any] = [_degraded("draining")] + ["refused"] * 8 + [_degraded("starting", 1)]
    answers.append(httpx.Response(200, json={"plan": PLAN}))
    steps = iter(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(steps)
        if answer == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        return answer  # type: ignore[no-any-return]

    with _client(handler, retries=1) as client:
        assert client.plan("tiny", 64, fallback="local").micro_batch == 16
    assert local == []


@pytest.mark.parametrize(
    "down",
    [
        lambda request: (_ for _ in ()).throw(httpx.ConnectError("connection refused", request=request)),
        lambda request: (_ for _ in ()).throw(httpx.ConnectTimeout("timed out", request=request)),
        lambda _request: httpx.Response(502, text="<html>Bad Gateway</html>"),
        lambda _request: httpx.Response(503, text="no healthy upstream"),
    ],
    ids=["refused", "timeout", "proxy-502", "proxy-503-not-ours"],
)
def test_only_a_service_that_is_down_is_replaced_by_a_local_probe(
    down: Callable[[httpx.Request], httpx.Response], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def local(_client: AutotuneClient, workload: str, *_args: object, **_kwargs: object) -> Any:
        asked.append(workload)
        return plan(64, 16)

    monkeypatch.setattr(AutotuneClient, "_local_plan", local)
    sleeps: list[float] = []
    with _client(down, sleeps, retries=2) as client:
        assert client.plan("tiny", 64, fallback="local").micro_batch == 16
        assert client.last_source == "local"
    assert asked == ["tiny"]
    assert sleeps == [0.25, 0.5]  # a few retries first, then at once: down is down


def test_bad_arguments_fail_before_any_request() -> None:
    with pytest.raises(errors.ConfigError, match="http://"):
        AutotuneClient("autotune:8000")
    with _client(lambda _r: httpx.Response(500)) as client:
        with pytest.raises(errors.ConfigError, match="fallback"):
            client.plan("tiny", 64, fallback="maybe")  # type: ignore[arg-type]
        with pytest.raises(errors.PlanError, match="policy"):
            client.plan("tiny", 64, policy="fastest")


def test_probe_waits_for_the_job_and_returns_its_result() -> None:
    result = make_result().model_dump(mode="json")
    views = iter(
        [
            httpx.Response(202, json={"id": "c" * 32, "status": "queued"}),
            httpx.Response(200, json={"id": "c" * 32, "status": "running"}),
            httpx.Response(200, json={"id": "c" * 32, "status": "succeeded", "result": result}),
        ]
    )
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return next(views)

    with _client(handler) as client:
        got = client.probe("tiny", memory="4MiB")
    assert got.fingerprint == result["fingerprint"]
    assert json.loads(requests[0].content) == {"workload": "tiny", "memory": "4MiB", "refresh": False}
    assert [r.url.path for r in requests[1:]] == ["/v1/probes/" + "c" * 32] * 2


def test_the_local_fallback_probes_the_registered_workload_in_this_job(tmp_path: Path) -> None:
    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS_TOML)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with AutotuneClient(nobody, retries=0, workloads_file=workloads) as client:
        with pytest.raises(errors.ServiceUnavailableError):
            client.plan("tiny", 64, device="cpu", memory="4MiB")
        got = client.plan("tiny", 64, device="cpu", memory="4MiB", fallback="local")
        assert client.last_source == "local"
    assert got.micro_batches == [16, 16, 16, 16]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("client")) as started:
        yield started


def test_plan_against_a_real_server_waits_for_the_probe(server: Server) -> None:
    with AutotuneClient(server.url, backoff=0.1) as client:
        got = client.plan("tiny", 100, world_size=2, policy=Policy.EXACT, timeout=60)
        assert got.micro_batches == [10] * 5
        assert client.last_source == "service"
        assert {w["name"] for w in client.workloads()} >= {"tiny", "gpt"}
        assert client.devices()["budget_device"]["id"] == "cpu"
        with pytest.raises(errors.ServiceError) as info:
            client.plan("unregistered", 64)
        assert info.value.status_code == 404


def test_a_real_server_refuses_a_device_it_lacks_and_the_client_does_not_probe_locally(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    import autotune.engine.confirm

    def no_probe(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("probed locally for a device the service's node does not have")

    monkeypatch.setattr(autotune.engine.confirm, "probe_and_confirm", no_probe)
    sleeps: list[float] = []
    with AutotuneClient(server.url, sleep=sleeps.append) as client:
        with pytest.raises(errors.NoSuchDeviceError, match="no device cuda:5") as info:
            client.plan("tiny", 64, device="cuda:5", memory="4MiB", timeout=60, fallback="local")
        assert client.last_source is None
    assert info.value.status_code == 404
    assert sleeps == []  # refused at once, not retried as an outage


def test_a_result_published_by_the_cli_answers_a_later_jobs_plan(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command through the CLI's entry point in this process, whose probes share one fork server
    (the CLI as a process of its own is test_cli's)."""
    from autotune import cli

    command = [
        *("probe", "mlp", "--device", "cpu", "--memory", "6MiB", "--max-batch", "16"),
        *("-o", "in_features=64", "-o", "hidden=64", "-o", "layers=1", "-o", "classes=10"),
        *("--publish", server.url),
    ]
    code = cli.run(command)
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"published to {server.url}" in err

    with server.client() as http:
        started = metric(http, "autotune_probes_started_total", 'device="cpu"')
        with AutotuneClient(server.url) as client:
            got = client.plan("tiny", 32, memory="6MiB", timeout=0)  # no waiting: it must be stored
        assert got.micro_batches == [16, 16]
        assert metric(http, "autotune_probes_started_total", 'device="cpu"') == started
        assert metric(http, "autotune_results_published_total") == 1


def test_publish_needs_a_url() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    bad = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "probe", "mlp", "--publish", "autotune:8000"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert "--publish" in bad.stderr


def test_a_workloads_answer_that_is_not_a_list_is_a_service_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text="<html>proxy error</html>"))
    with (
        AutotuneClient("http://autotune.invalid", transport=transport) as client,
        pytest.raises(errors.ServiceError, match="without a list of workloads"),
    ):
        client.workloads()
