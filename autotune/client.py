"""The client training jobs use: ask the autotune service for a plan, publish a result.

    from autotune.client import AutotuneClient

    with AutotuneClient("http://autotune:8000", token=os.environ.get("AUTOTUNE_TOKEN")) as client:
        plan = client.plan("gpt", effective_batch=256, world_size=8, fallback="local")

`plan` asks `GET /v1/plan`; when no result is stored the service starts a probe and the client
waits for it, long-polling (`wait=`) with exponential backoff between answers, up to `timeout`.
Errors become ours: 401 `AuthError`; a service that is down or degraded past the deadline
`ServiceUnavailableError`; other refusals `ServiceError` with the status code; a probe that failed
on the service the `ProbeError` it failed with.

**Down or degraded.** A service is *down* when it cannot be reached (a refused connection, a
timeout, a proxy's 502/504 or a 5xx that is not ours): after a few retries with backoff, and only
then, `fallback="local"` probes in this job instead, the same registered workload read from
AUTOTUNE_WORKLOADS (or the built-ins), in an isolated child, under the device's lock as every probe
on the node (`autotune.engine.lock`): it waits for a probe the service or anyone else is running
on that device. A service is *degraded* when it answers 503 with one of its own codes
(`store_unavailable`, `starting`, `draining`, `device_unavailable`): it is up, and a probe it runs
for this query goes on, so the client keeps asking, honouring `Retry-After`, with backoff, up to
its own `timeout`, and never probes beside it. A connection refused right after the service said
`draining`, or while it was running a probe for this client (it answered 202: a worker killed or
restarted, whose job the service runs again), counts as degraded for RESTART_GRACE seconds. A probe
that is still running when `timeout` passes is not a reason to fall back either: a second probe on
the same GPU would measure a card the first one is using.

**Failed or interrupted.** A probe whose worker stopped is run again by the service under the same
id, so waiting goes on; one the service reports `Interrupted` (its node lost it before it ran, or a
service older than this client) is asked for again within `timeout`, since asking again runs it.
Only a failure asking again would not fix (409, `"code": "probe_failed"`) raises its `ProbeError`.

A device the service's node does not have is a refusal, not an outage: the service answers it
with `"code": "no_such_device"` (a 404), and the client raises `NoSuchDeviceError` at once, with
no retry and no local probe, whatever the status (probing "it" locally would measure whatever
device this process sees instead).

Only httpx: no web framework, and torch is imported only for a local fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx
from pydantic import Field

from autotune import errors
from autotune.plans.accumulate import ShrinkEvent
from autotune.plans.mixed import MixedPlan
from autotune.plans.plan import Plan, Policy, parse_policy
from autotune.results import ProbeResult, Verdict

log = logging.getLogger(__name__)

Fallback = Literal["local", "error"]
MAX_WAIT = 30.0  # seconds one plan query asks the service to block (the service allows 60)
NO_SUCH_DEVICE = "no_such_device"  # the error code of a device the service's node does not have
# 503 codes of our service: it is up and says so; what it runs goes on, so a client waits.
DEGRADED = frozenset({"store_unavailable", "starting", "draining", "device_unavailable"})
RESTART_GRACE = 60.0  # seconds after "draining" (or a pending probe) during which a refused connection is a restart
# Probe failures that asking again fixes: the service's job was lost with its node or its worker.
RETRYABLE = frozenset({"Interrupted"})


def _check_confirmed(workload: str, verdict: Verdict, allow_unconfirmed: bool) -> None:
    """Refuse a plan whose answers a fresh process did not confirm, as `load_result(...).plan` does."""
    if verdict.status != "confirmed" and not allow_unconfirmed:
        raise errors.UnconfirmedError(
            f"the plan for {workload!r} was not confirmed ({verdict.note}): ask for it with allow_unconfirmed=True "
            "to run it anyway"
        )


class _Down(errors.ServiceUnavailableError):
    """The service could not be reached (or a proxy answered for it): what `fallback="local"` covers."""


class _Degraded(errors.ServiceUnavailableError):
    """The service is up but kept answering 503 with its own code until the deadline: no fallback."""


class CheckpointedPlan(Plan):
    """A plan that runs with an activation-checkpointing setting (`AutotuneClient.plan(...,
    checkpointing=...)`): its micro-batch was verified with that setting, so the job must set it."""

    checkpointing: str = Field(description="none, full or every=K (every K-th repeated block).")

    def apply(self, job: Any) -> Any:
        """Set this plan's checkpointing on `job` and return it: a Hugging Face Trainer or its
        `TrainingArguments` (`gradient_checkpointing`, or `activation_checkpointing` where the
        Trainer has it: `set_trainer_checkpointing`), a `Workload` (a copy with the setting: a
        Workload is frozen) or a model (`autotune.workloads.checkpointing.apply` on its repeated blocks)."""
        setting = self.checkpointing
        if hasattr(getattr(job, "args", job), "gradient_checkpointing"):
            from autotune.integrations.transformers import set_trainer_checkpointing

            set_trainer_checkpointing(job, setting)
            return job
        from autotune.workloads import checkpointing
        from autotune.workloads.workload import Workload

        if isinstance(job, Workload):
            return job.with_checkpointing(setting)
        checkpointing.apply(job, setting)
        return job


class AutotuneClient:
    """A synchronous client of the autotune service. Close it, or use it as a context manager."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        request_timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        workloads_file: Path | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise errors.ConfigError(f"service URL {base_url!r} must start with http:// or https://")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=request_timeout, transport=transport)
        self._request_timeout = request_timeout
        self._retries = retries
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._workloads_file = workloads_file
        self._sleep = sleep
        self._clock = clock
        self._drained_at: float | None = None  # when the service last said it was shutting down
        self._pending_at: float | None = None  # when the service last said it was probing for us (202)
        self.last_source: Literal["service", "local"] | None = None

    def __enter__(self) -> AutotuneClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # The API ---------------------------------------------------------------------------------
    def plan(
        self,
        workload: str,
        effective_batch: int,
        world_size: int = 1,
        policy: Policy | str = Policy.FEWEST_STEPS,
        *,
        device: str | None = None,
        memory: int | str | None = None,
        headroom: float | str | None = None,
        precision: str | None = None,
        optimizer: str | None = None,
        parallel: str = "none",
        reshard_after_forward: bool = True,
        timeout: float = 900.0,
        fallback: Fallback = "error",
        wait_for_device: bool = True,
        allow_unconfirmed: bool = False,
        checkpointing: str | None = None,
    ) -> Plan:
        """The plan for `effective_batch` samples per optimizer step over `world_size` ranks.
        `parallel`: how the job runs the model across its ranks (none, ddp, or fsdp: FSDP2 over
        `world_size` ranks); the micro-batch is per rank of such a job. `checkpointing`: the
        activation checkpointing of the model's repeated blocks, a setting (none, full, every=K) or
        auto (the fastest plan of none and full, as measured): the plan is then a `CheckpointedPlan`,
        whose `checkpointing` says the setting it runs with and whose `apply(...)` sets it on the job.

        Waits up to `timeout` seconds for a probe the service runs, and for a degraded service
        (503 with its own code: the store is down, it is starting or shutting down). Raises
        AuthError, ServiceError, ServiceUnavailableError, or the ProbeError the probe failed with.
        With `fallback="local"`, a service that is down (not reached) is replaced by a local
        probe, which holds the device's lock as every probe does: while another probe on this
        node holds it, it waits (logged), or raises DeviceBusyError with `wait_for_device=False`.
        A plan whose answers a fresh process did not confirm (the result's `verdict`) raises
        UnconfirmedError, as `autotune.load_result(...).plan` does, unless `allow_unconfirmed`."""
        if fallback not in ("local", "error"):
            raise errors.ConfigError(f"fallback must be 'local' or 'error', not {fallback!r}")
        policy = parse_policy(policy)
        params: dict[str, Any] = {"workload": workload, "effective_batch": effective_batch, "world_size": world_size}
        params["policy"] = policy.value
        options = {"device": device, "memory": memory, "headroom": headroom, "precision": precision}
        params.update({k: v for k, v in {**options, "optimizer": optimizer}.items() if v is not None})
        params.update(_parallel_fields(parallel, reshard_after_forward))
        if checkpointing is not None:
            params["checkpointing"] = checkpointing
        try:
            made = self._plan_from_service(params, timeout, allow_unconfirmed)
        except _Down as exc:
            if fallback == "error":
                raise
            log.warning("autotune service unavailable (%s): probing %s in this job", exc, workload)
            local = {**options, "optimizer": optimizer, **_parallel_fields(parallel, reshard_after_forward)}
            local["checkpointing"] = checkpointing
            made = self._local_plan(
                workload, effective_batch, world_size, policy, local, wait_for_device, allow_unconfirmed
            )
            self.last_source = "local"
            return made
        self.last_source = "service"
        return made

    def probe(
        self,
        workload: str,
        *,
        device: str | None = None,
        memory: int | str | None = None,
        headroom: float | str | None = None,
        budget: str | None = None,
        precision: str | None = None,
        optimizer: str | None = None,
        parallel: str = "none",
        world_size: int = 1,
        reshard_after_forward: bool = True,
        refresh: bool = False,
        timeout: float = 900.0,
    ) -> ProbeResult:
        """Ask the service to probe `workload` (or return its stored result) and wait for it;
        `parallel` and `world_size` as for `plan`."""
        body = {
            k: v
            for k, v in {
                "workload": workload,
                "device": device,
                "memory": memory,
                "headroom": headroom,
                "budget": budget,
                "precision": precision,
                "optimizer": optimizer,
            }.items()
            if v is not None
        }
        body.update(_parallel_fields(parallel, reshard_after_forward))
        if world_size != 1:
            body["world_size"] = world_size
        body["refresh"] = refresh
        deadline = self._clock() + timeout
        answer = self._json(self._send("POST", "/v1/probes", json=body, deadline=deadline))
        delay = self._backoff
        while True:
            while answer.get("status") in ("queued", "waiting", "running"):
                self._pending_at = self._clock()
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise errors.ServiceUnavailableError(
                        f"probe {answer.get('id')} is still {answer.get('status')} after {timeout:g} s: "
                        "ask again later with a longer timeout"
                    )
                self._sleep(min(delay, remaining))
                delay = min(delay * 2, self._max_backoff)
                answer = self._json(self._send("GET", f"/v1/probes/{answer['id']}", deadline=deadline))
            if answer.get("status") != "failed":
                return ProbeResult.model_validate(answer["result"])
            if not self._ask_again(answer, deadline):
                raise _probe_error(answer)
            answer = self._json(self._send("POST", "/v1/probes", json=body, deadline=deadline))

    def plan_mixed(
        self,
        workload: str,
        effective_batch: int,
        groups: list[dict[str, Any]],
        *,
        mode: str = "per-model",
        policy: Policy | str = Policy.FEWEST_STEPS,
        precision: str | None = None,
        optimizer: str | None = None,
        parallel: str = "none",
        reshard_after_forward: bool = True,
    ) -> MixedPlan:
        """One plan for a job whose ranks span GPU models (`POST /v1/plan/mixed`), from the results
        stored for each model: `groups` are {"device", "ranks"[, "memory", "headroom"]}, ranks
        numbered in that order (`MixedPlan.for_rank(rank)` is what a rank runs). A group without a
        stored result is a ServiceError (409) naming it and how to get one: no probe is started."""
        body: dict[str, Any] = {
            "workload": workload,
            "effective_batch": effective_batch,
            "groups": groups,
            "mode": mode,
            "policy": parse_policy(policy).value,
            **{k: v for k, v in {"precision": precision, "optimizer": optimizer}.items() if v is not None},
            **_parallel_fields(parallel, reshard_after_forward),
        }
        response = self._send("POST", "/v1/plan/mixed", json=body)
        answer = self._json(response)
        if response.status_code == 409:
            raise errors.ServiceError(str(answer.get("detail", "no stored result")), status_code=409)
        return MixedPlan.model_validate(answer["plan"])

    def publish(self, result: ProbeResult) -> str:
        """Store `result` on the service (`POST /v1/results`); returns its fingerprint."""
        answer = self._json(self._send("POST", "/v1/results", json=result.model_dump(mode="json")))
        return str(answer["fingerprint"])

    def report_run_oom(
        self,
        workload: str,
        micro_batch: int,
        *,
        accumulates: bool = True,
        message: str = "",
        device: str | None = None,
        memory: int | str | None = None,
        headroom: float | str | None = None,
        precision: str | None = None,
        optimizer: str | None = None,
        parallel: str = "none",
        world_size: int = 1,
        reshard_after_forward: bool = True,
    ) -> dict[str, Any]:
        """Tell the service that a run of its plan ran out of memory at `micro_batch` (the query
        as for `plan`): it lowers the stored answer below that size for later queries."""
        body: dict[str, Any] = {
            "workload": workload,
            "micro_batch": micro_batch,
            "accumulates": accumulates,
            "message": message[:2000],
            "device": device,
            "memory": memory,
            "headroom": headroom,
            "precision": precision,
            "optimizer": optimizer,
            "world_size": world_size if world_size != 1 else None,
            **_parallel_fields(parallel, reshard_after_forward),
        }
        return self._json(self._send("POST", "/v1/run-failures", json={k: v for k, v in body.items() if v is not None}))

    def shrink_reporter(self, workload: str, **query: Any) -> Callable[[ShrinkEvent], None]:
        """An `OOMGuard(on_shrink=...)` callback that reports each shrink of a rank that ran out of
        memory with `report_run_oom` (a rank that shrank because another ran out did not fail at its
        size: nothing to report); a report that fails is logged, never raised into the training loop."""

        def report(event: ShrinkEvent) -> None:
            if not event.ran_out:
                return
            try:
                self.report_run_oom(
                    workload, event.old_micro_batch, accumulates=event.micro_steps > 1, message=event.message, **query
                )
            except errors.AutotuneError as exc:
                log.warning("autotune: could not report the out-of-memory event to the service: %s", exc)

        return report

    def workloads(self) -> list[dict[str, Any]]:
        response = self._send("GET", "/v1/workloads")
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, list):
            raise errors.ServiceError(
                f"the service answered {response.status_code} without a list of workloads",
                status_code=response.status_code,
            )
        return answer

    def devices(self) -> dict[str, Any]:
        return self._json(self._send("GET", "/v1/devices"))

    # Internals -------------------------------------------------------------------------------
    def _plan_from_service(self, params: dict[str, Any], timeout: float, allow_unconfirmed: bool = False) -> Plan:
        deadline = self._clock() + timeout
        delay = self._backoff
        while True:
            remaining = max(0.0, deadline - self._clock())
            wait = round(min(remaining, MAX_WAIT), 1)
            response = self._send(
                "GET", "/v1/plan", params={**params, "wait": wait}, extra_timeout=wait, deadline=deadline
            )
            answer = self._json(response)
            if response.status_code == 200:
                if "verdict" in answer:  # (a service older than the verdict does not say)
                    _check_confirmed(params["workload"], Verdict.model_validate(answer["verdict"]), allow_unconfirmed)
                made = Plan.model_validate(answer["plan"])
                if "checkpointing" not in params:
                    return made
                setting = (answer.get("checkpointing") or {}).get("setting")
                if setting is None:
                    raise errors.ServiceError(
                        "the service's plan does not say which activation checkpointing it runs with (a service "
                        "older than checkpointing?): upgrade it, or ask without checkpointing=",
                        status_code=response.status_code,
                    )
                return CheckpointedPlan(**made.model_dump(), checkpointing=setting)
            probe = answer.get("probe") or {}
            if response.status_code == 409 and not self._ask_again(probe, deadline):
                raise _probe_error(probe, answer.get("detail"))
            if response.status_code != 409:
                self._pending_at = self._clock()
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise errors.ServiceUnavailableError(
                    f"no plan after {timeout:g} s: the service's probe {probe.get('id')} is still "
                    f"{probe.get('status')}; ask again later or raise the timeout"
                )
            self._sleep(min(delay, remaining))
            delay = min(delay * 2, self._max_backoff)

    def _ask_again(self, probe: dict[str, Any], deadline: float) -> bool:
        """Whether a failed probe is one asking again fixes (its job was lost with its node or
        worker: `RETRYABLE`), with time left to ask."""
        error = probe.get("error") or {}
        if error.get("type") not in RETRYABLE or self._clock() >= deadline:
            return False
        log.warning(
            "autotune service: probe %s was interrupted (%s): asking for it again",
            probe.get("id"),
            error.get("message"),
        )
        return True

    def _local_plan(
        self,
        workload: str,
        effective_batch: int,
        world_size: int,
        policy: Policy,
        options: dict[str, Any],
        wait_for_device: bool = True,
        allow_unconfirmed: bool = False,
    ) -> Plan:
        from autotune.engine.confirm import probe_and_confirm
        from autotune.engine.probe import ProbeRequest
        from autotune.settings import get_settings
        from autotune.workloads.registry import load_registry

        settings = get_settings()
        entry = load_registry(self._workloads_file or settings.workloads).get(workload)
        try:
            request = ProbeRequest(
                target=entry.target,
                options=dict(entry.options),
                device=options["device"],
                memory=options["memory"],
                headroom=options["headroom"],
                precision=options["precision"],
                optimizer=options["optimizer"],
                parallel=options.get("parallel", "none"),
                reshard_after_forward=options.get("reshard_after_forward", True),
                steps=entry.steps,
                max_batch=entry.max_batch,
                granularity=entry.granularity,
                prefetch=entry.prefetch,
                effective_batch=effective_batch,
                world_size=world_size,
                policy=policy,
                checkpointing=options.get("checkpointing"),
            )
        except ValueError as exc:  # pydantic's ValidationError
            raise errors.ConfigError(f"cannot probe {workload!r} locally: {exc}") from None
        result = probe_and_confirm(request, timeout=settings.probe_timeout, wait_for_device=wait_for_device)
        assert result.plan is not None  # the request had an effective batch
        _check_confirmed(workload, result.verdict, allow_unconfirmed)
        if request.checkpointing is None:
            return result.plan
        return CheckpointedPlan(**result.plan.model_dump(), checkpointing=result.workload.checkpointing or "none")

    def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        extra_timeout: float = 0.0,
        deadline: float | None = None,
    ) -> httpx.Response:
        """One request. Returns 2xx and 409 answers; raises ours for the rest.

        Down (not reached, a proxy's 502/504, a 5xx that is not ours): retried `retries` times with
        backoff, then `_Down`. Degraded (503 with one of the service's own codes): asked again
        after its Retry-After (at least the backoff, at most `max_backoff`) until `deadline`, then
        `_Degraded`; without a deadline, `retries` times. A refused connection within RESTART_GRACE
        of a "draining" answer is a restart: waited for as degraded."""
        delay = self._backoff
        failures = 0
        degraded: str | None = None
        while True:
            try:
                response = self._http.request(
                    method, path, params=params, json=json, timeout=self._request_timeout + extra_timeout
                )
            except httpx.TransportError as exc:  # connect, read, timeouts, protocol errors
                failures += 1
                why = f"cannot reach the autotune service at {self.base_url}: {type(exc).__name__}: {exc}"
                if not self._restarting() or not self._before(deadline, failures):
                    if failures > self._retries:
                        raise _Down(why) from None
                elif degraded is None:
                    log.warning("autotune service restarting (%s): waiting for it", why)
                    degraded = why
                self._pause(delay, None, deadline)
                delay = min(delay * 2, self._max_backoff)
                continue
            code = _code(response)
            if response.status_code == 503 and code in DEGRADED:
                failures += 1
                if code == "draining":
                    self._drained_at = self._clock()
                why = f"the autotune service answered 503 {code}: {_detail(response)}"
                if not self._before(deadline, failures):
                    waited = "" if deadline is None else " until the deadline"
                    raise _Degraded(
                        f"{why} (it is up, so no local probe was started; it said so{waited}): ask again later"
                        + (" or raise the timeout" if deadline is not None else ""),
                        status_code=503,
                    )
                if degraded != code:
                    log.warning("%s: waiting for it (it is up: a probe it runs goes on)", why)
                    degraded = code
                self._pause(delay, _retry_after(response), deadline)
                delay = min(delay * 2, self._max_backoff)
                continue
            if degraded is not None:
                log.info("autotune service answers again (%d)", response.status_code)
            ours = code is not None
            if response.status_code in (502, 503, 504) and not ours and failures < self._retries:
                failures += 1
                self._pause(delay, None, deadline)
                delay = min(delay * 2, self._max_backoff)
                continue
            return _check(response)

    def _before(self, deadline: float | None, failures: int) -> bool:
        """Whether a degraded service may be asked again: before the deadline, or within the retries."""
        if deadline is None:
            return failures <= self._retries
        return self._clock() < deadline

    def _restarting(self) -> bool:
        """A refused connection now is a restart: the service said it was shutting down, or was
        probing for us, within RESTART_GRACE (a killed worker's job runs again once it is back)."""
        told = [moment for moment in (self._drained_at, self._pending_at) if moment is not None]
        return bool(told) and self._clock() - max(told) < RESTART_GRACE

    def _pause(self, delay: float, retry_after: float | None, deadline: float | None) -> None:
        seconds = min(max(delay, retry_after or 0.0), max(self._max_backoff, delay))
        if deadline is not None:
            seconds = min(seconds, max(0.0, deadline - self._clock()))
        if seconds > 0:
            self._sleep(seconds)

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        try:
            answer = response.json()
        except ValueError:
            raise errors.ServiceError(
                f"the service answered {response.status_code} with a body that is not JSON",
                status_code=response.status_code,
            ) from None
        if not isinstance(answer, dict):
            raise errors.ServiceError("the service answered with unexpected JSON", status_code=response.status_code)
        return answer


