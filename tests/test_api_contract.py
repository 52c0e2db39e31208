"""The API contract: the OpenAPI document states exactly what the server accepts and answers.

`test_schemathesis_finds_no_failure` runs schemathesis (its CLI, `schemathesis run`, in a
subprocess) against a real `autotune serve` on 127.0.0.1 with AUTOTUNE_TOKEN set, and requires
0 failures and 0 errors. Checks: all of them (`--checks all`):

    not_a_server_error             no 5xx for any input
    status_code_conformance        every status answered is documented for its operation
    content_type_conformance       every answer has a documented content type (PNG, JSON)
    response_headers_conformance   documented headers (Location, Retry-After, WWW-Authenticate) present and valid
    response_schema_conformance    every body matches its documented schema
    positive_data_acceptance       a schema-valid request is not refused (see below)
    negative_data_rejection        a schema-invalid request is refused with a 4xx
    missing_required_header        a missing required header is refused
    unsupported_method             an undocumented method is a 405 (with Allow)
    allow_header_conformance       the Allow header of a 405 lists the documented methods
    ignored_auth                   without the token, or with a wrong one, /v1 answers 401
    use_after_free, ensure_resource_availability, object_level_authorization
                                   (stateful: a created probe or result can be read back)
    schema_valid_is_field_valid    ours (tests/contract_checks.py): a schema-valid request
                                   refused with 422 broke a rule the schema cannot state, never
                                   a field's validation

Phases: examples, fuzzing, stateful (following the document's links: the probe id of POST
/v1/probes and GET /v1/plan to GET /v1/probes/{id} and its plot, a published fingerprint to GET
/v1/results/{fingerprint}). Not coverage (boundary values of every parameter): the default run
below runs it over the same document with stricter checks (every schema-valid request accepted,
no 422 allowed), so here it would only repeat those requests.

Bounds: 15 examples per operation and phase (`--max-examples 15`; 10 for POST /v1/results, whose
bodies are whole probe results), a fixed seed (`--seed`; change it to explore other inputs), one
worker, Hypothesis's generation-speed health check off. The schemathesis run takes about 10 s on
an idle 2-core machine (2026-11-26); the subprocess is killed at 240 s.

The configuration (a schemathesis.toml the test writes):

- `query.workload` and `body.workload` are "tiny" or "nofit" (tests/serving.py) half the time, so
  that requests reach past "unknown workload": plans answered from a stored result, probes started
  (the tiny workloads on the CPU budget device; AUTOTUNE_MAX_QUEUE=1 keeps at most one waiting per
  device, the others are refused with 429), probes that fail (409), plots of unfinished probes.
- `query.wait` is 0 in generated plan queries, so that no query blocks on a probe (its bounds are
  still tested by the coverage phase and by negative data).
- `positive_data_acceptance` also accepts 422 for the five operations that have rules no JSON
  Schema can state (GET /v1/plan, POST /v1/plan/mixed, POST /v1/probes, POST /v1/run-failures,
  POST /v1/results): headroom against memory, memory against the device or
  AUTOTUNE_MAX_CPU_MEMORY, an effective batch against the world size and the stored answer, FSDP
  over one rank, a GPU
  model's name that matches several, a published result's fields against each other and against
  the registered workload. `schema_valid_is_field_valid` then holds those 422s
  to a rule, not a field.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from api import create_app, errors
from autotune.engine.probe import ProbeRequest
from autotune.errors import ProbeError, QueueFullError
from autotune.results import ProbeResult, TrialRecord
from autotune.settings import Settings
from tests.serving import ROOT, WORKLOADS_TOML, Server, make_result, running_server

TOKEN = "contract-token"
TINY = {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}
SEED = 20261123
EXAMPLES = 15
DEFAULT_RUN_EXAMPLES = 25
OPERATIONS_WITH_RULES = (
    "GET /v1/plan",
    "POST /v1/plan/mixed",
    "POST /v1/probes",
    "POST /v1/run-failures",
    "POST /v1/results",
)

CONFIG = """\
hooks = "tests.contract_checks"
# Hypothesis's "too slow" measures data generation, not the API: on a loaded CI machine it fails runs
# that found nothing.
suppress-health-check = ["too_slow"]

[dictionaries.workloads]
values = ["tiny", "nofit"]

[parameters]
"body.workload" = { dictionary = "workloads", probability = 0.5 }
"""
RULES = """
[[operations]]
include-name = "{name}"
checks.positive_data_acceptance.expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", "422"]
"""
# A whole ProbeResult per example: the costliest body to generate, and every one is refused by a rule.
RESULTS = """
[[operations]]
include-name = "POST /v1/results"
generation.max-examples = 10
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"AUTOTUNE_MAX_QUEUE": "1", "AUTOTUNE_MAX_CPU_MEMORY": "64MiB"}
    with running_server(tmp_path_factory.mktemp("contract"), token=TOKEN, env=env) as started:
        with started.client(TOKEN) as client:
            # A stored result: plan queries for tiny on the default 4 MiB device are answered from it.
            published = make_result(options=TINY, max_micro_batch=12, max_batch_cap=16)
            answer = client.post("/v1/results", json=published.model_dump(mode="json"))
            assert answer.status_code == 201, answer.text
        yield started


