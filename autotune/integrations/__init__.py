"""autotune inside the training frameworks: each module probes a framework's own loop with the job's
objects and sets the framework's batch size and accumulation.

    autotune.integrations.transformers   tune_trainer(trainer, effective_batch)      (Hugging Face Trainer)
    autotune.integrations.lightning      AutotuneBatchSize(effective_batch) callback (PyTorch Lightning)
    autotune.integrations.accelerate     tune_accelerator(accelerator, ...)          (Accelerate)

Each module imports its framework; install the extra of the same name (`autotune[transformers]`...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.results import ProbeResult


def micro_and_accumulation(result: ProbeResult) -> tuple[int, int]:
    """What a framework runs: the plan's micro-batch and steps, or without an effective batch the
    largest micro-batch that fits one micro-step per optimizer step."""
    if result.plan is None:
        largest = result.max_micro_batch_without_accumulation or result.max_micro_batch
        assert largest is not None  # a result answers at least one loop
        return largest, 1
    return result.plan.micro_batch, result.plan.accumulation_steps