def _check(response: httpx.Response) -> httpx.Response:
    code = response.status_code
    if code < 300 or code == 409:
        return response
    detail = _detail(response)
    if code == 401:
        raise errors.AuthError(
            f"the autotune service refused the token: {detail} (set AUTOTUNE_TOKEN or pass token=)", status_code=code
        )
    if _code(response) == NO_SUCH_DEVICE:
        raise errors.NoSuchDeviceError(f"the autotune service refused: {detail}", status_code=code)
    if code >= 500:  # a 5xx that is not one of our 503s: a proxy without its upstream, a crash
        raise _Down(f"the autotune service answered {code}: {detail}", status_code=code)
    raise errors.ServiceError(f"the autotune service answered {code}: {detail}", status_code=code)


def _code(response: httpx.Response) -> str | None:
    """The `code` of the service's error answer (`api.schemas.ErrorView`), if it has one."""
    if response.status_code < 400 or not response.headers.get("content-type", "").startswith("application/json"):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def _retry_after(response: httpx.Response) -> float | None:
    """Retry-After in seconds (the service sends a number; an HTTP date is not ours)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds < 3600 else None


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, list):
        parts = []
        for item in detail[:5]:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc", []))
                parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)[:500]


def _probe_error(probe: dict[str, Any], detail: str | None = None) -> errors.AutotuneError:
    error = probe.get("error") or {}
    message = error.get("message") or detail or "the probe failed"
    return errors.from_report(
        {"original": message, **error}, f"the service's probe {probe.get('id')} failed: {message}"
    )


def publish_result(url: str, result: ProbeResult, token: str | None = None) -> str:
    """`autotune probe --publish URL`: store `result` on the service at `url`."""
    with AutotuneClient(url, token=token) as client:
        return client.publish(result)


def _parallel_fields(parallel: str, reshard_after_forward: bool) -> dict[str, Any]:
    """The query's parallel fields, only where they differ from a plain job's (the service's
    defaults): a plain query stays as it was."""
    fields: dict[str, Any] = {}
    if parallel != "none":
        fields["parallel"] = parallel
    if not reshard_after_forward:
        fields["reshard_after_forward"] = False
    return fields
