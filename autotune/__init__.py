"""autotune: find the largest micro-batch that fits, exactly, and plan gradient accumulation.

Public API:
    Workload, Precision            define what a trial runs (autotune.workloads.workload)
    ProbeRequest, run_probe        probe in this process (autotune.engine.probe)
    probe_workload                 probe a Workload object (live objects: Workload.from_model) here
    run_isolated                   probe in a fresh child interpreter with a timeout (autotune.engine.isolation)
    plan, Plan, Policy             accumulation plans (autotune.plans.plan)
    probe_and_confirm              probe, then confirm in fresh processes (autotune.engine.confirm)
    accumulate, MicroStep, AcrossRanks  loss weights and optimizer steps in the loop (autotune.plans.accumulate)
    OOMGuard                       accumulation that survives an OOM, gradient unchanged (autotune.plans.accumulate)
    ProbeResult, TrialRecord, LoopShape  what a probe reports (autotune.results)
    load_result                    a saved probe result (`autotune probe --save`): `.plan` runs in the loop

The names that need torch (Workload, Precision, ProbeRequest, run_probe, run_isolated,
probe_and_confirm, probe_workload) are imported on first use, so `import autotune` stays light.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib
from typing import Any

from autotune.plans.accumulate import AcrossRanks, MicroStep, OOMGuard, accumulate
from autotune.plans.plan import Plan, Policy, plan
from autotune.results import LoopShape, ProbeResult, TrialRecord, load_result

_LAZY = {
    "Workload": "autotune.workloads.workload",
    "Precision": "autotune.workloads.workload",
    "ProbeRequest": "autotune.engine.probe",
    "run_probe": "autotune.engine.probe",
    "run_isolated": "autotune.engine.isolation",
    "probe_and_confirm": "autotune.engine.confirm",
    "probe_workload": "autotune.engine.probe",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AcrossRanks",
    "LoopShape",
    "MicroStep",
    "OOMGuard",
    "Plan",
    "Policy",
    "Precision",
    "ProbeRequest",
    "ProbeResult",
    "TrialRecord",
    "Workload",
    "__version__",
    "accumulate",
    "load_result",
    "plan",
    "probe_and_confirm",
    "probe_workload",
    "run_isolated",
    "run_probe",
]
