"""The service's Prometheus metrics (`GET /metrics`).

Each app has its own registry rather than prometheus-client's global one, so that two apps in one
process (tests, the benchmark) count separately and creating an app twice never fails with
"Duplicated timeseries".

Under `autotune serve --workers N` the workers are separate processes: `serve` sets
PROMETHEUS_MULTIPROC_DIR before they start, each one's counts go to files there, and whichever
worker answers /metrics sums them all, so a scrape counts the node, not one worker. The queue depth
is read from the store at each scrape (it is the node's truth, whichever process runs the jobs).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Our error classes as metric labels: a fixed set, so the label never grows with messages.
OUTCOMES: dict[str, str] = {
    "NothingFitsError": "nothing_fits",
    "NotAnOOMError": "not_an_oom",
    "ProbeTimeoutError": "timeout",
    "ProbeCrashedError": "crashed",
    "InsufficientMemoryError": "insufficient_memory",
    "ConfigError": "config",
    "WorkloadError": "config",
    "PlanError": "config",
    "DeviceError": "device",
    "StoreError": "store",
    "Interrupted": "interrupted",
    "RepeatedlyInterrupted": "interrupted",
}


def outcome_label(error_type: str | None) -> str:
    return "succeeded" if error_type is None else OUTCOMES.get(error_type, "error")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.probes = Counter(
            "autotune_probes",
            "Probe jobs finished, by outcome (succeeded, or why it failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.probes_started = Counter(
            "autotune_probes_started", "Probe jobs started, by device.", ["device"], registry=self.registry
        )
        self.probes_requeued = Counter(
            "autotune_probes_requeued",
            "Probe jobs queued again, under their id, because the worker running them stopped (killed, crashed, "
            "shut down): each runs again.",
            registry=self.registry,
        )
        self.probe_seconds = Histogram(
            "autotune_probe_seconds",
            "Wall time of a probe job, from start to result or error.",
            buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "autotune_probe_queue_depth",
            "Probe jobs queued or running, by device.",
            ["device"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.plan_requests = Counter("autotune_plan_requests", "Plan queries answered.", registry=self.registry)
        self.plan_cache_hits = Counter(
            "autotune_plan_cache_hits",
            "Plan queries answered from a stored result (no probe needed).",
            registry=self.registry,
        )
        self.results_published = Counter(
            "autotune_results_published", "Results accepted by POST /v1/results.", registry=self.registry
        )

    def render(self, depths: dict[str, int] | None = None) -> bytes:
        for device, depth in (depths or {}).items():
            self.queue_depth.labels(device).set(depth)
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared:
            combined = CollectorRegistry()
            MultiProcessCollector(combined, path=shared)
            return generate_latest(combined)
        return generate_latest(self.registry)
