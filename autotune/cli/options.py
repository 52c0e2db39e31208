"""The commands' flags, declared once each: type, metavar, help and the default's note.

A command's signature names these aliases (`device: DeviceOption = None`), so the help text of a
flag several commands take is written once, and a command function stays short enough to read.
"""

from __future__ import annotations

from typing import Annotated

import typer

from autotune.plans.plan import Policy


def default_note(value: str) -> str:
    return f"[default: {value}]"


# Several commands.
TargetArgument = Annotated[
    str, typer.Argument(metavar="TARGET", help="Built-in example (mlp, cnn, gpt) or module:attribute.")
]
PrecisionOption = Annotated[
    str | None,
    typer.Option(
        metavar="fp32|bf16|fp16",
        help="fp32, bf16 (autocast) or fp16 (autocast + GradScaler).  " + default_note("the workload's"),
    ),
]
OptimizerOption = Annotated[
    str | None,
    typer.Option(
        metavar="sgd|adam|adamw", help="Override the workload's optimizer.  " + default_note("the workload's")
    ),
]
HeadroomOption = Annotated[
    str | None,
    typer.Option(
        metavar="F|SIZE",
        help="Kept free: a fraction (0.05, 5%) or a size (2GiB).  " + default_note("AUTOTUNE_HEADROOM, 5%"),
    ),
]
OptionsOption = Annotated[
    list[str] | None,
    typer.Option("--option", "-o", metavar="KEY=VALUE", help="Workload option (repeatable)."),
]
WorldSizeOption = Annotated[int, typer.Option(metavar="W", min=1, help="Data-parallel ranks.")]
PolicyOption = Annotated[
    str, typer.Option(metavar="fewest-steps|exact", help="How the plan splits the effective batch.")
]
DEFAULT_POLICY = Policy.FEWEST_STEPS.value
GranularityOption = Annotated[int, typer.Option(metavar="G", min=1, help="Only try multiples of this (e.g. 8).")]

