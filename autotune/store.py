"""The service's persistent state: one SQLite file (WAL) of probe results and probe jobs.

    results      fingerprint -> the ProbeResult document, as the probe reported it
    result_keys  request key -> the fingerprint that answers it (the latest stored wins)
    jobs         one row per probe job: its request, status, timings, outcome
    trials       the trials each job reported so far, in order (live progress, kept after a crash)

Results are never deleted by the service; a restart keeps every one. Jobs that were queued or
running when the previous server died are marked failed ("interrupted") when the store opens,
and the same request can then be asked for again.

One `Store` holds one connection, shared by the event loop and the probe workers behind a lock:
every operation is a few rows, so the lock is held for well under a millisecond, and plan queries
do not come here at all (the service keeps stored results in memory). One server per file: a
second server on the same file would mark the first one's running jobs interrupted.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from autotune.errors import AutotuneError
from autotune.results import ProbeResult, TrialRecord

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
JobStatus = Literal["queued", "running", "succeeded", "failed"]
ACTIVE: tuple[JobStatus, ...] = ("queued", "running")
INTERRUPTED = "Interrupted"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    fingerprint TEXT PRIMARY KEY,
    document    TEXT NOT NULL,
    source      TEXT NOT NULL,
    stored_at   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS result_keys (
    request_key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL REFERENCES results(fingerprint),
    stored_at   TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id            TEXT PRIMARY KEY,
    request_key   TEXT NOT NULL,
    workload      TEXT NOT NULL,
    device        TEXT NOT NULL,
    request       TEXT NOT NULL,
    status        TEXT NOT NULL,
    created_at    TEXT NOT NULL,
    started_at    TEXT,
    finished_at   TEXT,
    fingerprint   TEXT,
    error_type    TEXT,
    error_message TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs(status);
CREATE TABLE IF NOT EXISTS trials (
    job_id   TEXT NOT NULL REFERENCES jobs(id),
    seq      INTEGER NOT NULL,
    document TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""


class StoreError(AutotuneError):
    """The database cannot be opened, read or written (disk full, permissions, corruption)."""


class JobError(BaseModel):
    """Why a job failed: our exception's class name and its message."""

    type: str
    message: str


class JobRecord(BaseModel):
    """A probe job as stored."""

    id: str
    request_key: str
    workload: str = Field(description="The registered workload's name.")
    device: str = Field(description="cpu or cuda:N, as the request resolved it.")
    request: dict[str, Any] = Field(description="The ProbeRequest the job runs.")
    status: JobStatus
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    fingerprint: str | None = None
    error: JobError | None = None
    trials: list[TrialRecord] = Field(default_factory=list)


class StoredResult(BaseModel):
    """A result with where it came from: a job of this service or a POST from elsewhere."""

    result: ProbeResult
    source: Literal["probe", "published"]
    stored_at: datetime


def now() -> datetime:
    return datetime.now(UTC)


