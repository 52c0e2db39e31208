"""Workloads: what a trial runs, where it comes from, and what identifies it.

    workload     `Workload` and `Precision`: a model factory, a batch maker, a loss, an optimizer
    live         a workload made of a job's live objects (`Workload.from_model`)
    targets      a CLI or service target (a built-in example name or module:attribute) made a Workload
    examples     the built-in examples (mlp, cnn, gpt), from code with random weights
    worstcase    the batch of size B that needs the most memory, found in the job's data
    checkpointing  activation checkpointing of a model's repeated blocks (none, full, every=K)
    registry     the service's registered workloads (AUTOTUNE_WORKLOADS)
    fingerprint  a stable hash of everything that determines a probe's answer
    probekey     which stored result answers a request, known before any probe runs
    usercode     errors raised by a workload's own code, named by file:line

Imports flow one way: examples -> workload <- live, targets -> (workload, examples); registry,
fingerprint and probekey sit above them. May import the package's face, `plans`, `parallel`
and `devices`. Never `engine`, `cli` or `api`.
"""
