"""The service's store: probe results and probe jobs in SQLite (the default) or PostgreSQL.

engine      what AUTOTUNE_DB names, the checks before trusting a file, migrations
schema      the tables (SQLAlchemy Core), one definition for both back ends
store       `Store`: results, jobs, device leases; what decides what runs
migrations  Alembic revisions, applied at start-up under a lock
"""

from autotune.errors import StoreError
from autotune.store.store import (
    ACTIVE,
    INTERRUPTED,
    MAX_RERUNS,
    REPEATEDLY_INTERRUPTED,
    DeviceHolder,
    JobError,
    JobRecord,
    JobStatus,
    JobWait,
    Store,
    StoredResult,
    Submitted,
    now,
    owner_is_gone,
    worker_id,
)

__all__ = [
    "ACTIVE",
    "INTERRUPTED",
    "MAX_RERUNS",
    "REPEATEDLY_INTERRUPTED",
    "DeviceHolder",
    "JobError",
    "JobRecord",
    "JobStatus",
    "JobWait",
    "Store",
    "StoreError",
    "StoredResult",
    "Submitted",
    "now",
    "owner_is_gone",
    "worker_id",
]
