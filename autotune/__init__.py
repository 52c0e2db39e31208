"""autotune: find the largest micro-batch that fits, exactly, and plan gradient accumulation.

Public API:
    Workload, Precision            define what a trial runs (autotune.workload)
    ProbeRequest, run_probe        probe in this process (autotune.probe)
    run_isolated                   probe in a spawned child with a timeout (autotune.isolation)
    plan, Plan, Policy             accumulation plans (autotune.plan)
    accumulate, MicroStep, AcrossRanks  loss weights and optimizer steps in the loop (autotune.accumulate)
    ProbeResult, TrialRecord       what a probe reports (autotune.results)
"""

from __future__ import annotations

__version__ = "0.1.0"

from autotune.accumulate import AcrossRanks, MicroStep, accumulate
from autotune.plan import Plan, Policy, plan
from autotune.results import ProbeResult, TrialRecord

__all__ = [
    "AcrossRanks",
    "MicroStep",
    "Plan",
    "Policy",
    "ProbeResult",
    "TrialRecord",
    "__version__",
    "accumulate",
    "plan",
]
