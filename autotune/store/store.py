"""The service's persistent state: probe results and probe jobs, in SQLite or PostgreSQL.

Results are never deleted by the service; a restart keeps every one. Everything that decides
what runs lives here, not in a process's memory, so any number of workers and nodes can share
one database:

- `submit` creates a job unless the request key already has a stored result (when asked), a
  recent deterministic failure (when asked) or a queued/running job; the partial unique index on
  active jobs makes the last rule hold between processes, and the per-device queue is bounded.
- `claim` gives a worker the oldest queued job of a (node, device) only while it holds that
  device's lease: one probe per device whoever runs it. The worker renews the lease and the job's
  heartbeat (`heartbeat`); `sweep` queues again, under its id, a running job whose worker went
  silent for a lease period, or at once when its worker was on this host and its process is gone
  (`MAX_RERUNS` times; then it fails as `REPEATEDLY_INTERRUPTED`). A claimed job says what it
  waits for (`wait_state`: the holder of its device's lock) until its probe starts.
- `finish` stores a job's result, maps its request key and releases the lease in one transaction:
  at every moment a reader finds the job active or its result stored. A job's `finished_at` is
  when its probe ended, as the worker saw it, not when the store could record it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import Connection, and_, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from autotune.errors import QueueFullError, StoreError
from autotune.results import ProbeResult, TrialRecord
from autotune.store import engine as engines
from autotune.store.schema import device_leases, jobs, nodes, result_keys, results, trials

log = logging.getLogger(__name__)

JobStatus = Literal["queued", "running", "succeeded", "failed"]
ACTIVE: tuple[JobStatus, ...] = ("queued", "running")
# A job that could not run to its end for a reason that is not the probe's (its node lost the
# device or stopped answering while it was queued): asking again starts it afresh.
INTERRUPTED = "Interrupted"
# A job whose worker stopped while running it, each time it ran: the probe itself may be what
# takes its worker down (the host's out-of-memory killer), so it is not run again by itself.
REPEATEDLY_INTERRUPTED = "RepeatedlyInterrupted"
MAX_RERUNS = 2  # a job whose worker stops is queued again this many times (it runs at most 3 times)
QUEUE_RETRY_AFTER = 30  # seconds a client told 429 waits: probes take tens of seconds to minutes


class JobError(BaseModel):
    """Why a job failed: our exception's class name and its message."""

    type: str
    message: str


class DeviceHolder(BaseModel):
    """Who holds the device's lock a job waits for, as its lock file names it."""

    kind: Literal["service", "cli", "script", "unknown"] = Field(
        description="The autotune service (one of its workers, or one that stopped: its probe's processes are "
        "ending), the autotune command line, or a script (a training job's local probe, a framework's tuner)."
    )
    description: str = Field(description="In words, as a probe waiting on the command line says it.")
    pid: int | None = None
    command: str | None = Field(default=None, description="The holder's command line.")
    since: datetime | None = Field(default=None, description="When it took the device.")


class JobWait(BaseModel):
    """A claimed job waiting for its device: since when, and who holds it."""

    since: datetime = Field(description="When the job began to wait for the device.")
    holder: DeviceHolder | None = Field(default=None, description="None: the lock file does not say.")


class JobRecord(BaseModel):
    """A probe job as stored."""

    id: str
    request_key: str
    workload: str = Field(description="The registered workload's name.")
    device: str = Field(description="cpu or cuda:N, as the request resolved it.")
    node: str = Field(default="", description="The node whose device runs the job.")
    request: dict[str, Any] = Field(description="The ProbeRequest the job runs.")
    status: JobStatus
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    fingerprint: str | None = None
    error: JobError | None = None
    trials: list[TrialRecord] = Field(default_factory=list)
    owner: str | None = Field(default=None, description="The worker running it (host:pid:nonce), while it runs.")
    interruptions: int = Field(default=0, description="How often a worker running it stopped; it ran again each time.")
    waiting: JobWait | None = Field(default=None, description="Claimed, waiting for its device's lock: for whom.")


class StoredResult(BaseModel):
    """A result with where it came from: a job of this service or a POST from elsewhere."""

    result: ProbeResult
    source: Literal["probe", "published"]
    stored_at: datetime


@dataclass(frozen=True)
class KeyedResult:
    """A stored result with the request key it answers and the succeeded probe that made it
    (None for a published result)."""

    request_key: str
    stored: StoredResult
    probe_id: str | None
    probe_workload: str | None


