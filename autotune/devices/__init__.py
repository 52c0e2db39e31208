"""The devices a probe runs on, behind one seam (`ProbeDevice` in `budget`): what a trial asks of a
device is its limit, its counters and a reset, whatever the device is.

    budget     the CPU budget device: a simulated accelerator memory that raises a real OOM
    cuda       a CUDA GPU as a probing device: the headroom cap and the caching allocator's counters
    nvml       the GPU inventory as NVML reports it (never initialises CUDA)

May import: errors, units, results. Never `engine`, `workloads`, `plans`, `cli` or `api`.
"""