def test_schemathesis_finds_no_failure(server: Server, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG + "".join(RULES.format(name=name) for name in OPERATIONS_WITH_RULES) + RESULTS)
    junit = tmp_path / "junit.xml"
    pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")
    command = [
        *(sys.executable, "-m", "schemathesis.cli"),
        *("--config-file", str(config)),
        "run",
        f"{server.url}/openapi.json",
        *("--checks", "all"),
        *("--phases", "examples,fuzzing,stateful"),
        *("--max-examples", str(EXAMPLES)),
        *("--seed", str(SEED)),
        *("--workers", "1"),
        *("--header", f"Authorization: Bearer {TOKEN}"),
        *("--report", "junit", "--report-junit-path", str(junit)),
        "--output-truncate",
        "false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    seconds = time.monotonic() - started
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"schemathesis failed after {seconds:.0f} s:\n{report}\nserver log:\n{server.output()}"
    suites = ET.parse(junit).getroot()
    tests, failures, errors_ = (
        sum(int(s.get(k, 0)) for s in suites.iter("testsuite")) for k in ("tests", "failures", "errors")
    )
    assert tests >= 12, report  # every operation was tested
    assert (failures, errors_) == (0, 0), report
    print(report[report.find("Examples (") :])  # shown with -s or -rP: phases, operations, cases


def test_a_default_schemathesis_run_finds_no_failure(server: Server, tmp_path: Path) -> None:
    """`schemathesis run` as anyone would first run it: every check, every phase, no configuration
    (run from an empty directory, so no schemathesis.toml is found), no hooks and nothing allowed
    beyond its defaults; only the token, a fixed seed and 25 examples per operation instead of its
    default 100 (the suite's time: 100 took 50-75 s of a 2-core machine, all of it schemathesis's own
    generation; the full default run also found 0 failures, in the suite at e2dec9e, 2026-11-26). A
    schema-valid request that the service refuses with 422 fails it: the rules across fields are
    in the document (FSDP over one rank, a published result's form and its limit), and what no
    schema can state is reached only from a request that passed those (a registered workload)."""
    pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra: pip install -e '.[dev]'")
    junit = tmp_path / "junit.xml"
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json"),
        *("--checks", "all", "--seed", str(SEED), "--max-examples", str(DEFAULT_RUN_EXAMPLES)),
        *("--header", f"Authorization: Bearer {TOKEN}"),
        *("--report", "junit", "--report-junit-path", str(junit)),
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=420, check=False)
    seconds = time.monotonic() - started
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"schemathesis failed after {seconds:.0f} s:\n{report}\nserver log:\n{server.output()}"
    suites = ET.parse(junit).getroot()
    failures, errors_ = (sum(int(s.get(k, 0)) for s in suites.iter("testsuite")) for k in ("failures", "errors"))
    assert (failures, errors_) == (0, 0), report
    print(f"{seconds:.0f} s:", report[report.find("Test cases:") :])


# The document itself ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def document(server: Server) -> dict[str, Any]:
    document: dict[str, Any] = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    return document


def _statuses(document: dict[str, Any], method: str, path: str) -> set[str]:
    return set(document["paths"][path][method]["responses"])