@dataclass(frozen=True)
class Submitted:
    """What `submit` found or made: a stored result, or a job (new when `created`)."""

    job: JobRecord | None
    created: bool
    stored: StoredResult | None = None


def now() -> datetime:
    return datetime.now(UTC)


def worker_id() -> str:
    """This process, as a lease owner: host, pid and a nonce (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def owner_is_gone(owner: str | None) -> bool:
    """Whether a lease owner is known dead: a process of this host that no longer exists. An
    owner on another host is never judged here; its lease expires instead."""
    return owner_here(owner) is False


def owner_here(owner: str | None) -> bool | None:
    """True: a live process of this host; False: gone (or no owner); None: another host's."""
    if not owner:
        return False
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def worker_is_dead(owner: str | None, heartbeat: float | None, moment: float, lease_seconds: float) -> bool:
    """A running job's worker is dead: its process on this host is gone, or, on another host, it
    has not renewed its heartbeat for a lease. A live process of this host is never judged by its
    heartbeat: it may be unable to write one (a full disk) while it still runs the probe."""
    here = owner_here(owner)
    if here is not None:
        return not here
    return heartbeat is None or heartbeat < moment - lease_seconds


class Store:
    """The store behind one AUTOTUNE_DB (a SQLite path or a postgresql:// URL). Opening it checks
    the database, migrates its schema and keeps a connection pool; `close` releases it."""

    def __init__(self, db: str | Path, *, migrate: bool = True) -> None:
        self.url = engines.database_url(db)
        self.name = engines.describe(self.url)
        self.path: Path | None = Path(str(self.url.database)) if self.url.get_backend_name() == "sqlite" else None
        self.backend = self.url.get_backend_name()
        self._engine = engines.create(self.url)
        # Told how many jobs each sweep of this store queued again and failed (the service's metrics).
        self.on_rerun: Callable[[int, int], None] = lambda _again, _failed: None
        try:
            if migrate:
                engines.migrate(self._engine)
            else:
                engines.refuse_newer(self._engine)
        except BaseException:
            self._engine.dispose()
            raise

    # Plumbing ----------------------------------------------------------------------------------
    @contextmanager
    def _write(self) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn:
                conn.execution_options(immediate=True)
                with conn.begin():
                    yield conn
        except IntegrityError as exc:
            raise _Conflict(f"database {self.name}: {engines.reason(exc)}") from None
        except SQLAlchemyError as exc:
            raise StoreError(f"database {self.name}: {engines.reason(exc)}") from None

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise StoreError(f"database {self.name}: {engines.reason(exc)}") from None

    def _upsert(self, conn: Connection, table: Any, values: dict[str, Any], keys: Sequence[str]) -> None:
        dialect: Any = postgresql if self.backend == "postgresql" else sqlite
        statement = dialect.insert(table).values(**values)
        changed = {name: statement.excluded[name] for name in values if name not in keys}
        conn.execute(statement.on_conflict_do_update(index_elements=list(keys), set_=changed))

    def touch_node(self, node: str) -> None:
        """A small write (this node's last-seen time): readiness says whether writes succeed.
        Raises StoreError."""
        with self._write() as conn:
            self._upsert(conn, nodes, {"node": node, "seen_at": time.time()}, ["node"])

    def close(self) -> None:
        self._engine.dispose()

    # Results ---------------------------------------------------------------------------------
    def put_result(
        self,
        result: ProbeResult,
        request_key: str | None,
        *,
        source: Literal["probe", "published"],
        job_id: str | None = None,
    ) -> StoredResult:
        """Store `result` by fingerprint (replacing one with the same fingerprint), map
        `request_key` to it, and mark `job_id` succeeded, in one transaction."""
        stored_at = now()
        with self._write() as conn:
            self._put(conn, result, request_key, source, stored_at)
            if job_id is not None:
                conn.execute(
                    update(jobs)
                    .where(jobs.c.id == job_id)
                    .values(status="succeeded", finished_at=stored_at.isoformat(), fingerprint=result.fingerprint)
                )
        return StoredResult(result=result, source=source, stored_at=stored_at)

    def _put(self, conn: Connection, result: ProbeResult, key: str | None, source: str, stored_at: datetime) -> None:
        document = {
            "fingerprint": result.fingerprint,
            "document": result.model_dump_json(),
            "source": source,
            "stored_at": stored_at.isoformat(),
        }
        self._upsert(conn, results, document, ["fingerprint"])
        if key is not None:
            mapping = {"request_key": key, "fingerprint": result.fingerprint, "stored_at": stored_at.isoformat()}
            self._upsert(conn, result_keys, mapping, ["request_key"])

    def get_result(self, fingerprint: str) -> StoredResult | None:
        with self._read() as conn:
            row = conn.execute(
                select(results.c.document, results.c.source, results.c.stored_at).where(
                    results.c.fingerprint == fingerprint
                )
            ).first()
        return None if row is None else _stored(fingerprint, *row)

    def result_for_key(self, request_key: str) -> StoredResult | None:
        """The result that answers `request_key`, or None."""
        with self._read() as conn:
            row = conn.execute(_by_key().where(result_keys.c.request_key == request_key)).first()
        return None if row is None else _stored(*row[1:])

    def results_by_key(self) -> dict[str, StoredResult]:
        """Every request key with the result that answers it: what a server loads at start-up."""
        with self._read() as conn:
            rows = conn.execute(_by_key()).all()
        found: dict[str, StoredResult] = {}
        for key, *rest in rows:
            stored = _stored(*rest)
            if stored is not None:
                found[key] = stored
        return found

    def newest_results(self, limit: int) -> tuple[int, list[KeyedResult]]:
        """How many request keys have a result, and the `limit` newest of them (by when the key's
        answer was stored), each with the latest succeeded probe that made it, if one did."""
        with self._read() as conn:
            count = int(conn.execute(select(func.count()).select_from(result_keys)).scalar() or 0)
            newest = conn.execute(
                select(
                    result_keys.c.request_key,
                    results.c.fingerprint,
                    results.c.document,
                    results.c.source,
                    result_keys.c.stored_at,
                )
                .join(results, results.c.fingerprint == result_keys.c.fingerprint)
                .order_by(result_keys.c.stored_at.desc())
                .limit(limit)
            ).all()
            fingerprints = sorted({str(row.fingerprint) for row in newest})
            made_by: dict[str, tuple[str, str, str]] = {}
            if fingerprints:
                rows = conn.execute(
                    select(jobs.c.fingerprint, jobs.c.id, jobs.c.workload, jobs.c.finished_at).where(
                        jobs.c.status == "succeeded", jobs.c.fingerprint.in_(fingerprints)
                    )
                )
                for fingerprint, job_id, workload, finished in rows:
                    if fingerprint not in made_by or str(finished or "") > made_by[fingerprint][2]:
                        made_by[fingerprint] = (str(job_id), str(workload), str(finished or ""))
        found = []
        for key, fingerprint, document, source, stored_at in newest:
            stored = _stored(str(fingerprint), document, source, stored_at)
            if stored is None:
                continue
            probe = made_by.get(str(fingerprint))
            found.append(
                KeyedResult(
                    request_key=str(key),
                    stored=stored,
                    probe_id=probe[0] if probe else None,
                    probe_workload=probe[1] if probe else None,
                )
            )
        return count, found

    def node_job_ids(self, node: str, *, active: bool, limit: int) -> list[str]:
        """A node's queued and running jobs, oldest first (`active`), or its finished ones, newest
        first."""
        with self._read() as conn:
            query = select(jobs.c.id).where(jobs.c.node == node)
            if active:
                query = query.where(jobs.c.status.in_(ACTIVE)).order_by(jobs.c.created_at)
            else:
                query = query.where(jobs.c.status.in_(("succeeded", "failed"))).order_by(jobs.c.finished_at.desc())
            return [str(i) for i in conn.execute(query.limit(limit)).scalars()]

    def key_index(self) -> dict[str, str]:
        """Request key -> when its answer was stored (small rows): how a server learns of results
        stored elsewhere, replaced ones included (a lowered or re-probed result keeps its
        fingerprint, not its time)."""
        with self._read() as conn:
            rows = conn.execute(select(result_keys.c.request_key, result_keys.c.stored_at))
            return {str(k): str(t) for k, t in rows}

    def lower_result(self, request_key: str, lower: Callable[[ProbeResult], ProbeResult]) -> StoredResult | None:
        """Replace the result answering `request_key` by `lower(result)`, read and written in one
        transaction (reports sent to two workers at once both count). None if no result."""
        with self._write() as conn:
            query = _by_key().where(result_keys.c.request_key == request_key)
            if self.backend == "postgresql":
                query = query.with_for_update()
            row = conn.execute(query).first()
            current = None if row is None else _stored(*row[1:])
            if current is None:
                return None
            stored_at = now()
            lowered = lower(current.result)
            self._put(conn, lowered, request_key, current.source, stored_at)
        return StoredResult(result=lowered, source=current.source, stored_at=stored_at)

    def count_results(self) -> int:
        with self._read() as conn:
            return int(conn.execute(select(func.count()).select_from(results)).scalar() or 0)

    # Jobs ------------------------------------------------------------------------------------
    def submit(
        self,
        job: JobRecord,
        *,
        max_queue: int | None = None,
        use_stored: bool = False,
        failure_memory: float | None = None,
        remembered: frozenset[str] = frozenset(),
        lease_seconds: float = 30.0,
    ) -> Submitted:
        """The stored result (with `use_stored`), a failure of a type in `remembered` finished in
        the last `failure_memory` seconds, the active job for `job.request_key`, or `job` created
        now. Raises QueueFullError when its (node, device) already has `max_queue` queued jobs."""
        for _attempt in range(3):
            try:
                return self._submit(job, max_queue, use_stored, failure_memory, remembered, lease_seconds)
            except _LostRace:
                continue  # another process created the job between our look and our insert
        raise StoreError(f"database {self.name}: could not create or find the job for {job.request_key}")

    def _submit(
        self,
        job: JobRecord,
        max_queue: int | None,
        use_stored: bool,
        failure_memory: float | None,
        remembered: frozenset[str],
        lease_seconds: float,
    ) -> Submitted:
        try:
            with self._write() as conn:
                # The active job first, then the result: `finish` writes both in one transaction,
                # and PostgreSQL reads each statement's own snapshot, so in this order one of the
                # two reads sees a job that finishes meanwhile (in the other, neither might).
                active = conn.execute(
                    select(jobs.c.id, jobs.c.node, jobs.c.status, jobs.c.owner, jobs.c.heartbeat).where(
                        jobs.c.request_key == job.request_key, jobs.c.status.in_(ACTIVE)
                    )
                ).first()
                if active is not None and not self._abandon(conn, active, lease_seconds):
                    found = self._job(conn, active.id)
                    assert found is not None
                    return Submitted(job=found, created=False)
                if use_stored:
                    row = conn.execute(_by_key().where(result_keys.c.request_key == job.request_key)).first()
                    stored = None if row is None else _stored(*row[1:])
                    if stored is not None:
                        return Submitted(job=None, created=False, stored=stored)
                if failure_memory is not None and remembered:
                    failed = self._recent_failure(conn, job.request_key, failure_memory, remembered)
                    if failed is not None:
                        return Submitted(job=failed, created=False)
                if max_queue is not None:
                    waiting = conn.execute(
                        select(func.count())
                        .select_from(jobs)
                        .where(jobs.c.node == job.node, jobs.c.device == job.device, jobs.c.status == "queued")
                    ).scalar()
                    if (waiting or 0) >= max_queue:
                        raise QueueFullError(
                            f"device {job.device} on node {job.node} already has {waiting} probes waiting "
                            f"(AUTOTUNE_MAX_QUEUE={max_queue}): ask again later",
                            retry_after=QUEUE_RETRY_AFTER,
                        )
                conn.execute(insert(jobs).values(**_job_row(job)))
        except _Conflict:
            raise _LostRace from None
        return Submitted(job=job, created=True)

    def _abandon(self, conn: Connection, active: Any, lease_seconds: float) -> bool:
        """Settle an active job nobody will finish: running with a silent worker, it is queued
        again under its id for its node's workers (or failed, the last time: `_rerun`); queued on a
        node none of whose servers has been seen for three leases (only that node's workers could
        run it), it fails, so that a new one can be made. True if it was failed."""
        moment = time.time()
        if active.status == "running":
            if not worker_is_dead(active.owner, active.heartbeat, moment, lease_seconds):
                return False
            again, failed = _rerun(conn, [(active.id, active.owner)], "the worker running it stopped")
            self.on_rerun(len(again), len(failed))
            return bool(failed)
        else:
            seen = conn.execute(select(nodes.c.seen_at).where(nodes.c.node == active.node)).scalar()
            gone = seen is not None and seen < moment - 3 * lease_seconds
            why = f"node {active.node}, whose device it was queued for, stopped answering"
        if not gone:
            return False
        conn.execute(
            update(jobs)
            .where(jobs.c.id == active.id, jobs.c.status == active.status)
            .values(
                status="failed",
                finished_at=now().isoformat(),
                error_type=INTERRUPTED,
                error_message=f"interrupted: {why}; ask for it again (POST /v1/probes) to run it",
            )
        )
        log.warning("probe job %s abandoned: %s", active.id, why)
        return True

    def _recent_failure(self, conn: Connection, key: str, seconds: float, types: frozenset[str]) -> JobRecord | None:
        row = conn.execute(
            select(jobs.c.id, jobs.c.error_type, jobs.c.finished_at)
            .where(jobs.c.request_key == key, jobs.c.status == "failed")
            .order_by(jobs.c.created_at.desc())
            .limit(1)
        ).first()
        if row is None or row.error_type not in types or not row.finished_at:
            return None
        if (now() - datetime.fromisoformat(row.finished_at)).total_seconds() > seconds:
            return None
        return self._job(conn, row.id)

    def claim(self, node: str, device: str, owner: str, lease_seconds: float) -> JobRecord | None:
        """The oldest queued job of (node, device), now running for `owner`, if `owner` can take
        the device's lease (free, expired, held by a dead process, or its own) and no job of the
        device is still running. Else None. A running job of the device whose worker is a dead
        process of this host is queued again first (`_sweep`): it is the one claimed then."""
        if not self._has_work(node, device):
            return None  # the common idle case: a read, no write
        with self._write() as conn:
            moment = time.time()  # after the write lock: a wait for it must not age the lease
            holder = conn.execute(
                select(device_leases.c.owner, device_leases.c.expires).where(
                    device_leases.c.node == node, device_leases.c.device == device
                )
            ).first()
            if holder is None:
                try:
                    with conn.begin_nested():
                        conn.execute(
                            insert(device_leases).values(
                                node=node, device=device, owner=owner, expires=moment + lease_seconds
                            )
                        )
                except IntegrityError:
                    return None  # another worker took it just now
            elif holder.owner == owner or holder.expires < moment or owner_is_gone(holder.owner):
                # Only the row as read: a renewal committed since (PostgreSQL reads committed
                # rows statement by statement) changes `expires`, and then it is not ours.
                taken = conn.execute(
                    update(device_leases)
                    .where(
                        device_leases.c.node == node,
                        device_leases.c.device == device,
                        device_leases.c.owner == holder.owner,
                        device_leases.c.expires == holder.expires,
                    )
                    .values(owner=owner, expires=moment + lease_seconds)
                )
                if taken.rowcount != 1:
                    return None
            else:
                return None
            self._sweep(conn, node, device, lease_seconds, moment)
            busy = conn.execute(
                select(jobs.c.id).where(
                    jobs.c.node == node, jobs.c.device == device, jobs.c.status == "running", jobs.c.owner != owner
                )
            ).first()
            job_id = None
            if busy is None:
                job_id = conn.execute(
                    select(jobs.c.id)
                    .where(jobs.c.node == node, jobs.c.device == device, jobs.c.status == "queued")
                    .order_by(jobs.c.created_at)
                    .limit(1)
                ).scalar()
            if job_id is None:
                self._release(conn, node, device, owner)
                return None
            started = conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.status == "queued")
                .values(status="running", started_at=now().isoformat(), owner=owner, heartbeat=moment, waiting=None)
            )
            if started.rowcount != 1:
                self._release(conn, node, device, owner)
                return None
            return self._job(conn, job_id)

    def _has_work(self, node: str, device: str) -> bool:
        """A queued job of (node, device), or a running one whose worker is a dead process of this
        host (kill -9 of a worker: it runs again at once, not after a lease). One read."""
        with self._read() as conn:
            rows = conn.execute(
                select(jobs.c.status, jobs.c.owner).where(
                    jobs.c.node == node, jobs.c.device == device, jobs.c.status.in_(ACTIVE)
                )
            ).all()
        return any(row.status == "queued" or owner_is_gone(row.owner) for row in rows)

    def heartbeat(
        self,
        job_id: str,
        node: str,
        device: str,
        owner: str,
        lease_seconds: float,
        *,
        started_at: datetime | None = None,
        waiting: JobWait | None = None,
    ) -> bool:
        """Renew the device lease and the job's heartbeat (with `started_at`, its start and what it
        waits for as its worker knows them: a `wait_state` write that failed is made good here);
        False if this owner lost the lease."""
        with self._write() as conn:
            moment = time.time()
            # Lease row, then job row: the order finish and fail take them in too (no deadlock).
            kept = conn.execute(
                update(device_leases)
                .where(device_leases.c.node == node, device_leases.c.device == device, device_leases.c.owner == owner)
                .values(expires=moment + lease_seconds)
            ).rowcount
            values: dict[str, Any] = {"heartbeat": moment}
            if started_at is not None:
                values.update(started_at=started_at.isoformat(), waiting=_wait_json(waiting))
            conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.owner == owner, jobs.c.status == "running")
                .values(**values)
            )
        return kept == 1

    def wait_state(self, job_id: str, owner: str, *, started_at: datetime, waiting: JobWait | None) -> None:
        """A claimed job of `owner` waits for its device (`waiting`), or its probe has started
        (None, at `started_at`)."""
        with self._write() as conn:
            conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.owner == owner, jobs.c.status == "running")
                .values(started_at=started_at.isoformat(), waiting=_wait_json(waiting))
            )

    def requeue(self, job: JobRecord, owner: str) -> bool:
        """A job this owner runs goes back to the queue under its id (its server is shutting down:
        the node's other workers, or its successor, run it); its device is released. Not counted as
        an interruption. False if it was not this owner's running job."""
        with self._write() as conn:
            self._release(conn, job.node, job.device, owner)
            back = conn.execute(
                update(jobs)
                .where(jobs.c.id == job.id, jobs.c.status == "running", jobs.c.owner == owner)
                .values(**_QUEUED_AGAIN)
            ).rowcount
            if back:
                conn.execute(delete(trials).where(trials.c.job_id == job.id))
        return bool(back)

    def finish(
        self, job: JobRecord, result: ProbeResult, owner: str, trials_done: list[TrialRecord] | None = None
    ) -> StoredResult:
        """Store the job's result, mark it succeeded (if it is still this owner's running job: a
        sweep may have failed it) and release its device, in one transaction."""
        stored_at = now()
        finished_at = job.finished_at or stored_at  # the probe's end, which may be long before it is recorded
        with self._write() as conn:
            self._release(conn, job.node, job.device, owner)
            self._put(conn, result, job.request_key, "probe", stored_at)
            mine = conn.execute(
                update(jobs)
                .where(jobs.c.id == job.id, jobs.c.status == "running", jobs.c.owner == owner)
                .values(
                    status="succeeded",
                    finished_at=finished_at.isoformat(),
                    fingerprint=result.fingerprint,
                    waiting=None,
                )
            ).rowcount
            if mine != 1:
                log.warning("probe job %s finished after it was failed as interrupted: result stored only", job.id)
            for seq, trial in enumerate(trials_done or [], start=1):
                self._upsert(
                    conn, trials, {"job_id": job.id, "seq": seq, "document": trial.model_dump_json()}, ["job_id", "seq"]
                )
        return StoredResult(result=result, source="probe", stored_at=stored_at)

    def fail(
        self, job: JobRecord, error: JobError, owner: str | None = None, finished_at: datetime | None = None
    ) -> None:
        """Mark the job failed (and release its device when `owner` ran it: then only if it is
        still this owner's running job)."""
        with self._write() as conn:
            where = [jobs.c.id == job.id]
            if owner is not None:
                self._release(conn, job.node, job.device, owner)
                where += [jobs.c.status == "running", jobs.c.owner == owner]
            conn.execute(
                update(jobs)
                .where(*where)
                .values(
                    status="failed",
                    finished_at=(finished_at or now()).isoformat(),
                    error_type=error.type,
                    error_message=error.message,
                    waiting=None,
                )
            )

    @staticmethod
    def _release(conn: Connection, node: str, device: str, owner: str) -> None:
        conn.execute(
            delete(device_leases).where(
                device_leases.c.node == node, device_leases.c.device == device, device_leases.c.owner == owner
            )
        )

    def sweep_stale(self, lease_seconds: float) -> list[str]:
        """Queue again (or fail, `_rerun`) running jobs on any node whose heartbeat is older than a
        lease (a whole node may be gone, and nobody else would look at its jobs); their ids."""
        moment = time.time()
        with self._write() as conn:
            rows = conn.execute(
                select(jobs.c.id, jobs.c.owner, jobs.c.heartbeat).where(
                    jobs.c.status == "running", jobs.c.heartbeat < moment - lease_seconds
                )
            ).all()
            dead = [(str(r.id), r.owner) for r in rows if worker_is_dead(r.owner, r.heartbeat, moment, lease_seconds)]
            if dead:
                again, failed = _rerun(conn, dead, "the worker running it stopped (no heartbeat for a lease period)")
                self.on_rerun(len(again), len(failed))
        return [job_id for job_id, _ in dead]

    def fail_queued_without_device(self, node: str, devices: Sequence[str]) -> list[str]:
        """Fail the queued jobs of `node` for devices it no longer has; their ids."""
        with self._write() as conn:
            gone = [
                str(i)
                for (i,) in conn.execute(
                    select(jobs.c.id).where(
                        jobs.c.node == node, jobs.c.status == "queued", jobs.c.device.not_in(list(devices))
                    )
                )
            ]
            if gone:
                _interrupt(conn, gone, f"node {node} no longer has the device it was queued for")
        return gone

    def sweep(self, node: str, lease_seconds: float) -> list[str]:
        """Queue again (or fail, `_rerun`) the running jobs of `node` whose worker is gone; their ids."""
        with self._write() as conn:
            return self._sweep(conn, node, None, lease_seconds, time.time())

    def _sweep(self, conn: Connection, node: str, device: str | None, lease_seconds: float, moment: float) -> list[str]:
        where = [jobs.c.node == node, jobs.c.status == "running"]
        if device is not None:
            where.append(jobs.c.device == device)
        rows = conn.execute(select(jobs.c.id, jobs.c.owner, jobs.c.heartbeat).where(and_(*where))).all()
        dead = [(str(r.id), r.owner) for r in rows if worker_is_dead(r.owner, r.heartbeat, moment, lease_seconds)]
        if dead:
            again, failed = _rerun(conn, dead, "the worker running it stopped")
            self.on_rerun(len(again), len(failed))
        return [job_id for job_id, _ in dead]

    def add_trial(self, job_id: str, seq: int, trial: TrialRecord) -> None:
        with self._write() as conn:
            self._upsert(
                conn, trials, {"job_id": job_id, "seq": seq, "document": trial.model_dump_json()}, ["job_id", "seq"]
            )

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._read() as conn:
            return self._job(conn, job_id)

    def job_statuses(self, job_ids: Sequence[str]) -> dict[str, str]:
        if not job_ids:
            return {}
        with self._read() as conn:
            rows = conn.execute(select(jobs.c.id, jobs.c.status).where(jobs.c.id.in_(list(job_ids))))
            return {str(i): str(s) for i, s in rows}

    def active_jobs(self, node: str) -> dict[str, int]:
        """Queued and running jobs of a node, by device."""
        with self._read() as conn:
            rows = conn.execute(
                select(jobs.c.device, func.count())
                .where(jobs.c.node == node, jobs.c.status.in_(ACTIVE))
                .group_by(jobs.c.device)
            )
            return {str(d): int(n) for d, n in rows}

    def count_jobs(self, status: JobStatus | None = None) -> int:
        with self._read() as conn:
            query = select(func.count()).select_from(jobs)
            if status is not None:
                query = query.where(jobs.c.status == status)
            return int(conn.execute(query).scalar() or 0)

    @staticmethod
    def _job(conn: Connection, job_id: str) -> JobRecord | None:
        row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        if row is None:
            return None
        documents = conn.execute(select(trials.c.document).where(trials.c.job_id == job_id).order_by(trials.c.seq))
        return JobRecord(
            id=row.id,
            request_key=row.request_key,
            workload=row.workload,
            device=row.device,
            node=row.node or "",
            request=json.loads(row.request),
            status=row.status,
            created_at=datetime.fromisoformat(row.created_at),
            started_at=datetime.fromisoformat(row.started_at) if row.started_at else None,
            finished_at=datetime.fromisoformat(row.finished_at) if row.finished_at else None,
            fingerprint=row.fingerprint,
            error=JobError(type=row.error_type, message=row.error_message or "") if row.error_type else None,
            trials=[TrialRecord.model_validate_json(d) for (d,) in documents],
            owner=row.owner,
            interruptions=int(row.interruptions or 0),
            waiting=_wait_from(row.waiting),
        )


