"""The one settings object, read from `AUTOTUNE_*` environment variables.

| variable                     | default          | meaning                                              |
|------------------------------|------------------|------------------------------------------------------|
| AUTOTUNE_DB                  | autotune.db      | the store: a SQLite file, or a postgresql:// URL     |
| AUTOTUNE_NODE                | the host name    | this node's name: jobs run on the node that made them|
| AUTOTUNE_LEASE_SECONDS       | 30               | a running job whose worker is silent this long fails |
| AUTOTUNE_MAX_QUEUE           | 16               | probe jobs waiting per device before 429             |
| AUTOTUNE_CACHE_TTL           | 2                | seconds before a result stored elsewhere is seen     |
| AUTOTUNE_TOKEN               | (none)           | bearer token required by the service's /v1 endpoints |
| AUTOTUNE_WORKLOADS           | (none)           | TOML file of workloads the service may probe         |
| AUTOTUNE_CPU_MEMORY          | 256MiB           | simulated memory of the CPU budget device            |
| AUTOTUNE_BUDGET              | total            | CUDA budget policy: total or free                    |
| AUTOTUNE_HEADROOM            | 0.05             | fraction of the budget (or a size) kept free         |
| AUTOTUNE_PROBE_TIMEOUT       | 900              | seconds before an isolated probe is killed           |
| AUTOTUNE_MIN_FREE_MEMORY     | 1GiB             | a CUDA probe refuses to start with less free memory  |
| AUTOTUNE_MAX_BODY            | 1MiB             | the service refuses request bodies larger than this  |
| AUTOTUNE_MAX_CPU_MEMORY      | 8GiB             | the largest budget device a service request may ask  |
| AUTOTUNE_DEBUG               | false            | the CLI prints a failure's full traceback (--debug)  |
| AUTOTUNE_ALLOCATOR           | exact            | the budget device's memory: exact, or cuda (a model  |
|                              |                  | of CUDA's caching allocator); read per device        |
| AUTOTUNE_ALLOCATOR_STREAMS   | model            | the model's streams: model (a pool per stream, as    |
|                              |                  | CUDA's), or one (every allocation on one stream: the |
|                              |                  | model before streams, for comparison); per device    |
| AUTOTUNE_LOCK_DIR            | /tmp/autotune-UID| where each device's lock file lives: every probe on  |
|                              |                  | this node holds its device's (one probe per device)  |
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from autotune.errors import ConfigError
from autotune.units import parse_headroom, parse_size


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore")

    db: str = Field(default="autotune.db", min_length=1, description="a SQLite path or a database URL")
    node: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    lease_seconds: float = Field(default=30.0, ge=1.0, le=3600.0)
    max_queue: int = Field(default=16, ge=1, le=10_000)
    cache_ttl: float = Field(default=2.0, gt=0, le=3600.0)
    token: str | None = None
    workloads: Path | None = None
    cpu_memory: int = Field(default=256 * 2**20, description="bytes")
    budget: Literal["total", "free"] = "total"
    headroom: float | int = 0.05
    probe_timeout: float = Field(default=900.0, gt=0, allow_inf_nan=False)
    min_free_memory: int = Field(default=2**30, ge=0)
    # The service's bounds. The budget device really allocates what it simulates, so a request
    # for a huge one would exhaust the server's RAM: the service caps it.
    max_body: int = Field(default=2**20, ge=1024, description="bytes")
    max_cpu_memory: int = Field(default=8 * 2**30, ge=2**20, description="bytes")
    # The command line prints the full traceback of a failure (a workload's own, from the probe's
    # process too) before its one-line message, as --debug does.
    debug: bool = False
    # How the budget device counts: exact live bytes, or every allocation through the model of
    # CUDA's caching allocator (reserved memory, fragmentation, retries). Read when a BudgetDevice
    # is created (`allocator_mode`), so a test or a job can switch it without a new process.
    allocator: Literal["exact", "cuda"] = "exact"
    # The model's streams: a pool per stream and record_stream's waits (CUDA's rules), or everything
    # on one stream, to measure what the streams change (bench/streams.py). Read per device too.
    allocator_streams: Literal["model", "one"] = "model"
    # The directory of the device locks (autotune.engine.lock). Processes share a device's lock only
    # when they share this directory: the default is per user, so a service and people's probes
    # running as other users set it to one directory they can all write.
    lock_dir: Path | None = None

    @field_validator("cpu_memory", "max_body", "max_cpu_memory", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        return parse_size(value if isinstance(value, int) else str(value))

    @field_validator("min_free_memory", mode="before")
    @classmethod
    def _size_or_zero(cls, value: object) -> int:
        # 0 is meaningful here: never refuse to start a probe for lack of free memory.
        return parse_size(value if isinstance(value, int) else str(value), allow_zero=True)

    @field_validator("lock_dir", mode="before")
    @classmethod
    def _lock_dir(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value  # set but empty: the default

    @field_validator("db", mode="before")
    @classmethod
    def _db(cls, value: object) -> str:
        return str(value)  # a Path from code, a string from the environment

    @field_validator("headroom", mode="before")
    @classmethod
    def _headroom(cls, value: object) -> float | int:
        return parse_headroom(value if isinstance(value, float | int) else str(value))


@lru_cache
def get_settings() -> Settings:
    try:
        return Settings()
    except ValueError as exc:
        raise ConfigError(f"bad AUTOTUNE_* environment variable: {exc}") from None


def allocator_streams() -> Literal["model", "one"]:
    """AUTOTUNE_ALLOCATOR_STREAMS as it is now (read when a BudgetDevice is created, as AUTOTUNE_ALLOCATOR)."""
    value = os.environ.get("AUTOTUNE_ALLOCATOR_STREAMS", "model").strip().lower() or "model"
    if value not in ("model", "one"):
        raise ConfigError(
            f"environment variable AUTOTUNE_ALLOCATOR_STREAMS={value!r} is not model or one: fix it or unset it"
        )
    return "one" if value == "one" else "model"


def allocator_mode() -> Literal["exact", "cuda"]:
    """AUTOTUNE_ALLOCATOR as it is now (not cached: a BudgetDevice reads it when it is created)."""
    value = os.environ.get("AUTOTUNE_ALLOCATOR", "exact").strip().lower() or "exact"
    if value not in ("exact", "cuda"):
        raise ConfigError(f"environment variable AUTOTUNE_ALLOCATOR={value!r} is not exact or cuda: fix it or unset it")
    return "cuda" if value == "cuda" else "exact"
