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

Every name is imported on first use, so `import autotune` imports nothing but this module: the
`autotune` command starts with its signal handling in place before anything else loads (a Ctrl-C
in the first moments is one line, not a traceback), and the names that need torch (Workload,
Precision, ProbeRequest, run_probe, run_isolated, probe_and_confirm, probe_workload) cost nothing
until used.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.engine.confirm import probe_and_confirm
    from autotune.engine.isolation import run_isolated
    from autotune.engine.probe import ProbeRequest, probe_workload, run_probe
    from autotune.plans.accumulate import AcrossRanks, MicroStep, OOMGuard, accumulate
    from autotune.plans.plan import Plan, Policy, plan
    from autotune.results import LoopShape, ProbeResult, TrialRecord, load_result
    from autotune.workloads.workload import Precision, Workload

_LAZY = {
    "AcrossRanks": "autotune.plans.accumulate",
    "MicroStep": "autotune.plans.accumulate",
    "OOMGuard": "autotune.plans.accumulate",
    "accumulate": "autotune.plans.accumulate",
    "Plan": "autotune.plans.plan",
    "Policy": "autotune.plans.plan",
    "plan": "autotune.plans.plan",
    "LoopShape": "autotune.results",
    "ProbeResult": "autotune.results",
    "TrialRecord": "autotune.results",
    "load_result": "autotune.results",
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
