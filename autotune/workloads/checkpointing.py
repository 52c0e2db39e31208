"""Activation checkpointing as a workload setting: recompute a block's activations in backward
instead of keeping them from forward.

A setting (`autotune.request.parse_checkpointing` reads it) is `none`, `full` (every repeated block)
or `every=K` (every K-th repeated block, counted from 1 as torchtitan's selective layer
checkpointing counts: blocks K, 2K, ...). It is applied with `torch.utils.checkpoint.checkpoint`
(non-reentrant) to the model's repeated blocks:

- named by the workload (`Workload(checkpoint_blocks=...)`): the attribute path of a ModuleList or
  Sequential whose children are the blocks ("model.layers"), or a function of the model returning
  the blocks;
- else the children of the largest ModuleList or Sequential whose children are all of one class
  (a transformer's layers);
- else, in a Sequential whose children repeat a pattern of classes (Linear, GELU, Linear, GELU, ...;
  a VGG's conv, norm, activation stages), each repetition of the pattern, as one segment
  (`torch.utils.checkpoint.checkpoint_sequential`'s segments): the one pattern whose repetitions
  cover the most children.

The block's `forward` is replaced on the instance (not its class, and the module tree, its names
and parameters are untouched), so the fingerprint's structure is the same with every setting, and
`remove` puts every replaced `forward` back: a live model (the job's own object) is returned as it
was unless the job asks for the setting (`apply` it again after the probe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.errors import WorkloadError
from autotune.request import parse_checkpointing

# What the blocks of a model are: an attribute path to a container of blocks, or a function of the
# model returning them.
BlocksSpec = str | Callable[[nn.Module], Sequence[nn.Module]]

_ORIGINAL = "_autotune_original_forward"  # the instance attribute that keeps a replaced forward


def checkpointed_indices(count: int, setting: str) -> list[int]:
    """The indices (from 0) of the blocks a setting checkpoints among `count` blocks."""
    setting = parse_checkpointing(setting)
    if setting == "none":
        return []
    every = 1 if setting == "full" else int(setting.removeprefix("every="))
    return [i for i in range(count) if (i + 1) % every == 0]


def _container(model: nn.Module, path: str) -> nn.Module:
    found: Any = model
    for part in path.split("."):
        if not part:
            continue
        found = getattr(found, part, None)
        if found is None:
            raise WorkloadError(f"checkpoint_blocks {path!r}: the model ({type(model).__name__}) has no {part!r}")
    if not isinstance(found, (nn.ModuleList, nn.Sequential)):
        raise WorkloadError(
            f"checkpoint_blocks {path!r} is a {type(found).__name__}, not a ModuleList or Sequential of blocks"
        )
    return found


def _uniform_containers(model: nn.Module) -> list[nn.Module]:
    """ModuleLists and Sequentials (at any depth) whose children, two or more, are all of one class."""
    found: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                found.append(module)
    return found


def _pattern(children: Sequence[nn.Module]) -> tuple[int, int] | None:
    """(period, repetitions) of the class pattern that repeats from the first child and covers the
    most children (ties: the shorter period); None when nothing repeats twice."""
    classes = [type(c) for c in children]
    best: tuple[int, int] | None = None
    for period in range(2, len(classes) // 2 + 1):
        reps = 1
        while classes[reps * period : (reps + 1) * period] == classes[:period]:
            reps += 1
        if reps >= 2 and (best is None or period * reps > best[0] * best[1]):
            best = (period, reps)
    return best


def find_blocks(model: nn.Module, spec: BlocksSpec | None = None) -> list[nn.Module] | tuple[nn.Sequential, int, int]:
    """The model's repeated blocks (a list of modules), or for a Sequential of a repeated class
    pattern (container, period, repetitions). Raises WorkloadError when the model has none."""
    if callable(spec):
        blocks = list(spec(model))
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise WorkloadError("checkpoint_blocks returned no modules: return the model's repeated blocks")
        return blocks
    if isinstance(spec, str):
        return list(_container(model, spec).children())
    uniform = _uniform_containers(model)
    if uniform:
        largest = max(uniform, key=lambda m: (len(list(m.children())), sum(p.numel() for p in m.parameters())))
        return list(largest.children())
    sequentials = [m for m in model.modules() if isinstance(m, nn.Sequential)]
    patterns = [(s, p) for s in sequentials if (p := _pattern(list(s.children()))) is not None]
    if patterns:
        sequential, (period, reps) = max(patterns, key=lambda sp: sp[1][0] * sp[1][1])
        return sequential, period, reps
    raise WorkloadError(
        f"no repeated blocks found in {type(model).__name__} to checkpoint: no ModuleList or Sequential of one "
        "class of module, nor a Sequential that repeats a pattern; name them with Workload(checkpoint_blocks=...)"
    )


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    if _ORIGINAL not in module.__dict__:
        module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
    module.forward = forward


def _segments_forward(sequential: nn.Sequential, period: int, reps: int, chosen: set[int]) -> Callable[..., Any]:
    children = list(sequential.children())

    def segment(start: int, x: Any) -> Any:
        for child in children[start : start + period]:
            x = child(x)
        return x

    def forward(x: Any) -> Any:
        for rep in range(reps):
            run = partial(segment, rep * period)
            x = _checkpointed(run)(x) if rep in chosen else run(x)
        for child in children[reps * period :]:
            x = child(x)
        return x

    return forward


def apply(model: nn.Module, setting: str, blocks: BlocksSpec | None = None) -> int:
    """Checkpoint the model's repeated blocks as `setting` says (after `remove`-ing any setting
    applied before); returns how many blocks are checkpointed. `none` only removes."""
    remove(model)
    setting = parse_checkpointing(setting)
    if setting == "none":
        return 0
    found = find_blocks(model, blocks)
    if isinstance(found, tuple):
        sequential, period, reps = found
        chosen = set(checkpointed_indices(reps, setting))
        _replace_forward(sequential, _segments_forward(sequential, period, reps, chosen))
        return len(chosen)
    indices = checkpointed_indices(len(found), setting)
    for i in indices:
        _replace_forward(found[i], _checkpointed(found[i].forward))
    return len(indices)


def remove(model: nn.Module) -> None:
    """Put back every `forward` that `apply` replaced in the model."""
    for module in model.modules():
        if _ORIGINAL in module.__dict__:
            original = module.__dict__.pop(_ORIGINAL)
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original


def applied(model: nn.Module) -> bool:
    """Whether `apply` left any block checkpointed in the model."""
    return any(_ORIGINAL in m.__dict__ for m in model.modules())


@contextmanager
def kept_as_it_was(model: nn.Module) -> Iterator[None]:
    """Put every module's `forward` back as it was on the way in (a live model probed with settings
    applied to it: the job gets its model back, checkpointed only as it was)."""
    missing = object()
    saved = [(m, m.__dict__.get("forward", missing), m.__dict__.get(_ORIGINAL, missing)) for m in model.modules()]
    try:
        yield
    finally:
        for module, forward, original in saved:
            for key, value in (("forward", forward), (_ORIGINAL, original)):
                if value is missing:
                    module.__dict__.pop(key, None)
                else:
                    module.__dict__[key] = value