# probe
# A flag whose metavar is its name in capitals names itself: typer 0.27 (the GPU image's) took such
# a metavar for the flag's name, so that `--device` became `--DEVICE`.
DeviceOption = Annotated[
    str | None,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help="cuda, cuda:N or cpu (the budget device).  " + default_note("cuda:0 when CUDA is present, else cpu"),
    ),
]
MemoryOption = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE",
        help="Probe as if the device had this much memory, e.g. 24GiB.  "
        + default_note("the card's; on cpu AUTOTUNE_CPU_MEMORY, 256MiB"),
    ),
]
BudgetOption = Annotated[
    str | None,
    typer.Option(
        metavar="total|free",
        help="CUDA budget: total (the card) or free (what other processes leave).  "
        + default_note("AUTOTUNE_BUDGET, total"),
    ),
]
StepsOption = Annotated[
    int,
    typer.Option(metavar="N", min=1, max=100, help="Training steps per trial (2: the second is the steady state)."),
]
MaxBatchOption = Annotated[
    int | None, typer.Option(metavar="N", min=1, help="Never try more than this.  " + default_note("no cap"))
]
StartBatchOption = Annotated[
    int, typer.Option(metavar="N", min=1, help="First size to try (--search plain only: predict refuses it).")
]
EffectiveBatchOption = Annotated[
    int | None,
    typer.Option(metavar="E", min=1, help="Plan accumulation for this effective batch.  " + default_note("no plan")),
]
InProcessOption = Annotated[
    bool, typer.Option("--in-process", help="Run in this process (debugging); default is an isolated child.")
]
TimeoutOption = Annotated[
    float | None,
    typer.Option(
        metavar="SECONDS",
        help="Seconds before the isolated probe (and each confirmation run) is killed.  "
        + default_note("AUTOTUNE_PROBE_TIMEOUT, 900"),
    ),
]
MinFreeMemoryOption = Annotated[
    str | None,
    typer.Option(
        metavar="SIZE",
        help="Refuse to probe a GPU with less free memory than this (0: never refuse).  "
        + default_note("AUTOTUNE_MIN_FREE_MEMORY, 1GiB"),
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the result (or the error) as one JSON document on stdout.")
]
PublishOption = Annotated[
    str | None,
    typer.Option(metavar="URL", help="Post the result to the autotune service at this URL (token: AUTOTUNE_TOKEN)."),
]
SearchOption = Annotated[
    str,
    typer.Option(
        metavar="predict|plain", help="predict (two timeline trials predict, two verify) or plain (double, bisect)."
    ),
]
ObjectiveOption = Annotated[
    str,
    typer.Option(
        metavar="memory|throughput",
        help="memory (the largest that fits) or throughput (the fastest fitting one for the plan).",
    ),
]
PlotOption = Annotated[
    str | None,
    typer.Option(
        metavar="FILE.png",
        help="Draw memory against batch size and what fills it at the answer (needs the plot extra); "
        ".png, .jpg, .svg or .pdf, as the extension says; written as --save writes its file.",
    ),
]
SaveOption = Annotated[
    str | None,
    typer.Option(
        metavar="FILE.json",
        help="Write the result to FILE.json, for a job's script: autotune.load_result(FILE.json).plan. Whole or "
        "not at all (a file beside it, renamed over it), through a symlink to its target, with an existing file's "
        "permissions or the umask's (0644); a directory, FIFO or device is refused.",
    ),
]
PrefetchOption = Annotated[
    int,
    typer.Option(
        metavar="N",
        min=0,
        max=16,
        help="Further batches your loader holds on the device during a step (e.g. 1 for Accelerate).",
    ),
]
ConfirmOption = Annotated[
    bool, typer.Option("--confirm/--no-confirm", help="Run the answer again in a fresh process after the search.")
]
WaitOption = Annotated[
    bool,
    typer.Option(
        "--wait/--no-wait",
        help="While another probe on this node holds the device: wait for it, saying who holds it (default), or "
        "fail at once naming it (exit 1). Lock files: AUTOTUNE_LOCK_DIR.",
    ),
]
ConfirmStepsOption = Annotated[
    int | None,
    typer.Option(
        metavar="N",
        min=1,
        max=100,
        help="Optimizer steps of each fresh-process confirmation run, at least.  "
        + default_note("20 on CUDA, --steps on the budget device"),
    ),
]
MaxStepsOption = Annotated[
    int,
    typer.Option(
        metavar="N",
        min=1,
        max=100,
        help="With a caching allocator (CUDA, or --allocator cuda), a trial runs at least 3 optimizer steps and "
        "until two in a row changed none of its counters, up to N; one still changing (or retrying "
        "allocations) does not fit.",
    ),
]
AllocatorOption = Annotated[
    str | None,
    typer.Option(
        metavar="exact|cuda",
        help="The budget device's memory: exact (live bytes) or cuda (through a model of CUDA's caching "
        "allocator: reserved memory, fragmentation, retries).  " + default_note("AUTOTUNE_ALLOCATOR, exact"),
    ),
]
CardOption = Annotated[
    str | None,
    typer.Option(
        metavar="h100",
        help="The GPU the budget device stands for: the allocator model with the card's fraction cap, the memory "
        "outside PyTorch and cuBLAS's workspaces (implies --allocator cuda). Budget device only.",
    ),
]
CompareAllocatorOption = Annotated[
    str | None,
    typer.Option(
        metavar="CONF",
        help="Probe again with these caching-allocator settings (e.g. expandable_segments:True), unconfirmed, and "
        "say by how much the answers differ (on CUDA, or the budget device with --allocator cuda).",
    ),
]
AllocatorConfigOption = Annotated[
    str | None,
    typer.Option(
        metavar="CONF",
        help="The caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True): "
        "on CUDA the probe's processes run with them; --allocator cuda models them.  "
        + default_note("PYTORCH_CUDA_ALLOC_CONF"),
    ),
]
ParallelOption = Annotated[
    str,
    typer.Option(
        metavar="none|ddp|fsdp",
        help="How the job runs the model across ranks: ddp (DistributedDataParallel: its gradient buckets are "
        "measured) or fsdp (FSDP2 over --world-size ranks: rank 0 simulated on this one device).",
    ),
]
CheckpointingOption = Annotated[
    str | None,
    typer.Option(
        metavar="none|full|every=K|auto",
        help="Activation checkpointing of the model's repeated blocks: none, full or every=K (every K-th block) "
        "probes that setting; auto probes none and full and plans with the fastest measured one that fits (a "
        "list, none,every=2,full, chooses among those).  " + default_note("the workload as configured"),
    ),
]
ReshardOption = Annotated[
    bool,
    typer.Option(
        "--reshard-after-forward/--no-reshard-after-forward",
        help="--parallel fsdp: free each block's gathered parameters after forward (ZeRO-3), or keep them "
        "for backward (ZeRO-2: more memory, fewer all-gathers), as the job's fully_shard does.",
    ),
]
