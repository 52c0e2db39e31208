"""The fingerprint: a stable hash of everything that determines a probe's answer.

Model structure (module types, parameter and buffer names, shapes and dtypes), the batch at size 1
(shapes and dtypes: sequence length, image size), the workload's input spec, precision,
optimizer and its options, steps, the device (kind, name, total memory), the memory limit, the cap
and granularity, torch and CUDA versions, and the allocator configuration. The model and batch are
built on the meta device, so fingerprinting allocates nothing and needs no GPU.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from autotune.errors import WorkloadError
from autotune.workload import Workload


def model_structure(workload: Workload) -> dict[str, Any]:
    try:
        with torch.device("meta"):
            model = workload.build_model()
            batch = workload.make_batch(1, torch.device("meta"))
    except Exception as exc:  # noqa: BLE001 - user code; reported as a workload error
        raise WorkloadError(
            f"building workload {workload.name!r} on the meta device failed: {type(exc).__name__}: {exc}"
        ) from None
    leaves, _ = tree_flatten(batch)
    return {
        "modules": [f"{name}:{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()],
        "parameters": [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()],
        "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()],
        "batch": [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t) for t in leaves],
    }


def fingerprint(workload: Workload, **environment: Any) -> str:
    """sha256 over the workload's structure and `environment` (device, limit, versions...)."""
    document = {
        "structure": model_structure(workload),
        "input_spec": dict(workload.input_spec),
        "precision": str(workload.precision),
        "optimizer": workload.optimizer_name,
        "optimizer_kwargs": {k: repr(v) for k, v in sorted(workload.optimizer_kwargs.items())},
        "environment": environment,
    }
    encoded = json.dumps(document, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).hexdigest()
