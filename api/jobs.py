"""Probe jobs: created, claimed and finished in the database, so that any number of workers and
nodes share them; one probe at a time per device, whoever runs it.

`submit` (event loop) asks the store for the request key's result, recent deterministic failure
or active job, or creates a queued one (the store's uniqueness rule, not this process, decides
between concurrent requests). Every device of this node has a worker thread in every server
process: it claims the oldest queued job of its (node, device) when it holds the device's lease,
runs it through `autotune.engine.confirm.probe_and_confirm` (an isolated child with the timeout, then the
fresh-process confirmation) while a heartbeat renews the lease, and finishes it in one
transaction. A worker whose process dies stops heartbeating: its job is queued again under its id
(at once when the dead process was on this host: the node's other workers look for that as they
look for queued jobs; else after a lease), so its waiters go on waiting and the node's next free
worker runs it; queued jobs wait for any worker of the node, this process's successor included. A
server that shuts down puts its running job back in the queue the same way.

A claimed job holds its device's lock (`autotune.engine.lock`) for the whole probe, taken here
before the probe starts: while another probe holds it (the command line, a script, or the probe
processes of a worker that was killed, which hold it until they have exited), the job is
`waiting`, with the holder and since when, in the store and in this process; `started_at` is
when it took the device. `finished_at` is when the probe ended, whenever the store records it.

What is true is kept in memory when the database cannot be written (a full disk): the running
job's trials, and its outcome until a later write succeeds, so answers stay true; the result also
goes straight to the result cache, so plan queries use it at once. The node's other workers learn
the outcome from the job's spool file (`api.spool`), written before this worker answers with it;
where there is none to go by, they answer 503 rather than the store's `running` (`elsewhere`).

Waiters (`wait`) are woken by this process's worker directly, or by a watcher that polls the
statuses of the jobs being waited for (a job another process runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from api.cache import ResultCache
from api.metrics import Metrics, outcome_label
from api.spool import Entry, JobSpool
from autotune.engine import lock
from autotune.engine.probe import ProbeRequest
from autotune.errors import AutotuneError
from autotune.results import ProbeResult, TrialRecord
from autotune.store import (
    INTERRUPTED,
    REPEATEDLY_INTERRUPTED,
    DeviceHolder,
    JobError,
    JobRecord,
    JobWait,
    Store,
    StoredResult,
    StoreError,
    Submitted,
    now,
    worker_id,
)
from autotune.store.store import owner_here

log = logging.getLogger(__name__)

Runner = Callable[[ProbeRequest, float, Callable[[TrialRecord], None]], ProbeResult]

# Failures that another probe of the same request would repeat; plan queries answer them from
# the store for a while instead of starting probe after probe (DeviceError included: a service
# without CUDA access, such as one given NVML only, cannot probe a GPU however often it is asked).
# Time-dependent ones (a busy GPU, a timeout, a crash) are not remembered; nor is `Interrupted` (the
# job's node lost it: asking again runs it here), while a job whose worker stopped each time it ran
# (`RepeatedlyInterrupted`) is: it may be what stops them.
DETERMINISTIC = frozenset(
    {
        "NothingFitsError",
        "NotAnOOMError",
        "ConfigError",
        "WorkloadError",
        "PlanError",
        "DeviceError",
        REPEATEDLY_INTERRUPTED,
    }
)
# Failures a client's next question fixes (`GET /v1/plan` asks for the job again itself).
RETRYABLE = frozenset({INTERRUPTED})
FAILURE_MEMORY_SECONDS = 300.0
POLL_SECONDS = 0.5  # how often an idle worker looks for jobs other processes queued
WATCH_SECONDS = 0.25  # how often waiters learn of jobs another process finished


@dataclass
class _Running:
    """A job this process runs, or ran and could not yet record: the truth until the store has it."""

    record: JobRecord
    result: ProbeResult | None = None
    unsaved: bool = False
    trials: list[TrialRecord] = field(default_factory=list)
    spool: Entry | None = None  # where the node's other workers read its outcome until the store has it


def _default_runner(request: ProbeRequest, timeout: float, on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
    from autotune.engine.confirm import probe_and_confirm

    return probe_and_confirm(request, timeout=timeout, on_trial=on_trial)


class ProbeManager:
    def __init__(
        self,
        store: Store,
        cache: ResultCache,
        metrics: Metrics,
        *,
        node: str,
        devices: list[str],
        timeout: float,
        lease_seconds: float,
        max_queue: int,
        runner: Runner | None = None,
        spool: JobSpool | None = None,
    ) -> None:
        self._store = store
        self._spool = spool if spool is not None else JobSpool()
        self._cache = cache
        self._metrics = metrics
        self.node = node
        self.owner = worker_id()
        self._devices = list(devices)
        self._timeout = timeout
        self._lease = lease_seconds
        self._max_queue = max_queue
        self._runner = runner or _default_runner

        def rerun(again: int, failed: int) -> None:  # whichever sweep of this process found them
            if again:
                metrics.probes_requeued.inc(again)
            if failed:
                metrics.probes.labels(outcome_label(REPEATEDLY_INTERRUPTED)).inc(failed)

        store.on_rerun = rerun
        self._lock = threading.Lock()
        self._mine: dict[str, _Running] = {}  # running here, or finished here and not yet recorded
        self._wakeups = {device: threading.Event() for device in self._devices}
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, asyncio.Event] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._draining = False

    def start(self) -> list[str]:
        """Queue again this node's jobs whose worker is gone (fail its queued jobs for devices it no
        longer has), then start a worker per device. Returns the ids of the jobs found interrupted."""
        try:
            interrupted = self._store.sweep(self.node, self._lease)  # counted by `on_rerun`
            failed = self._store.fail_queued_without_device(self.node, self._devices)
        except StoreError as exc:
            log.warning("could not look for interrupted jobs: %s", exc)
            interrupted, failed = [], []
        interrupted += failed
        if failed:
            self._metrics.probes.labels(outcome_label(INTERRUPTED)).inc(len(failed))
        self._forget_spooled()
        for device in self._devices:
            thread = threading.Thread(target=self._work, args=(device,), name=f"autotune-probes-{device}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return interrupted

    # Event loop side -------------------------------------------------------------------------
    def submit(
        self, *, request_key: str, workload: str, device: str, request: ProbeRequest, use_stored: bool, remember: bool
    ) -> Submitted:
        """The stored result (`use_stored`), a recent deterministic failure (`remember`), the
        active job for `request_key`, or a new queued one. Raises QueueFullError, StoreError.
        Blocking (the store): the event loop calls it through a thread."""
        if self._closing.is_set():
            raise StoreError("the server is shutting down: ask again once it is back")
        record = JobRecord(
            id=uuid.uuid4().hex,
            request_key=request_key,
            workload=workload,
            device=device,
            node=self.node,
            request=request.model_dump(mode="json"),
            status="queued",
            created_at=now(),
        )
        submitted = self._store.submit(
            record,
            max_queue=self._max_queue,
            use_stored=use_stored,
            failure_memory=FAILURE_MEMORY_SECONDS if remember else None,
            remembered=DETERMINISTIC,
            lease_seconds=self._lease,
        )
        queued = submitted.job is not None and submitted.job.status == "queued"  # new, or queued again
        if queued and device in self._wakeups:
            self._wakeups[device].set()
        if submitted.job is not None:
            return Submitted(job=self._truth(submitted.job), created=submitted.created, stored=submitted.stored)
        return submitted

    def mine(self, job_id: str) -> tuple[JobRecord, ProbeResult | None] | None:
        with self._lock:
            found = self._mine.get(job_id)
            return None if found is None else (self._snapshot(found), found.result)

    def elsewhere(
        self, record: JobRecord, reread: Callable[[], JobRecord | None]
    ) -> tuple[JobRecord, ProbeResult | None] | None:
        """The truth about a job the store says is running on another worker of this node, where
        it differs from the store's: its outcome from the spool once it has finished there. None
        when the store's record is the truth (not running, not this node's, running here or on a
        live worker whose spool says so). Raises StoreError (503) when nothing tells: it ended, or
        its worker is gone, and the store does not say how yet (it cannot be written)."""
        if record.status != "running" or record.node != self.node or record.owner == self.owner:
            return None
        here = owner_here(record.owner)
        if here is None:
            return None  # a worker of another host: the store is what this node knows
        spooled = None
        for _ in range(4):  # a job claimed this moment has its spool file a moment later
            spooled = self._spool.read(record.id)
            if spooled is not None or not here:
                break
            time.sleep(0.02)
        if spooled is not None and spooled.state == "running" and here:
            return None
        if spooled is not None and spooled.state == "finished" and spooled.record is not None:
            return spooled.record, spooled.result
        again = reread()  # its worker may have recorded it (and removed its spool file) since
        if again is not None and again.status != "running":
            return again, None
        who = "another worker of this node" if here else "a worker of this node that has stopped"
        raise StoreError(
            f"probe {record.id} ran on {who}, and the store cannot say yet how it ended (it cannot be written "
            "now): ask again in a moment"
        )

    async def wait(self, job_id: str, timeout: float) -> None:
        """Return when the job has finished, or after `timeout` seconds, whichever is first."""
        if timeout <= 0 or self._draining:
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        event = self._waiters.get(job_id)
        if event is None:
            event = self._waiters[job_id] = asyncio.Event()
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    async def _watch(self) -> None:
        while self._waiters:
            ids = list(self._waiters)
            try:
                statuses: dict[str, str] | None = await asyncio.to_thread(self._store.job_statuses, ids)
            except StoreError:
                statuses = None  # unknown, not finished: the waiters go on waiting (their own timeout ends it)
            for job_id in ids:
                mine = self.mine(job_id)
                status: str
                if mine is not None:
                    status = mine[0].status
                elif statuses is None:
                    continue
                else:
                    status = statuses.get(job_id, "failed")
                    if status == "running":  # finished on another worker, not recorded yet?
                        spooled = await asyncio.to_thread(self._spool.read, job_id)
                        status = "finished" if spooled is not None and spooled.state != "running" else status
                if status not in ("queued", "running"):
                    event = self._waiters.pop(job_id, None)
                    if event is not None:
                        event.set()
            for job_id, event in list(self._waiters.items()):
                if event.is_set():  # woken by this process's worker
                    self._waiters.pop(job_id, None)
            await asyncio.sleep(WATCH_SECONDS)

    def drain(self) -> None:
        """The server is shutting down: every waiter returns now (the request answers 503
        "draining"), and later waits return at once. Safe to call from a signal handler."""
        self._draining = True
        loop = self._loop
        if loop is None:
            return

        def wake_all() -> None:
            for event in self._waiters.values():
                event.set()
            self._waiters.clear()

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
            loop.call_soon_threadsafe(wake_all)

    def depth(self, device: str) -> int:
        """Queued and running jobs of this node's `device`, from the store."""
        return self.depths().get(device, 0)

    def depths(self) -> dict[str, int]:
        """Queued and running jobs of this node, by device (every device, zero included)."""
        try:
            found = self._store.active_jobs(self.node)
        except StoreError:
            found = {}
        return {device: found.get(device, 0) for device in [*self._devices, *found]}

    def close(self) -> None:
        """Stop claiming; put the job this process is running back in the queue, under its id, for
        the node's other workers or this server's successor (its probe's processes end with this
        process, and hold the device's lock until they have); queued jobs stay queued."""
        self._closing.set()
        for wakeup in self._wakeups.values():
            wakeup.set()
        self._record_unsaved()  # outcomes clients were told, not yet in the store: a last try
        with self._lock:
            running = [m for m in self._mine.values() if m.record.status == "running"]
            spooled = [m.spool for m in self._mine.values() if m.spool is not None]
        for mine in running:
            try:
                if self._store.requeue(mine.record, self.owner):
                    log.warning("probe job %s queued again: this server is shutting down", mine.record.id)
                    self._metrics.probes_requeued.inc()
            except StoreError as exc:  # its lease expires instead, and a sweep queues it again
                log.warning("could not queue job %s again: %s", mine.record.id, exc)
        for entry in spooled:  # what this process knew goes with it: the others answer 503, not `running`
            entry.remove()
        # Idle workers stop within a poll; one running a probe cannot be interrupted (it waits on
        # the probe child, which ends with this process), so the wait is short.
        for thread in self._threads:
            thread.join(timeout=POLL_SECONDS * 2)

    # Worker side -----------------------------------------------------------------------------
    def _work(self, device: str) -> None:
        wakeup = self._wakeups[device]
        while not self._closing.is_set():
            try:
                self._record_unsaved()
                job = self._store.claim(self.node, device, self.owner, self._lease)
            except StoreError as exc:
                log.warning("could not look for probe jobs on %s: %s", device, exc)
                job = None
            except Exception:  # the worker must outlive anything: its device's jobs wait on it
                log.exception("probe worker for %s: unexpected failure", device)
                job = None
            if job is None:
                wakeup.wait(POLL_SECONDS)
                wakeup.clear()
                continue
            try:
                self._run(job)
            except Exception:  # the worker must outlive any one job's failure
                log.exception("probe job %s: unexpected failure in the worker", job.id)

    def _run(self, record: JobRecord) -> None:
        mine = _Running(record=record, trials=list(record.trials), spool=self._spool.start(record.id))
        with self._lock:
            self._mine[record.id] = mine
        self._metrics.probes_started.labels(record.device).inc()
        beating = threading.Event()
        heart = threading.Thread(
            target=self._beat, args=(record, beating), daemon=True, name=f"heartbeat-{record.id[:8]}"
        )
        heart.start()
        started = time.perf_counter()
        error: JobError | None = None
        result: ProbeResult | None = None
        try:
            request = ProbeRequest.model_validate(record.request)
            # The device's lock, before the probe: `waiting` while another holds it (the probe's
            # own calls take it again, re-entrant in this thread).
            with lock.device_lock(
                request.device,
                on_wait=lambda wait: self._on_wait(mine, wait),
                kind="service",
                name=f"probe {record.id} on node {self.node}",
            ):
                self._started(mine)
                result = self._runner(request, self._timeout, lambda trial: self._on_trial(mine, trial))
        except AutotuneError as exc:
            error = JobError(type=type(exc).__name__, message=str(exc))
        except Exception as exc:  # an engine bug must fail the job, not the worker
            log.exception("probe job %s failed unexpectedly", record.id)
            error = JobError(
                type="InternalError", message=f"the probe failed unexpectedly: {type(exc).__name__}: {exc}"
            )
        finally:
            beating.set()
            heart.join(timeout=self._lease)  # no heartbeat may land after the outcome is recorded
        seconds = time.perf_counter() - started
        if self._closing.is_set():
            return  # close() has marked it interrupted
        with self._lock:
            if error is None:
                assert result is not None
                update: dict[str, object] = {"status": "succeeded", "fingerprint": result.fingerprint}
            else:
                update = {"status": "failed", "error": error}
            outcome = self._snapshot(mine).model_copy(update={**update, "finished_at": now()})
        # The node's other workers can read it before this one answers with it: no worker says
        # `running` once any has said how it ended.
        if mine.spool is not None and not mine.spool.finish(outcome, result):
            log.warning("probe job %s: its outcome is too large for its spool file", record.id)
        with self._lock:
            mine.record.finished_at = outcome.finished_at
            mine.record.status = outcome.status
            mine.record.fingerprint = outcome.fingerprint
            mine.record.error = outcome.error
            mine.result = result
            mine.unsaved = True
        if result is not None:
            # Plan queries use it at once, whether or not the store can take it now.
            self._cache.put(record.request_key, StoredResult(result=result, source="probe", stored_at=now()))
        self._metrics.probes.labels(outcome_label(error.type if error else None)).inc()
        self._metrics.probe_seconds.observe(seconds)
        self._record(mine)
        self._wake(record.id)

    def _on_wait(self, mine: _Running, wait: lock.Wait) -> None:
        """The job's device is held by another probe (or another has taken it meanwhile): the job
        is `waiting`, for whom and since when, here at once and in the store when it can be written."""
        if wait.done:
            return
        with self._lock:
            since = mine.record.waiting.since if mine.record.waiting is not None else now()
            mine.record.waiting = JobWait(since=since, holder=_holder(wait))
            waiting, started = mine.record.waiting, mine.record.started_at or now()
        log.warning("probe job %s %s", mine.record.id, wait.line())
        try:
            self._store.wait_state(mine.record.id, self.owner, started_at=started, waiting=waiting)
        except StoreError as exc:  # the heartbeat says it again
            log.warning("probe job %s: its wait not recorded: %s", mine.record.id, exc)

    def _started(self, mine: _Running) -> None:
        """The job holds its device: its probe starts now (`started_at`, unless it never waited)."""
        with self._lock:
            if mine.record.waiting is None:
                return  # took it at once: started when it was claimed
            mine.record.waiting = None
            mine.record.started_at = started = now()
        try:
            self._store.wait_state(mine.record.id, self.owner, started_at=started, waiting=None)
        except StoreError as exc:  # the heartbeat says it again
            log.warning("probe job %s: its start not recorded: %s", mine.record.id, exc)

    def _beat(self, record: JobRecord, stop: threading.Event) -> None:
        while not stop.wait(self._lease / 3):
            with self._lock:
                mine = self._mine.get(record.id)
                started = None if mine is None else mine.record.started_at
                waiting = None if mine is None else mine.record.waiting
            try:
                if not self._store.heartbeat(
                    record.id,
                    record.node,
                    record.device,
                    self.owner,
                    self._lease,
                    started_at=started,
                    waiting=waiting,
                ):
                    log.warning("probe job %s: this worker lost the lease on %s", record.id, record.device)
            except StoreError as exc:
                log.warning("probe job %s: heartbeat not recorded: %s", record.id, exc)

    def _record(self, mine: _Running) -> bool:
        """Write a finished job's outcome; on success forget it here. False if the store refused."""
        record = mine.record
        try:
            if mine.result is not None:
                stored = self._store.finish(record, mine.result, self.owner, list(mine.trials))
                self._cache.put(record.request_key, stored)
            else:
                assert record.error is not None
                self._store.fail(record, record.error, owner=self.owner, finished_at=record.finished_at)
                for seq, trial in enumerate(mine.trials, start=1):
                    self._store.add_trial(record.id, seq, trial)
        except StoreError as exc:
            log.warning("probe job %s: outcome not recorded yet (%s); kept in memory and retried", record.id, exc)
            return False
        with self._lock:
            self._mine.pop(record.id, None)
        if mine.spool is not None:  # after the store has it: a reader finds one or the other
            mine.spool.remove()
        return True

    def _record_unsaved(self) -> None:
        with self._lock:
            pending = [m for m in self._mine.values() if m.unsaved]
        for mine in pending:
            if not self._record(mine):
                return

    def _forget_spooled(self) -> None:
        """Spool files left by workers that stopped before the store recorded their job's end."""
        directory = self._spool.directory
        if directory is None:
            return
        try:
            names = [path.name.removesuffix(".spool") for path in directory.glob("*.spool")]
            statuses = self._store.job_statuses(names) if names else {}
        except (OSError, StoreError) as exc:
            log.warning("could not look for old spool files: %s", exc)
            return
        for job_id in names:
            # Only jobs this store knows have ended: a spool directory may serve several stores.
            if statuses.get(job_id) in ("succeeded", "failed"):
                with contextlib.suppress(OSError):
                    (directory / f"{job_id}.spool").unlink()

    def _on_trial(self, mine: _Running, trial: TrialRecord) -> None:
        with self._lock:
            mine.trials.append(trial)
            seq = len(mine.trials)
        try:
            self._store.add_trial(mine.record.id, seq, trial)
        except StoreError as exc:
            log.warning("could not store trial %d of job %s: %s", seq, mine.record.id, exc)

    def _wake(self, job_id: str) -> None:
        loop = self._loop
        if loop is None:
            return

        def wake() -> None:
            event = self._waiters.pop(job_id, None)
            if event is not None:
                event.set()

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
            loop.call_soon_threadsafe(wake)

    def _truth(self, record: JobRecord) -> JobRecord:
        with self._lock:
            mine = self._mine.get(record.id)
            return record if mine is None else self._snapshot(mine)

    @staticmethod
    def _snapshot(mine: _Running) -> JobRecord:
        # Called with the lock held: a copy the caller may read while the worker goes on.
        return mine.record.model_copy(update={"trials": list(mine.trials)})


def _holder(wait: lock.Wait) -> DeviceHolder:
    """Who holds the device, from what its lock file says (`lock.holder`)."""
    record = wait.record or {}
    kind = record.get("kind")
    pid, command, started = record.get("pid"), record.get("command"), record.get("started")
    return DeviceHolder(
        kind=kind if kind in lock.KINDS else "unknown",  # type: ignore[arg-type]
        description=wait.holder,
        pid=pid if isinstance(pid, int) else None,
        command=command if isinstance(command, str) else None,
        since=datetime.fromtimestamp(started, UTC) if isinstance(started, int | float) else None,
    )
