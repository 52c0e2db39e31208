"""The autotune service: a FastAPI app that training jobs ask for accumulation plans.

    app.py        create_app(): settings, lifespan, routes, error handlers
    service.py    the state the endpoints share and how a request becomes a probe and a key
    v1.py         the /v1 endpoints (devices, workloads, probes, plan, results)
    ops.py        /healthz, /readyz, /metrics
    jobs.py       probe jobs: a queue and a worker per device, isolated children
    spool.py      a finished job's outcome for the node's other workers, before the store has it
    cache.py      stored results and plans in memory
    devices.py    NVML inventory numbered as CUDA will number it
    schemas.py    the wire format
    security.py   the bearer token
    errors.py     exceptions to status codes
    metrics.py    Prometheus metrics
    server.py     `autotune serve`

Storage is `autotune.store`, request keys `autotune.workloads.probekey`, the workload registry
`autotune.workloads.registry`: none of them imports a web framework, so the client side can use them.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Imported when asked for: `autotune serve` imports api.server and listens on its port before
    # the app's imports (torch among them, seconds) run.
    if name == "create_app":
        from api.app import create_app

        return create_app
    raise AttributeError(f"module 'api' has no attribute {name!r}")
