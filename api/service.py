"""The service's state and the decisions the endpoints share, independent of HTTP.

`Service` holds the settings, the store, the registry, the devices, the in-memory caches, the
probe manager and the metrics, opened once in the app's lifespan (once per worker process).

Stored results are cached in memory: a plan query that finds its key answers without the
database. A key not in the cache is looked up in the store (another worker or node may have
stored it), and every AUTOTUNE_CACHE_TTL seconds a refresher compares the store's key index with
the cache, so a result replaced elsewhere (a run failure lowered it, a newer publish) is seen here
within that time. Its methods turn what a request
names (a registered workload, a device, optional budget, headroom, precision...) into a
`Resolved` probe: the device id, the request key, and the `ProbeRequest` a job would run. Plan
queries resolve through a bounded memo, so a repeated query costs dictionary lookups only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from api.cache import Cached, PlanCache, PlotCache, ResultCache
from api.devices import DeviceCatalog, read_inventory
from api.errors import ServiceDrainingError, ServiceStartingError
from api.jobs import ProbeManager, Runner
from api.metrics import Metrics
from api.schemas import PlanCheckpointing, PlanView, ProbeView
from autotune.engine.probe import ProbeRequest
from autotune.errors import PlanError
from autotune.plans.plan import Plan, Policy, plan
from autotune.request import checkpointing_candidates
from autotune.results import ParallelSpec, ProbeResult
from autotune.settings import Settings
from autotune.store import JobRecord, Store, StoredResult, StoreError, Submitted
from autotune.workloads.probekey import ProbeKey, checkpointing_key, key_for_request
from autotune.workloads.registry import RegisteredWorkload, Registry, load_registry

log = logging.getLogger(__name__)

MAX_ACCUMULATION_STEPS = 10_000  # beyond this a plan is a typo, and its JSON megabytes long


@dataclass(frozen=True)
class Resolved:
    entry: RegisteredWorkload
    device: str
    key: ProbeKey
    digest: str
    request: ProbeRequest


class Starting:
    """What a server that answers but has no `Service` yet is doing, for /readyz and its 503s."""

    def __init__(self) -> None:
        self.doing = "starting"
        self.failure: str | None = None  # the last attempt's error, while it tries again

    def __call__(self, doing: str) -> None:
        self.doing = doing

    def describe(self) -> str:
        return self.doing if self.failure is None else f"{self.doing}; the last try failed: {self.failure}"


def serving(app: Any) -> Service:
    """The app's service; or 503 (`ServiceStartingError`, `ServiceDrainingError`) while it starts
    or shuts down: the server answers, so a client knows it is up and waits."""
    state = app.state
    draining = getattr(state, "draining", None)
    if draining is not None and draining.is_set():
        raise ServiceDrainingError(
            "the server is shutting down: ask again in a moment (its successor, or another worker, answers)"
        )
    svc: Service | None = getattr(state, "service", None)
    if svc is None:
        starting = getattr(state, "starting", None)
        doing = starting.describe() if isinstance(starting, Starting) else "starting"
        raise ServiceStartingError(f"the server is starting ({doing}): ask again in a moment")
    return svc


class Service:
    def __init__(
        self,
        settings: Settings,
        *,
        inventory: Callable[[], Any] | None = None,
        runner: Runner | None = None,
        progress: Callable[[str], None] = lambda _doing: None,
    ) -> None:
        self.settings = settings
        progress("loading the registered workloads")
        self.registry: Registry = load_registry(settings.workloads)
        # Reads NVML (`autotune.devices.nvml.inventory`); tests pass a stand-in.
        self.read_inventory: Callable[[], Any] = inventory or read_inventory
        progress("reading the node's GPUs (NVML)")
        self.devices = DeviceCatalog(
            self.read_inventory(),
            settings.cpu_memory,
            settings.max_cpu_memory,
        )
        progress("opening the database and migrating its schema")
        self.store = Store(settings.db)
        self.metrics = Metrics()
        progress("loading the stored results")
        try:
            self.results = ResultCache(self.store.results_by_key())
        except BaseException:
            self.store.close()
            raise
        self.plans = PlanCache()
        self.plots = PlotCache()
        self.jobs = ProbeManager(
            self.store,
            self.results,
            self.metrics,
            node=settings.node,
            devices=self.devices.ids(),
            timeout=settings.probe_timeout,
            lease_seconds=settings.lease_seconds,
            max_queue=settings.max_queue,
            runner=runner,
        )
        self._resolved: OrderedDict[tuple[Any, ...], Resolved] = OrderedDict()
        self.check_writable()  # this node is seen from now on (and readiness knows whether writes work)
        self.interrupted = self.jobs.start()
        self._closing = threading.Event()
        self._refresher = threading.Thread(target=self._refresh, name="autotune-results-refresh", daemon=True)
        self._refresher.start()
        log.info(
            "autotune service: node %s, %d workload(s), devices %s, store %s, %d stored result key(s), "
            "%d interrupted job(s) queued again or failed",
            settings.node,
            len(self.registry),
            ", ".join(self.devices.ids()),
            self.store.name,
            len(self.results),
            len(self.interrupted),
        )

    def close(self) -> None:
        self._closing.set()
        self.jobs.close()
        self._refresher.join(timeout=5)
        self.store.close()

    # Stored results ----------------------------------------------------------------------------
    def lookup(self, digest: str) -> Cached | None:
        """The result answering a request key: from memory, else from the store (stored by
        another worker or node since), then kept in memory."""
        cached = self.results.get(digest)
        if cached is not None:
            return cached
        try:
            stored = self.store.result_for_key(digest)
        except StoreError:
            return None  # the probe path that follows reports the store's state
        return None if stored is None else self.results.put(digest, stored)

    def _refresh(self) -> None:
        # Two clocks in one thread: every lease/3 this node says it is alive (other nodes leave the
        # jobs queued for it alone) and queues again running jobs anywhere whose worker went silent
        # (nobody else may look at a dead node's jobs); every AUTOTUNE_CACHE_TTL it learns of
        # results stored elsewhere that replace cached ones or answer new keys.
        lease, ttl = self.settings.lease_seconds, self.settings.cache_ttl
        last_seen = last_refresh = 0.0
        while not self._closing.wait(min(ttl, lease / 3)):
            if time.monotonic() - last_seen >= lease / 3:
                if self.check_writable() is None:
                    last_seen = time.monotonic()
                try:
                    self.store.sweep_stale(lease)  # the jobs it queues again are counted (`on_rerun`)
                except StoreError as exc:
                    log.warning("could not look for stale probe jobs: %s", exc)
            if time.monotonic() - last_refresh >= ttl:
                last_refresh = time.monotonic()
                self._learn_results()

    def _learn_results(self) -> None:
        try:
            for key, stored_at in self.store.key_index().items():
                cached = self.results.get(key)
                if cached is None or datetime.fromisoformat(stored_at) > cached.stored.stored_at:
                    stored = self.store.result_for_key(key)
                    if stored is not None:
                        self.results.put(key, stored)
        except StoreError as exc:
            log.warning("could not refresh stored results: %s", exc)
        except Exception:  # the refresher must outlive a bad row
            log.exception("refreshing stored results failed")

    def check_writable(self) -> str | None:
        """None when a write succeeds now, else why not (readiness)."""
        try:
            self.store.touch_node(self.settings.node)
        except StoreError as exc:
            return str(exc)
        return None

    # Resolving requests ----------------------------------------------------------------------
    def resolve(
        self,
        workload: str,
        *,
        device: str | None = None,
        memory: int | None = None,
        budget: Literal["total", "free"] | None = None,
        headroom: float | int | None = None,
        precision: str | None = None,
        optimizer: str | None = None,
        steps: int | None = None,
        max_batch: int | None = None,
        granularity: int | None = None,
        parallel: ParallelSpec | None = None,
        checkpointing: str | None = None,
        plan_for: tuple[int, int, Policy] | None = None,
    ) -> Resolved:
        """Raises UnknownWorkloadError (404), NoDeviceError (503) or ConfigError (422).

        `checkpointing`: a setting, or a choice among settings (auto), which is made for the plan
        `plan_for` (effective batch, world size, policy): the fastest setting depends on it."""
        spec = parallel or ParallelSpec()
        choosing = checkpointing is not None and len(checkpointing_candidates(checkpointing)) > 1
        if not choosing:
            plan_for = None
        memo_key = (
            workload, device, memory, budget, headroom, precision, optimizer, steps, max_batch, granularity, spec,
            checkpointing, plan_for,
        )  # fmt: skip
        found = self._resolved.get(memo_key)
        if found is not None:
            return found
        entry = self.registry.get(workload)
        device_id = self.devices.resolve(device)
        policy = budget or self.settings.budget
        room = self.settings.headroom if headroom is None else headroom
        key = key_for_request(
            entry,
            self.devices.key(device_id, memory),
            budget=policy,
            memory=memory,
            headroom=room,
            precision=precision,
            optimizer=optimizer,
            steps=steps,
            max_batch=max_batch,
            granularity=granularity,
            parallel=spec,
            checkpointing=checkpointing_key(checkpointing, *(plan_for or (None, 1, ""))),
        )
        # Everything explicit, so that the child's own AUTOTUNE_* defaults cannot make it probe
        # something other than what the key says.
        request = ProbeRequest(
            target=entry.target,
            options=dict(entry.options),
            device=device_id,
            memory=key.device.total_bytes if device_id == "cpu" else memory,
            budget=policy,
            headroom=room,
            precision=key.precision,  # type: ignore[arg-type]
            optimizer=key.optimizer,  # type: ignore[arg-type]
            steps=key.steps,
            max_batch=key.max_batch,
            granularity=key.granularity,
            prefetch=key.prefetch,
            parallel=spec.strategy,
            world_size=spec.world_size,
            reshard_after_forward=spec.reshard_after_forward,
            checkpointing=checkpointing,
        )
        if plan_for is not None:  # the choice is made for this plan: the probe times it
            request = request.model_copy(
                update={"effective_batch": plan_for[0], "world_size": plan_for[1], "policy": plan_for[2]}
            )
        resolved = Resolved(entry=entry, device=device_id, key=key, digest=key.digest(), request=request)
        self._resolved[memo_key] = resolved
        while len(self._resolved) > 1024:
            self._resolved.popitem(last=False)
        return resolved

    def submit(self, resolved: Resolved, *, use_stored: bool, remember: bool = False) -> Submitted:
        """The stored result (`use_stored`), a recent deterministic failure (`remember`), the
        active job, or a new one. Raises QueueFullError (429) or StoreError (503)."""
        submitted = self.jobs.submit(
            request_key=resolved.digest,
            workload=resolved.entry.name,
            device=resolved.device,
            request=resolved.request,
            use_stored=use_stored,
            remember=remember,
        )
        if submitted.stored is not None:
            self.results.put(resolved.digest, submitted.stored)
        return submitted

    # Views -----------------------------------------------------------------------------------
    def job_view(self, job_id: str) -> ProbeView | None:
        """A job as it stands: this process's own knowledge of a job it runs (or could not yet
        record), else the store's, unless the job's spool knows better (`ProbeManager.elsewhere`).
        Raises StoreError (503)."""
        mine = self.jobs.mine(job_id)
        if mine is not None:
            return self.record_view(*mine)
        record = self.store.get_job(job_id)
        if record is None:
            return None
        # The store says `running` for a job that may have ended on another worker of this node
        # while the store could not be written: that worker's spool says, or this is a 503.
        truth = self.jobs.elsewhere(record, lambda: self.store.get_job(job_id))
        return self.record_view(*truth) if truth is not None else self.record_view(record)

    def record_view(self, record: JobRecord, result: ProbeResult | None = None) -> ProbeView:
        if result is None and record.status == "succeeded" and record.fingerprint:
            stored = self.store.get_result(record.fingerprint)
            result = stored.result if stored else None
        waiting = record.waiting if record.status == "running" else None
        return ProbeView(
            id=record.id,
            # Claimed, but another probe holds the device: it has not started.
            status="waiting" if waiting is not None else record.status,
            workload=record.workload,
            device=record.device,
            request_key=record.request_key,
            created_at=record.created_at,
            started_at=None if waiting is not None or record.status == "queued" else record.started_at,
            finished_at=record.finished_at,
            trials=record.trials,
            result=result,
            error=record.error,
            waiting=waiting,
            interruptions=record.interruptions,
        )

    @staticmethod
    def stored_view(resolved: Resolved, stored: StoredResult) -> ProbeView:
        return ProbeView(
            id=None,
            status="succeeded",
            workload=resolved.entry.name,
            device=resolved.device,
            request_key=resolved.digest,
            trials=stored.result.trials,
            result=stored.result,
            finished_at=stored.stored_at,
        )

    # Plans -----------------------------------------------------------------------------------
    def plan_body(
        self, resolved: Resolved, cached: Cached, effective_batch: int, world_size: int, policy: Policy
    ) -> bytes:
        """The JSON of a PlanView, from the plan cache or made now. Raises PlanError (422)."""
        memo = (cached.version, resolved.entry.name, resolved.device, effective_batch, world_size, policy)
        body = self.plans.get(memo)
        if body is None:
            result = cached.stored.result
            made = make_plan(effective_batch, result, world_size, policy)
            body = (
                PlanView(
                    workload=resolved.entry.name,
                    device=resolved.device,
                    fingerprint=result.fingerprint,
                    max_micro_batch=result.max_micro_batch,
                    capped=result.capped,
                    parallel=result.workload.parallel,
                    plan=made,
                    verdict=result.model_copy(update={"plan": made}).verdict,
                    checkpointing=_checkpointing(resolved, result),
                )
                .model_dump_json(exclude=None if resolved.request.checkpointing else {"checkpointing"})
                .encode()
            )
            self.plans.put(memo, body)
        return body


def _checkpointing(resolved: Resolved, result: ProbeResult) -> PlanCheckpointing | None:
    """What the plan runs with, for a query that asked for checkpointing: the setting, and with a
    choice among settings why it was chosen."""
    if resolved.request.checkpointing is None:
        return None
    choice = result.checkpointing
    return PlanCheckpointing(
        setting=result.workload.checkpointing or "none",
        reason=None if choice is None else choice.reason,
        candidates=[] if choice is None else [c.setting for c in choice.candidates],
    )


def check_plan(effective_batch: int, world_size: int, policy: Policy) -> None:
    """Fail fast, before any probe, on a plan no micro-batch size could satisfy."""
    plan(effective_batch, effective_batch, world_size, policy)  # one step: only the arithmetic checks run


def make_plan(effective_batch: int, result: ProbeResult, world_size: int, policy: Policy) -> Plan:
    """The result's plan (each micro-batch paired only with a loop it was verified for), bounded in steps."""
    max_micro_batch = result.max_micro_batch
    per_rank = effective_batch // max(world_size, 1)
    single = result.max_micro_batch_without_accumulation
    if (single is not None and per_rank <= single) or max_micro_batch is None:
        fewest = 1
    else:
        fewest = -(-per_rank // max_micro_batch)
    if fewest > MAX_ACCUMULATION_STEPS:
        raise PlanError(
            f"effective batch {effective_batch} needs {fewest} accumulation steps of at most "
            f"{max_micro_batch} per rank: more than the {MAX_ACCUMULATION_STEPS} this service plans"
        )
    made = result.make_plan(effective_batch, world_size, policy)
    if made.accumulation_steps > MAX_ACCUMULATION_STEPS:
        raise PlanError(
            f"policy exact needs {made.accumulation_steps} accumulation steps for effective batch "
            f"{effective_batch}: more than the {MAX_ACCUMULATION_STEPS} this service plans; use fewest-steps"
        )
    return made
