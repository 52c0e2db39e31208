"""Probe jobs: one queue and one worker per device, so two probes never share a GPU.

`submit` runs on the event loop. It returns the job already queued or running for the same
request key, or queues a new one: with no await between the lookup and the insert, any number of
identical concurrent requests get one job. Each device's worker is a daemon thread that runs its
jobs one at a time through `autotune.confirm.probe_and_confirm` (a spawned child with the timeout,
then the fresh-process confirmation),
so the event loop keeps answering while probes run. Trials are written to the store as they
arrive (live progress that survives a crash); the result is stored, then put in the result cache,
then the job leaves the active table, so that at every moment a request finds the job or its
result. Waiters on the loop are woken through `call_soon_threadsafe`.

The workers are daemon threads on purpose: a probe cannot be interrupted from outside, so a server
shutting down must not wait for one. Its queued and running jobs are marked failed (interrupted),
and the probe child is terminated with the process (multiprocessing's exit handler ends daemon
children; a child whose parent was killed outright notices within a second and exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from api.cache import ResultCache
from api.metrics import Metrics, outcome_label
from autotune.errors import AutotuneError
from autotune.probe import ProbeRequest
from autotune.results import ProbeResult, TrialRecord
from autotune.store import INTERRUPTED, JobError, JobRecord, Store, StoreError, now

log = logging.getLogger(__name__)

Runner = Callable[[ProbeRequest, float, Callable[[TrialRecord], None]], ProbeResult]

# Failures that another probe of the same request would repeat; plan queries answer them from
# memory for a while instead of starting probe after probe (DeviceError included: a service
# without CUDA access, such as one given NVML only, cannot probe a GPU however often it is asked).
# Time-dependent ones (a busy GPU, a timeout, a crash) are not remembered.
DETERMINISTIC = frozenset(
    {"NothingFitsError", "NotAnOOMError", "ConfigError", "WorkloadError", "PlanError", "DeviceError"}
)
FAILURE_MEMORY_SECONDS = 300.0


@dataclass
class _Job:
    record: JobRecord
    request: ProbeRequest
    done: asyncio.Event
    trials: list[TrialRecord] = field(default_factory=list)


def _default_runner(request: ProbeRequest, timeout: float, on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
    from autotune.confirm import probe_and_confirm

    return probe_and_confirm(request, timeout=timeout, on_trial=on_trial)


class ProbeManager:
    def __init__(
        self,
        store: Store,
        cache: ResultCache,
        metrics: Metrics,
        *,
        timeout: float,
        runner: Runner | None = None,
    ) -> None:
        self._store = store
        self._cache = cache
        self._metrics = metrics
        self._timeout = timeout
        self._runner = runner or _default_runner
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # queued or running
        self._by_key: dict[str, str] = {}  # request key -> active job id
        self._queues: dict[str, queue.Queue[_Job | None]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._failures: dict[str, tuple[float, str]] = {}  # request key -> (when, job id)
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # Event loop side -------------------------------------------------------------------------
    def submit(self, *, request_key: str, workload: str, device: str, request: ProbeRequest) -> tuple[JobRecord, bool]:
        """The active job for `request_key`, or a new queued one. Returns (job, created)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        with self._lock:
            if self._closing:
                raise StoreError("the server is shutting down: ask again once it is back")
            active = self._by_key.get(request_key)
            if active is not None:
                return self._snapshot(self._jobs[active]), False
            record = JobRecord(
                id=uuid.uuid4().hex,
                request_key=request_key,
                workload=workload,
                device=device,
                request=request.model_dump(mode="json"),
                status="queued",
                created_at=now(),
            )
            self._store.create_job(record)  # before it is visible: a failed write leaves no ghost job
            job = _Job(record=record, request=request, done=asyncio.Event())
            self._jobs[record.id] = job
            self._by_key[request_key] = record.id
            self._failures.pop(request_key, None)
            self._queue(device).put(job)
            self._update_depth(device)
            return self._snapshot(job), True

    def get(self, job_id: str) -> JobRecord | None:
        """The job while it is queued or running (with its trials so far), else None."""
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else self._snapshot(job)

    def recent_failure(self, request_key: str) -> str | None:
        """The id of a job for this key that failed deterministically in the last few minutes."""
        with self._lock:
            found = self._failures.get(request_key)
            if found is None:
                return None
            when, job_id = found
            if time.monotonic() - when > FAILURE_MEMORY_SECONDS:
                del self._failures[request_key]
                return None
            return job_id

    async def wait(self, job_id: str, timeout: float) -> None:
        """Return when the job has finished, or after `timeout` seconds, whichever is first."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None or timeout <= 0:
            return
        try:
            await asyncio.wait_for(job.done.wait(), timeout)
        except TimeoutError:
            return

    def depth(self, device: str) -> int:
        with self._lock:
            return self._depth(device)

    def close(self) -> None:
        """Stop taking jobs; mark the queued and running ones failed (interrupted)."""
        with self._lock:
            self._closing = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._by_key.clear()
            queues = list(self._queues.values())
        for job in jobs:
            error = JobError(type=INTERRUPTED, message="interrupted: the server shut down; ask for the probe again")
            try:
                self._store.fail_job(job.record.id, error)
            except StoreError as exc:
                log.warning("could not mark job %s interrupted: %s", job.record.id, exc)
            self._metrics.probes.labels(outcome_label(INTERRUPTED)).inc()
            job.done.set()
        for q in queues:
            q.put(None)

    # Worker side -----------------------------------------------------------------------------
    def _queue(self, device: str) -> queue.Queue[_Job | None]:
        q = self._queues.get(device)
        if q is None:
            q = self._queues[device] = queue.Queue()
            thread = threading.Thread(target=self._work, args=(q,), name=f"autotune-probes-{device}", daemon=True)
            self._threads[device] = thread
            thread.start()
        return q

    def _work(self, q: queue.Queue[_Job | None]) -> None:
        while True:
            job = q.get()
            if job is None or self._closing:
                return
            try:
                self._run(job)
            except Exception:  # the worker must outlive any one job's failure
                log.exception("probe job %s: unexpected failure in the worker", job.record.id)

    def _run(self, job: _Job) -> None:
        record = job.record
        with self._lock:
            record.status = "running"
            record.started_at = now()
        try:
            self._store.mark_running(record.id, record.started_at)
        except StoreError as exc:  # the probe can still run and its outcome be stored
            log.warning("could not mark job %s running: %s", record.id, exc)
        self._metrics.probes_started.labels(record.device).inc()
        started = time.perf_counter()
        error: JobError | None = None
        try:
            result = self._runner(job.request, self._timeout, lambda trial: self._on_trial(job, trial))
        except AutotuneError as exc:
            error = JobError(type=type(exc).__name__, message=str(exc))
        except Exception as exc:  # an engine bug must fail the job, not the worker
            log.exception("probe job %s failed unexpectedly", record.id)
            error = JobError(
                type="InternalError", message=f"the probe failed unexpectedly: {type(exc).__name__}: {exc}"
            )
        else:
            if not self._closing:
                try:
                    stored = self._store.put_result(result, record.request_key, source="probe", job_id=record.id)
                except StoreError as exc:
                    error = JobError(
                        type="StoreError", message=f"the probe succeeded but its result was not stored: {exc}"
                    )
                else:
                    self._cache.put(record.request_key, stored)
        seconds = time.perf_counter() - started
        if self._closing:
            return  # close() has marked it interrupted
        if error is not None:
            try:
                self._store.fail_job(record.id, error)
            except StoreError as exc:
                log.warning("could not record the failure of job %s: %s", record.id, exc)
        self._metrics.probes.labels(outcome_label(error.type if error else None)).inc()
        self._metrics.probe_seconds.observe(seconds)
        with self._lock:
            self._jobs.pop(record.id, None)
            if self._by_key.get(record.request_key) == record.id:
                del self._by_key[record.request_key]
            if error is not None and error.type in DETERMINISTIC:
                self._failures[record.request_key] = (time.monotonic(), record.id)
            self._update_depth(record.device)
        self._wake(job)

    def _on_trial(self, job: _Job, trial: TrialRecord) -> None:
        with self._lock:
            job.trials.append(trial)
            seq = len(job.trials)
        try:
            self._store.add_trial(job.record.id, seq, trial)
        except StoreError as exc:
            log.warning("could not store trial %d of job %s: %s", seq, job.record.id, exc)

    def _wake(self, job: _Job) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
            loop.call_soon_threadsafe(job.done.set)

    def _depth(self, device: str) -> int:
        # Called with the lock held.
        return sum(1 for job in self._jobs.values() if job.record.device == device)

    def _update_depth(self, device: str) -> None:
        # Called with the lock held.
        self._metrics.queue_depth.labels(device).set(self._depth(device))

    def _snapshot(self, job: _Job) -> JobRecord:
        # Called with the lock held: a copy the caller may read while the worker goes on.
        return job.record.model_copy(update={"trials": list(job.trials)})