def test_the_document_declares_the_bearer_scheme_on_every_v1_operation(document: dict[str, Any]) -> None:
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": document["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if path.startswith("/v1/"):
                assert operation["security"] == [{"bearerAuth": []}], (method, path)
                assert "401" in operation["responses"], (method, path)
                assert operation["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True
            else:  # /healthz, /readyz, /metrics stay open
                assert "security" not in operation, (method, path)


def test_without_a_token_the_document_makes_the_scheme_optional(tmp_path: Path) -> None:
    settings = Settings(db=str(tmp_path / "open.db"), token=None)
    document = create_app(settings).openapi()
    plan = document["paths"]["/v1/plan"]["get"]
    assert plan["security"] == [{"bearerAuth": []}, {}]  # OpenAPI's "this scheme, or none"
    assert "401" not in plan["responses"]
    assert "bearerAuth" in document["components"]["securitySchemes"]
    guarded = create_app(settings.model_copy(update={"token": "t"})).openapi()
    assert guarded["paths"]["/v1/plan"]["get"]["security"] == [{"bearerAuth": []}]


def test_every_status_a_route_answers_is_documented(document: dict[str, Any]) -> None:
    expected = {
        ("get", "/v1/plan"): {"200", "202", "401", "404", "409", "422", "429", "503"},
        ("post", "/v1/probes"): {"200", "202", "401", "404", "413", "422", "429", "503"},
        ("get", "/v1/probes/{probe_id}"): {"200", "401", "404", "503"},
        ("get", "/v1/probes/{probe_id}/plot.png"): {"200", "401", "404", "409", "503"},
        ("post", "/v1/run-failures"): {"200", "401", "404", "413", "422", "503"},
        ("post", "/v1/results"): {"201", "401", "404", "409", "413", "422", "503"},
        ("get", "/v1/results/{fingerprint}"): {"200", "401", "404", "503"},
        ("get", "/v1/devices"): {"200", "401", "503"},
        ("get", "/v1/workloads"): {"200", "401", "503"},
    }
    for (method, path), statuses in expected.items():
        assert _statuses(document, method, path) == statuses, (method, path)
    # A 503 is the service saying it is up (starting, draining, the store down): it says when to ask again.
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if path.startswith("/v1/"):
                unavailable = operation["responses"]["503"]
                assert unavailable["headers"]["Retry-After"]["required"] is True, (method, path)
                schema = unavailable["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/UnavailableView"}, (method, path)
    codes = document["components"]["schemas"]["UnavailableView"]["properties"]["code"]["enum"]
    assert set(codes) == {"store_unavailable", "device_unavailable", "starting", "draining"}
    plan = document["paths"]["/v1/plan"]["get"]["responses"]
    assert set(plan["202"]["headers"]) == {"Location", "Retry-After"}
    assert set(plan["429"]["headers"]) == {"Retry-After"}
    assert plan["429"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/QueueFullView"}
    plot = document["paths"]["/v1/probes/{probe_id}/plot.png"]["get"]["responses"]
    assert "image/png" in plot["200"]["content"]


def _plan_query(document: dict[str, Any]) -> dict[str, Any]:
    """GET /v1/plan's query: one object parameter, each field its own `name=value` (form, exploded)."""
    (parameter,) = document["paths"]["/v1/plan"]["get"]["parameters"]
    assert (parameter["in"], parameter["style"], parameter["explode"]) == ("query", "form", True)
    schema: dict[str, Any] = parameter["schema"]
    return schema


def test_sizes_are_a_byte_count_or_a_string_with_a_unit(document: dict[str, Any]) -> None:
    query = _plan_query(document)
    fields = query["properties"]
    assert set(query["required"]) == {"workload", "effective_batch"}
    memory = fields["memory"]["anyOf"]
    assert {k: v for k, v in memory[0].items() if k != "description"} == {
        "type": "integer",
        "minimum": 1,
        "maximum": 2**53,
    }
    assert memory[1]["type"] == "string"
    assert fields["headroom"]["type"] == "string"
    assert {k: fields["effective_batch"][k] for k in ("type", "minimum", "maximum")} == {
        "type": "integer", "minimum": 1, "maximum": 2**20
    }  # fmt: skip
    assert fields["wait"]["maximum"] == 60
    schemas = document["components"]["schemas"]
    for model in ("ProbeCreate", "RunFailureReport"):
        types = [branch.get("type") for branch in schemas[model]["properties"]["memory"]["anyOf"]]
        assert types == ["integer", "string", "null"], model
        # A bare number is a fraction, below 1, as on the command line: a size is a string with its unit.
        headroom = schemas[model]["properties"]["headroom"]["anyOf"]
        assert [branch.get("type") for branch in headroom] == ["number", "string", "null"], model
        assert headroom[0]["exclusiveMaximum"] == 1


def test_the_document_states_the_rules_across_fields(document: dict[str, Any]) -> None:
    """What a default schemathesis run checks: FSDP over one rank is invalid by the document itself,
    in the plan query and in the bodies; a published result's form and its derived limit."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="schemathesis's validator: pip install -e '.[dev]'")
    schemas = document["components"]["schemas"]

    def valid(schema: dict[str, Any], instance: dict[str, Any]) -> bool:
        rooted = {**schema, "components": {"schemas": schemas}}  # "#/components/schemas/..." resolve here
        return bool(jsonschema_rs.Draft202012Validator(rooted).is_valid(instance))

    query = _plan_query(document)
    base = {"workload": "tiny", "effective_batch": 8}
    assert valid(query, base)
    assert valid(query, {**base, "parallel": "ddp"})
    assert valid(query, {**base, "parallel": "fsdp", "world_size": 2})
    assert not valid(query, {**base, "parallel": "fsdp"})
    assert not valid(query, {**base, "parallel": "fsdp", "world_size": 1})
    for model, body in (
        ("ProbeCreate", {"workload": "tiny"}),
        ("RunFailureReport", {"workload": "tiny", "micro_batch": 4}),
    ):
        assert valid(schemas[model], body) and valid(schemas[model], {**body, "parallel": "fsdp", "world_size": 4})
        assert not valid(schemas[model], {**body, "parallel": "fsdp", "world_size": 1}), model
    mixed = schemas["MixedPlanQuery"]
    one = {"workload": "tiny", "effective_batch": 8, "parallel": "fsdp", "groups": [{"device": "cpu", "ranks": 1}]}
    assert not valid(mixed, one)
    assert valid(mixed, {**one, "groups": [{"device": "cpu", "ranks": 2}]})
    assert valid(mixed, {**one, "groups": [{"device": "cpu", "ranks": 1}, {"device": "cuda:0", "ranks": 1}]})
    published = document["paths"]["/v1/results"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    upload = schemas[published["$ref"].rsplit("/", 1)[-1]]
    assert upload["properties"]["limit_bytes"]["readOnly"] is True
    assert "limit_bytes" not in upload["required"]
    assert upload["properties"]["fingerprint"]["pattern"] == "^[0-9a-f]{64}$"
    assert upload["properties"]["schema_version"]["const"] == 2


def test_the_readme_query_is_valid_by_the_document(server: Server) -> None:
    # `memory=128MiB`, as the README sends it, and its byte count are one query: the stored result
    # for the 4 MiB budget device answers every spelling.
    with server.client(TOKEN) as client:
        plans = []
        for memory in ("4MiB", "4194304", "4 MiB", "4mib", "4096KiB"):
            answer = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 24, "memory": memory})
            assert answer.status_code == 200, (memory, answer.text)
            plans.append(answer.json())
        assert all(plan == plans[0] for plan in plans)
        for memory in ("0", "0MiB", "04MiB", "4XB", "-4MiB", "4MiB ", "1" * 17):
            answer = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 24, "memory": memory})
            assert answer.status_code == 422, (memory, answer.text)
            assert answer.json()["detail"][0]["loc"] == ["query", "memory"]


def test_a_device_the_node_lacks_is_a_404_with_its_code(server: Server) -> None:
    with server.client(TOKEN) as client:
        answer = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 8, "device": "cuda:3"})
    assert answer.status_code == 404
    assert answer.json()["code"] == "no_such_device"
    assert "no device cuda:3" in answer.json()["detail"]


# 429: a full probe queue ------------------------------------------------------------------------
def test_queue_full_is_a_429_with_retry_after() -> None:
    app = FastAPI()
    errors.install(app)

    @app.get("/busy")
    async def busy() -> None:
        raise QueueFullError("device cpu already has 16 probes waiting", retry_after=30)

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return await client.get("/busy")

    answer = asyncio.run(scenario())
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "30"
    assert answer.json() == {
        "detail": "device cpu already has 16 probes waiting",
        "code": "queue_full",
        "retry_after": 30,
    }


class BlockingRunner:
    """A probe that runs until released: the jobs it is given stay running or queued."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, request: ProbeRequest, timeout: float, on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
        self.release.wait(30)
        raise ProbeError("released by the test")


def test_a_full_queue_answers_429_through_the_service(tmp_path: Path) -> None:
    """AUTOTUNE_MAX_QUEUE=1: with one probe running and one waiting on the CPU budget device, a
    third distinct request is refused, on POST /v1/probes and on GET /v1/plan alike."""
    workloads = tmp_path / "workloads.toml"
    workloads.write_text(WORKLOADS_TOML)
    settings = Settings(db=str(tmp_path / "queue.db"), workloads=workloads, max_queue=1, token=None)
    runner = BlockingRunner()
    app = create_app(settings, runner=runner)

    async def scenario() -> list[httpx.Response]:
        answers = []
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                try:
                    for memory in ("3MiB", "5MiB", "6MiB"):
                        body = {"workload": "tiny", "device": "cpu", "memory": memory}
                        answers.append(await client.post("/v1/probes", json=body))
                        if len(answers) == 1:  # the worker has taken it: from now on the queue holds one
                            await _running(client, answers[0].json()["id"])
                    query = {"workload": "tiny", "effective_batch": 8, "device": "cpu", "memory": "7MiB"}
                    answers.append(await client.get("/v1/plan", params=query))
                finally:
                    runner.release.set()
        return answers

    answers = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [202, 202, 429, 429]
    for answer in answers[2:]:
        assert int(answer.headers["retry-after"]) >= 1
        body = answer.json()
        assert body["code"] == "queue_full"
        assert body["retry_after"] == int(answer.headers["retry-after"])
        assert "AUTOTUNE_MAX_QUEUE" in body["detail"]


async def _running(client: httpx.AsyncClient, probe_id: str) -> None:
    for _ in range(500):
        if (await client.get(f"/v1/probes/{probe_id}")).json()["status"] == "running":
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"probe {probe_id} never started")
