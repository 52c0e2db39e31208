"""autotune inside the training frameworks: each module probes a framework's own loop with the job's
objects and sets the framework's batch size and accumulation.

    autotune.integrations.transformers   tune_trainer(trainer)                   (Hugging Face Trainer)
    autotune.integrations.lightning      AutotuneBatchSize() callback            (PyTorch Lightning)
    autotune.integrations.accelerate     tune_accelerator(accelerator, ...)      (Accelerate)

Each keeps the job's effective batch unless asked for another (`effective_batch=N`, or "max" for
the largest micro-batch without accumulation), refuses what its framework would not run as planned,
checks that a window of accumulation trains like the effective batch, reports its trials as the
command line does, and leaves the process as it found it: `autotune.integrations.job` and
`autotune.integrations.gradients`, which they share. Each module imports its framework; install the
extra of the same name (`autotune[transformers]`...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.results import ProbeResult


def micro_and_accumulation(result: ProbeResult) -> tuple[int, int]:
    """What a framework runs: the plan's micro-batch and steps, or with effective_batch='max' (no
    plan) the largest micro-batch that fits one micro-step per optimizer step."""
    if result.plan is None:
        largest = result.max_micro_batch_without_accumulation or result.max_micro_batch
        assert largest is not None  # a result answers at least one loop
        return largest, 1
    return result.plan.micro_batch, result.plan.accumulation_steps
