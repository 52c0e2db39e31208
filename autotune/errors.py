"""Our exceptions: one hierarchy so callers can catch what they can act on.

    AutotuneError                  every error autotune raises on purpose
    ├── ConfigError                bad input from a user: a size, a target, a flag (CLI exit 2)
    │   ├── WorkloadError          a target that cannot be resolved or built
    │   │   ├── FlatMemoryError    its memory does not grow with the batch (make_batch ignores it)
    │   │   └── NotRepeatableError its batch's shapes change from call to call at one size
    │   └── PlanError              an effective batch / world size that no plan can satisfy
    ├── ProbeError                 a probe that ran and could not answer (CLI exit 1)
    │   ├── NothingFitsError       even batch 1 exceeds the budget
    │   ├── NotAnOOMError          a trial failed with an error that is not out-of-memory
    │   ├── LeakError              live memory grows from step to step
    │   │   └── KeptMemoryError    a trial left memory on the device for the next one
    │   ├── ProbeCrashedError      the isolated child died (signal, segfault, sticky CUDA error)
    │   ├── ProbeTimeoutError      the isolated child ran past its timeout
    │   ├── InsufficientMemoryError the device has less free memory than a probe needs to start
    │   ├── DeviceBusyError        another probe holds the device's lock (--no-wait)
    │   └── UnconfirmedError       a plan whose answer a fresh process did not confirm, used as one
    ├── DeviceError                a device that is missing or unusable (CLI exit 2: bad input here)
    ├── StoreError                 the database cannot be opened, read or written
    ├── QueueFullError             a device's probe queue is full (HTTP 429, Retry-After)
    └── ServiceError               the autotune service answered with an error (client side)
        ├── ServiceUnavailableError cannot reach the service, or it answered 5xx/503
        ├── NoSuchDeviceError      503 "no_such_device": the node lacks the device (a refusal)
        └── AuthError              401: missing or wrong token

Messages say what was wrong and how to fix it; they never carry a traceback to the user.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose.

    `traceback`: the formatted traceback of the user's code that caused it (a workload's error),
    printed by `--debug`; it crosses the isolated child's pipe (`report(exc, with_traceback=True)`)."""

    traceback: str | None = None


class ConfigError(AutotuneError):
    """Bad input: a size that does not parse, an unknown option, an impossible combination."""


class WorkloadError(ConfigError):
    """A workload target that cannot be resolved, imported or built."""


class FlatMemoryError(WorkloadError):
    """A workload whose memory does not grow with the batch size: no batch would ever run out of
    memory, so there is no largest one (usually make_batch ignores its batch_size)."""


class NotRepeatableError(WorkloadError):
    """A workload whose batch at one size is not the same from call to call (make_batch gives
    other shapes): a peak measured once holds for no size."""


class DoubleScalingError(ConfigError):
    """autotune.plans.accumulate's loss weights combined with a framework that divides the loss again."""


class PlanError(ConfigError):
    """No accumulation plan satisfies the request."""


class ProbeError(AutotuneError):
    """A probe ran but could not produce an answer."""


class NothingFitsError(ProbeError):
    """Even batch 1 does not fit within the budget."""

    def __init__(self, message: str, *, peak_bytes: int | None, limit_bytes: int) -> None:
        super().__init__(message)
        self.peak_bytes = peak_bytes
        self.limit_bytes = limit_bytes


class NotAnOOMError(ProbeError):
    """A trial failed with an error that is not an out-of-memory error."""

    def __init__(self, message: str, *, batch: int, original: str) -> None:
        super().__init__(message)
        self.batch = batch
        self.original = original


class LeakError(ProbeError):
    """The workload's live memory grows from optimizer step to optimizer step (from the start, or
    from `started_at_step` on): no micro-batch holds for a whole run."""

    bytes_per_step: int | None = None
    started_at_step: int | None = None


class KeptMemoryError(LeakError):
    """A trial left memory on the device that the next trial would start with (a cache per batch
    size, a kept output): every later answer would be low. `trial` (counted from 1) left
    `kept_bytes` at micro-batch `batch`."""

    trial: int | None = None
    batch: int | None = None
    kept_bytes: int | None = None


class ProbeCrashedError(ProbeError):
    """The isolated probe process died without reporting a result."""


class ProbeTimeoutError(ProbeError):
    """The isolated probe process ran past its timeout and was killed."""


class InsufficientMemoryError(ProbeError):
    """The device's free memory is below the minimum a probe needs to start."""


class DeviceBusyError(ProbeError):
    """Another probe on this node holds the device's lock, and this one was told not to wait."""


class UnconfirmedError(ProbeError):
    """A saved result's plan was asked for, and its answers were not confirmed in a fresh process
    (`autotune.load_result(path, allow_unconfirmed=True)` takes it anyway)."""


class RunOutOfMemoryError(AutotuneError):
    """A training run's micro-step ran out of memory even after the guard shrank it to one sample."""


class DeviceError(AutotuneError):
    """A device that does not exist or cannot be used."""


class StoreError(AutotuneError):
    """The database cannot be opened, read or written (disk full, permissions, corruption)."""


class QueueFullError(AutotuneError):
    """A device already has as many probe jobs waiting as the service accepts (AUTOTUNE_MAX_QUEUE)."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServiceError(AutotuneError):
    """The autotune service answered with an error."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ServiceUnavailableError(ServiceError):
    """The service could not be reached, or answered 5xx."""


class AuthError(ServiceError):
    """The service refused the token (HTTP 401)."""


class NoSuchDeviceError(ServiceError):
    """The service's node does not have the device asked for (HTTP 503 with code
    "no_such_device"): a refusal, not an outage. Asking again will not help, and neither would a
    local probe in its place: ask for a device the node has (`cpu` always), or another node."""


def report(exc: AutotuneError, *, with_traceback: bool = False) -> dict[str, Any]:
    """An error as plain data (its class name, message and details), to cross a pipe or HTTP;
    `with_traceback` adds the user code's traceback (for our own pipes, not for HTTP or --json)."""
    data: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if with_traceback and exc.traceback:
        data["traceback"] = exc.traceback
    if isinstance(exc, NothingFitsError):
        data.update(peak_bytes=exc.peak_bytes, limit_bytes=exc.limit_bytes)
    elif isinstance(exc, NotAnOOMError):
        data.update(batch=exc.batch, original=exc.original)
    return data


def _probe_side() -> dict[str, type[AutotuneError]]:
    # What a probe can raise: bad input, a probe that could not answer, a missing device.
    found: dict[str, type[AutotuneError]] = {}
    pending: list[type[AutotuneError]] = [ConfigError, ProbeError, DeviceError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def from_report(data: Mapping[str, Any], message: str | None = None) -> AutotuneError:
    """Rebuild an error from `report`'s data; an unknown type becomes a ProbeError.

    `message` replaces the reported one (to say where the error came from)."""
    cls = _probe_side().get(str(data.get("type", "")), ProbeError)
    text = message if message is not None else str(data.get("message", "the probe failed"))
    error: AutotuneError
    if cls is NothingFitsError:
        error = NothingFitsError(text, peak_bytes=data.get("peak_bytes"), limit_bytes=data.get("limit_bytes") or 0)
    elif cls is NotAnOOMError:
        error = NotAnOOMError(
            text, batch=data.get("batch") or 0, original=str(data.get("original", data.get("message", "")))
        )
    else:
        error = cls(text)
    if isinstance(data.get("traceback"), str):
        error.traceback = data["traceback"]
    return error
