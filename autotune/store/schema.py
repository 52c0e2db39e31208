"""The store's tables, one definition for SQLite and PostgreSQL (SQLAlchemy Core).

    results        fingerprint -> the ProbeResult document, as the probe reported it
    result_keys    request key -> the fingerprint that answers it (the latest stored wins)
    jobs           one row per probe job: its request, status, node, owner, heartbeat, outcome,
                   interruptions (re-runs after a worker stopped), what it waits for
    trials         the trials each job reported so far, in order (live progress, kept after a crash)
    device_leases  (node, device) -> the worker probing it now, until when: one probe per device
    nodes          node -> when a server there last wrote (readiness checks that writes succeed)

Times a person reads are ISO-8601 text (as schema 1 stored them); times compared across processes
(heartbeats, lease expiry) are epoch seconds, so the comparison is numeric on both back ends.
The migrations under `migrations/versions` create exactly these tables; a test compares the two.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text, text

metadata = MetaData()

ACTIVE_SQL = "status IN ('queued', 'running')"

results = Table(
    "results",
    metadata,
    Column("fingerprint", String(64), primary_key=True),
    Column("document", Text, nullable=False),
    Column("source", String(16), nullable=False),
    Column("stored_at", String(40), nullable=False),
)

result_keys = Table(
    "result_keys",
    metadata,
    Column("request_key", String(64), primary_key=True),
    Column("fingerprint", String(64), ForeignKey("results.fingerprint"), nullable=False),
    Column("stored_at", String(40), nullable=False),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("request_key", String(64), nullable=False),
    Column("workload", Text, nullable=False),
    Column("device", String(64), nullable=False),
    Column("request", Text, nullable=False),
    Column("status", String(16), nullable=False),
    Column("created_at", String(40), nullable=False),
    Column("started_at", String(40)),
    Column("finished_at", String(40)),
    Column("fingerprint", String(64)),
    Column("error_type", String(64)),
    Column("error_message", Text),
    # Schema 2: the node whose device runs the job, the worker running it, its last heartbeat.
    Column("node", String(253), nullable=False, server_default=""),
    Column("owner", String(300)),
    Column("heartbeat", Float),
    # Schema 3: how often a worker running it stopped (it is re-run, up to a limit), and while a
    # claimed job waits for its device's lock, who holds it and since when (JSON).
    Column("interruptions", Integer, nullable=False, server_default="0"),
    Column("waiting", Text),
    Index("jobs_by_status", "status"),
    Index("jobs_by_key", "request_key"),
    Index("jobs_by_node_device", "node", "device", "status"),
    # At most one queued or running job per request key, whichever worker or node asks: the
    # database, not a process's memory, decides which of two concurrent requests creates the job.
    Index(
        "jobs_one_active_per_key",
        "request_key",
        unique=True,
        sqlite_where=text(ACTIVE_SQL),
        postgresql_where=text(ACTIVE_SQL),
    ),
)

trials = Table(
    "trials",
    metadata,
    Column("job_id", String(32), ForeignKey("jobs.id"), primary_key=True),
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("document", Text, nullable=False),
)

device_leases = Table(
    "device_leases",
    metadata,
    Column("node", String(253), primary_key=True),
    Column("device", String(64), primary_key=True),
    Column("owner", String(300), nullable=False),
    Column("expires", Float, nullable=False),
)

nodes = Table(
    "nodes",
    metadata,
    Column("node", String(253), primary_key=True),
    Column("seen_at", Float, nullable=False),
)
