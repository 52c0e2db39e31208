"""Plans: from the largest micro-batch that fits to the job's micro-batches and accumulation, and
the helpers that run a plan in a training loop.

    plan        `plan()`, `Plan`, `Policy`: pure arithmetic, no torch, no I/O
    mixed       one plan for a data-parallel job across GPU models (pure arithmetic)
    accumulate  the loop helper (loss weights, optimizer steps, DDP's no_sync) and `OOMGuard`
    sampler     `PlanBatchSampler`: a DataLoader that yields the plan's micro-batches
    batches     cutting and joining batches along dim 0; any loader's batches as a plan's windows

May import: errors (plan, mixed); accumulate and sampler import torch lazily and `engine.oom` for
the guard's OOM rules. Never `engine`'s probe, `workloads`, `cli` or `api`.
"""
