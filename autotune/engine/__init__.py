"""The probe engine: trials, the search over them, the predictor, the probe end to end, its isolated
child and the fresh-process confirmation, and `estimate`.

    oom        telling an out-of-memory error from any other failure, and getting rid of it
    trial      the job's loop at one micro-batch size, then undone
    search     which sizes to try (pure logic over a trial callable; no torch)
    predict    two timeline trials predict the answer, two more verify it
    objective  the fastest fitting micro-batch for a plan (throughput)
    checkpointing  activation checkpointing chosen with the micro-batch: a probe per setting, the fastest plan
    probe      a probe end to end: device, workload, search, plan, result
    isolation  a probe in a fresh child process with a hard timeout
    zygote     the fork server a probe's processes come from (one torch import for all)
    lock       one probe per device on this node: the device's OS lock every probe holds
    confirm    each answer run again in a fresh process
    estimate   the answer for a memory size, computing nothing (fake tensors)

May import: the package's face (errors, units, results, request, settings, progress), `devices`,
`workloads`, `plans`, `parallel`. Never `cli`, `store`, `integrations` or `api`. This `__init__`
imports nothing, so `autotune.engine.search` stays torch-free.
"""