_QUEUED_AGAIN: dict[str, Any] = {
    "status": "queued",
    "owner": None,
    "heartbeat": None,
    "started_at": None,
    "waiting": None,
}


def _rerun(conn: Connection, dead: list[tuple[str, str | None]], why: str) -> tuple[list[str], list[str]]:
    """Running jobs whose worker (the owner, as read) stopped: each is queued again under its id
    (its waiters go on waiting; the trials of the run that stopped go), or, the (MAX_RERUNS + 1)th
    time, failed as REPEATEDLY_INTERRUPTED. Only while that owner still has it: PostgreSQL checks an
    update's conditions again on the row as committed meanwhile, and another sweep may have queued
    it and a live worker claimed it since. Returns (queued again, failed)."""
    again: list[str] = []
    last: list[str] = []
    for job_id, owner in dead:
        still = [jobs.c.id == job_id, jobs.c.status == "running", jobs.c.owner == owner]
        count = conn.execute(select(jobs.c.interruptions).where(*still)).scalar()
        if count is None:
            continue  # no longer that owner's
        if int(count) < MAX_RERUNS:
            values: dict[str, Any] = {**_QUEUED_AGAIN}
        else:
            values = {
                "status": "failed",
                "finished_at": now().isoformat(),
                "error_type": REPEATEDLY_INTERRUPTED,
                "error_message": f"interrupted: {why}, each of the {MAX_RERUNS + 1} times it ran: the probe may be "
                "what stops its worker (the host's out-of-memory killer, a crash); see the server's log, then ask for "
                "it again (POST /v1/probes)",
                "waiting": None,
            }
        if conn.execute(update(jobs).where(*still).values(**values, interruptions=jobs.c.interruptions + 1)).rowcount:
            (again if values["status"] == "queued" else last).append(job_id)
    if again:
        conn.execute(delete(trials).where(trials.c.job_id.in_(again)))
        log.warning("probe job(s) %s queued again: %s", ", ".join(again), why)
    if last:
        log.warning("probe job(s) %s failed: %s, %d times", ", ".join(last), why, MAX_RERUNS + 1)
    return again, last


