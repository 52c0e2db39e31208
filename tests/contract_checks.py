"""A schemathesis check for tests/test_api_contract.py, loaded by the schemathesis CLI as its
hooks module (`hooks = "tests.contract_checks"`).

`positive_data_acceptance` expects a schema-valid request to be accepted (or refused as 401, 403,
404, 409, 429 or 5xx). Five operations have rules that no JSON Schema can state: headroom against
memory, memory against the device (or AUTOTUNE_MAX_CPU_MEMORY), an effective batch against the
world size and the stored answer, FSDP over one rank, a GPU model's name that matches several (a mixed plan's group),
and a published result's fields against each other and against the registered workload. A
schema-valid request that breaks one of them is a 422 whose `detail` is a message (or, for a
published result, entries with no `input`: the rule, not a field). The test allows 422 in
`positive_data_acceptance` for those five operations only, and this check takes its place there,
stricter: a schema-valid request must never be refused because a field failed
validation. Such a refusal would mean that the document and the server disagree about a value
(the failure the check exists to find), so it fails the run.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import schemathesis

from autotune.workloads.registry import NAME_PATTERN

_NAME = re.compile(NAME_PATTERN)


def _field_errors(detail: Any) -> list[Any]:
    """The entries of a 422 that fault a field's value (not a rule across fields)."""
    if isinstance(detail, str):
        return []  # a ConfigError: a rule the schema cannot state
    if not isinstance(detail, list):
        return [detail]
    return [
        entry
        for entry in detail
        if not (
            isinstance(entry, dict)
            and entry.get("type") == "value_error"
            and entry.get("input") is None
            and not str(entry.get("msg", "")).startswith("Value error")  # pydantic's wording for a field
        )
    ]


@schemathesis.check
def schema_valid_is_field_valid(ctx: Any, response: Any, case: Any) -> bool | None:
    """A schema-valid request refused with 422 breaks a rule the schema cannot state, never a field."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    try:
        body = response.json()
    except ValueError:
        raise AssertionError("a 422 without a JSON body") from None
    faulted = _field_errors(body.get("detail") if isinstance(body, dict) else body)
    if faulted:
        raise AssertionError(f"a schema-valid request was refused for the value of a field: {faulted}")
    return None


_REGISTERED = ("tiny", "nofit")  # tests/serving.py's workloads


@schemathesis.hook
def map_query(ctx: Any, query: Any) -> Any:
    """Plan queries for the workloads the test's server registers, without blocking on a probe.

    The plan query is one object parameter (its fields each `name=value`), which the configuration
    file cannot reach into: half of the queries whose workload is a valid name get one of the
    registered ones, and their `wait`, when valid, becomes 0. A field that is invalid on purpose
    (negative data) is left as it is, so an invalid query stays invalid."""
    operation = getattr(ctx, "operation", None)
    if operation is None or (operation.method.upper(), operation.path) != ("GET", "/v1/plan"):
        return query
    if not isinstance(query, dict):
        return query
    fields = query.get("query") if isinstance(query.get("query"), dict) else query
    workload = fields.get("workload")
    digest = zlib.crc32(workload.encode()) if isinstance(workload, str) else 1  # the same in every run
    if isinstance(workload, str) and _NAME.match(workload) and digest % 2 == 0:
        fields["workload"] = _REGISTERED[digest // 2 % len(_REGISTERED)]
    wait = fields.get("wait")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 <= wait <= 60:
        fields["wait"] = 0
    return query