class Store:
    """The SQLite store. Opening it creates the schema and, with `recover` (what a starting
    server does), marks the jobs a previous server left queued or running failed (interrupted)."""

    def __init__(self, path: Path, *, recover: bool = True) -> None:
        self.path = path
        try:
            if path.parent and not path.parent.exists():
                raise StoreError(f"cannot open the database {path}: directory {path.parent} does not exist")
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the database {path}: {exc} (AUTOTUNE_DB)") from None
        self._lock = threading.Lock()
        try:
            self._prepare()
        except sqlite3.Error as exc:
            self._db.close()
            raise StoreError(f"cannot use the database {path}: {exc} (is it an autotune database?)") from None
        except StoreError:
            self._db.close()
            raise
        self.interrupted: list[str] = self._mark_interrupted() if recover else []

    def _prepare(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the database {self.path} has schema version {version}, newer than this autotune's "
                f"{SCHEMA_VERSION}: upgrade autotune or point AUTOTUNE_DB elsewhere"
            )
        # WAL: readers never block the writer, and a kill -9 loses at most the transaction in flight.
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"the database {self.path} cannot use WAL journaling (got {mode!r})")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                try:
                    self._db.execute("COMMIT")
                except sqlite3.Error:
                    # A failed COMMIT (disk full, I/O error) leaves the transaction open: end it,
                    # or every later BEGIN fails with "cannot start a transaction within a transaction".
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StoreError(f"database {self.path}: {exc}") from None

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise StoreError(f"database {self.path}: {exc}") from None

    def _mark_interrupted(self) -> list[str]:
        message = (
            "interrupted: the server stopped while this probe was queued or running; "
            "ask for it again (POST /v1/probes) to run it"
        )
        with self._transaction() as db:
            rows = db.execute("SELECT id FROM jobs WHERE status IN ('queued', 'running')").fetchall()
            db.execute(
                "UPDATE jobs SET status='failed', finished_at=?, error_type=?, error_message=? "
                "WHERE status IN ('queued', 'running')",
                (now().isoformat(), INTERRUPTED, message),
            )
        if rows:
            log.warning("marked %d interrupted probe job(s) failed", len(rows))
        return [row[0] for row in rows]

    def ping(self) -> bool:
        """Whether the database answers a trivial query."""
        try:
            with self._reading() as db:
                db.execute("SELECT 1").fetchone()
        except StoreError:
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
        with self._transaction() as db:
            db.execute(
                "INSERT INTO results(fingerprint, document, source, stored_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(fingerprint) DO UPDATE SET document=excluded.document, "
                "source=excluded.source, stored_at=excluded.stored_at",
                (result.fingerprint, result.model_dump_json(), source, stored_at.isoformat()),
            )
            if request_key is not None:
                db.execute(
                    "INSERT INTO result_keys(request_key, fingerprint, stored_at) VALUES (?, ?, ?) "
                    "ON CONFLICT(request_key) DO UPDATE SET fingerprint=excluded.fingerprint, "
                    "stored_at=excluded.stored_at",
                    (request_key, result.fingerprint, stored_at.isoformat()),
                )
            if job_id is not None:
                db.execute(
                    "UPDATE jobs SET status='succeeded', finished_at=?, fingerprint=? WHERE id=?",
                    (stored_at.isoformat(), result.fingerprint, job_id),
                )
        return StoredResult(result=result, source=source, stored_at=stored_at)

    def get_result(self, fingerprint: str) -> StoredResult | None:
        with self._reading() as db:
            row = db.execute(
                "SELECT document, source, stored_at FROM results WHERE fingerprint=?", (fingerprint,)
            ).fetchone()
        return None if row is None else self._stored(fingerprint, *row)

    def results_by_key(self) -> dict[str, StoredResult]:
        """Every request key with the result that answers it: what the service loads at start-up."""
        with self._reading() as db:
            rows = db.execute(
                "SELECT k.request_key, r.fingerprint, r.document, r.source, r.stored_at "
                "FROM result_keys k JOIN results r ON r.fingerprint = k.fingerprint"
            ).fetchall()
        found: dict[str, StoredResult] = {}
        for key, fingerprint, document, source, stored_at in rows:
            stored = self._stored(fingerprint, document, source, stored_at)
            if stored is not None:
                found[key] = stored
        return found

    def count_results(self) -> int:
        with self._reading() as db:
            return int(db.execute("SELECT COUNT(*) FROM results").fetchone()[0])

    @staticmethod
    def _stored(fingerprint: str, document: str, source: str, stored_at: str) -> StoredResult | None:
        try:
            result = ProbeResult.model_validate_json(document)
        except ValidationError as exc:
            # A document an older or newer autotune wrote: skip it rather than refuse to start.
            log.warning("skipping stored result %s: it no longer validates (%d errors)", fingerprint, exc.error_count())
            return None
        return StoredResult(result=result, source=source, stored_at=datetime.fromisoformat(stored_at))  # type: ignore[arg-type]

    # Jobs ------------------------------------------------------------------------------------
    def create_job(self, job: JobRecord) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO jobs(id, request_key, workload, device, request, status, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    job.id,
                    job.request_key,
                    job.workload,
                    job.device,
                    json.dumps(job.request, sort_keys=True),
                    job.status,
                    job.created_at.isoformat(),
                ),
            )

    def mark_running(self, job_id: str, started_at: datetime) -> None:
        with self._transaction() as db:
            db.execute("UPDATE jobs SET status='running', started_at=? WHERE id=?", (started_at.isoformat(), job_id))

    def add_trial(self, job_id: str, seq: int, trial: TrialRecord) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO trials(job_id, seq, document) VALUES (?, ?, ?)",
                (job_id, seq, trial.model_dump_json()),
            )

    def fail_job(self, job_id: str, error: JobError, finished_at: datetime | None = None) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET status='failed', finished_at=?, error_type=?, error_message=? WHERE id=?",
                ((finished_at or now()).isoformat(), error.type, error.message, job_id),
            )

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._reading() as db:
            row = db.execute(
                "SELECT id, request_key, workload, device, request, status, created_at, started_at, "
                "finished_at, fingerprint, error_type, error_message FROM jobs WHERE id=?",
                (job_id,),
            ).fetchone()
            if row is None:
                return None
            trials = db.execute("SELECT document FROM trials WHERE job_id=? ORDER BY seq", (job_id,)).fetchall()
        (id_, key, workload, device, request, status, created, started, finished, fp, etype, emessage) = row
        return JobRecord(
            id=id_,
            request_key=key,
            workload=workload,
            device=device,
            request=json.loads(request),
            status=status,
            created_at=datetime.fromisoformat(created),
            started_at=datetime.fromisoformat(started) if started else None,
            finished_at=datetime.fromisoformat(finished) if finished else None,
            fingerprint=fp,
            error=JobError(type=etype, message=emessage) if etype else None,
            trials=[TrialRecord.model_validate_json(t[0]) for t in trials],
        )

    def count_jobs(self, status: JobStatus | None = None) -> int:
        with self._reading() as db:
            if status is None:
                return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
            return int(db.execute("SELECT COUNT(*) FROM jobs WHERE status=?", (status,)).fetchone()[0])