def _wait_json(waiting: JobWait | None) -> str | None:
    return None if waiting is None else waiting.model_dump_json()


def _wait_from(text: str | None) -> JobWait | None:
    if not text:
        return None
    try:
        return JobWait.model_validate_json(text)
    except ValidationError:
        return None


def _interrupt(conn: Connection, job_ids: list[str], why: str) -> None:
    conn.execute(
        update(jobs)
        .where(jobs.c.id.in_(job_ids), jobs.c.status.in_(ACTIVE))
        .values(
            status="failed",
            finished_at=now().isoformat(),
            error_type=INTERRUPTED,
            error_message=f"interrupted: {why}; ask for it again (POST /v1/probes) to run it",
        )
    )


class _Conflict(StoreError):
    """A write broke a uniqueness rule."""


class _LostRace(Exception):
    """Two processes inserted the same active request key; the loser looks again."""


def _by_key() -> Any:
    return select(
        result_keys.c.request_key, results.c.fingerprint, results.c.document, results.c.source, results.c.stored_at
    ).join(results, results.c.fingerprint == result_keys.c.fingerprint)


def _job_row(job: JobRecord) -> dict[str, Any]:
    return {
        "id": job.id,
        "request_key": job.request_key,
        "workload": job.workload,
        "device": job.device,
        "node": job.node,
        "request": json.dumps(job.request, sort_keys=True),
        "status": job.status,
        "created_at": job.created_at.isoformat(),
    }


def _stored(fingerprint: str, document: str, source: str, stored_at: str) -> StoredResult | None:
    try:
        result = ProbeResult.model_validate_json(document)
    except ValidationError as exc:
        # A document an older or newer autotune wrote: skip it rather than refuse to start.
        log.warning("skipping stored result %s: it no longer validates (%d errors)", fingerprint, exc.error_count())
        return None
    return StoredResult(result=result, source=source, stored_at=datetime.fromisoformat(stored_at))  # type: ignore[arg-type]
