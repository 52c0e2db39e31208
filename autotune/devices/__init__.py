"""The devices a probe runs on, behind one seam (`ProbeDevice` in `device`): what a trial asks of a
device is its limit, its counters and a reset, whatever the device is.

    device     `ProbeDevice`, the protocol every device implements
    budget     the CPU budget device: a simulated accelerator memory that raises a real OOM
    cuda       a CUDA GPU as a probing device: the headroom cap and the caching allocator's counters
    nvml       the GPU inventory as NVML reports it (never initialises CUDA)
    allocator  a pure-Python model of CUDA's caching allocator (the budget device's AUTOTUNE_ALLOCATOR=cuda)
    host       the job's host-side work (its collate), which no device counts; the code that ran an op

May import: errors, units, results. Never `engine`, `workloads`, `plans`, `cli` or `api`.
"""
