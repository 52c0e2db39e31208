"""The one settings object, read from `AUTOTUNE_*` environment variables.

| variable                     | default          | meaning                                              |
|------------------------------|------------------|------------------------------------------------------|
| AUTOTUNE_DB                  | autotune.db      | SQLite file of the service's stored results          |
| AUTOTUNE_TOKEN               | (none)           | bearer token required by the service's /v1 endpoints |
| AUTOTUNE_WORKLOADS           | (none)           | TOML file of workloads the service may probe         |
| AUTOTUNE_CPU_MEMORY          | 256MiB           | simulated memory of the CPU budget device            |
| AUTOTUNE_BUDGET              | total            | CUDA budget policy: total or free                    |
| AUTOTUNE_HEADROOM            | 0.05             | fraction of the budget (or a size) kept free         |
| AUTOTUNE_PROBE_TIMEOUT       | 900              | seconds before an isolated probe is killed           |
| AUTOTUNE_MIN_FREE_MEMORY     | 1GiB             | a CUDA probe refuses to start with less free memory  |
| AUTOTUNE_MAX_BODY            | 1MiB             | the service refuses request bodies larger than this  |
| AUTOTUNE_MAX_CPU_MEMORY      | 8GiB             | the largest budget device a service request may ask  |
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from autotune.errors import ConfigError
from autotune.units import parse_headroom, parse_size


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore")

    db: Path = Path("autotune.db")
    token: str | None = None
    workloads: Path | None = None
    cpu_memory: int = Field(default=256 * 2**20, description="bytes")
    budget: Literal["total", "free"] = "total"
    headroom: float | int = 0.05
    probe_timeout: float = Field(default=900.0, gt=0)
    min_free_memory: int = Field(default=2**30, ge=0)
    # The service's bounds. The budget device really allocates what it simulates, so a request
    # for a huge one would exhaust the server's RAM: the service caps it.
    max_body: int = Field(default=2**20, ge=1024, description="bytes")
    max_cpu_memory: int = Field(default=8 * 2**30, ge=2**20, description="bytes")

    @field_validator("cpu_memory", "min_free_memory", "max_body", "max_cpu_memory", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        return parse_size(value if isinstance(value, int) else str(value))

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
