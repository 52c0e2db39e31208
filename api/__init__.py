"""The autotune service: a FastAPI app that training jobs ask for accumulation plans.

    app.py        create_app(): settings, lifespan, routes, error handlers
    service.py    the state the endpoints share and how a request becomes a probe and a key
    v1.py         the /v1 endpoints (devices, workloads, probes, plan, results)
    ops.py        /healthz, /readyz, /metrics
    jobs.py       probe jobs: a queue and a worker per device, isolated children
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

from api.app import create_app

__all__ = ["create_app"]
