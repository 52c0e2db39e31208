"""Targets: what the CLI and the service name a workload by, made a `Workload`.

A target is a built-in example's name (mlp, cnn, gpt) or `module:attribute`, naming a Workload or
a function of keyword options that returns one. Errors name the target, and the workload's own
errors say where in its code they were raised (`autotune.workloads.usercode`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from autotune.errors import AutotuneError, WorkloadError
from autotune.request import OptionValue
from autotune.workloads import examples
from autotune.workloads.usercode import attach, describe, where
from autotune.workloads.workload import Workload


def _import_attribute(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise WorkloadError(
            f"target {target!r} is neither a built-in example nor module:attribute (for example mypkg.train:workload)"
        )
    # Like uvicorn's --app-dir default: `autotune probe mypkg.train:workload` run from a project
    # directory finds mypkg there even though console scripts do not put the cwd on sys.path.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        at = where(exc)
        raise attach(
            WorkloadError(
                f"cannot import module {module_name!r} for target {target!r}: {exc}" + (f" (at {at})" if at else "")
            ),
            exc,
        ) from None
    except SystemExit as exc:  # sys.exit() at import: a script's main part run without a __main__ guard
        raise attach(
            WorkloadError(
                f"importing {module_name!r} for target {target!r} exited with code {exc.code!r}"
                + (f" (at {where(exc)})" if where(exc) else "")
                + ": a workload's module must not exit on import; put its script part under "
                "`if __name__ == '__main__':`"
            ),
            exc,
        ) from None
    except Exception as exc:  # noqa: BLE001 - user code may raise anything at import time
        raise attach(
            WorkloadError(f"importing {module_name!r} for target {target!r} failed: {describe(exc)}"), exc
        ) from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WorkloadError(f"module {module_name!r} has no attribute {attribute!r}") from None
    return obj


def resolve(target: str, options: Mapping[str, OptionValue] | None = None) -> Workload:
    """Turn a CLI/service target into a Workload: a built-in example name or module:attribute."""
    options = dict(options or {})
    if ":" not in target:
        factory = examples.EXAMPLES.get(target)
        if factory is None:
            names = ", ".join(sorted(examples.EXAMPLES))
            raise WorkloadError(f"unknown workload {target!r}: use a built-in example ({names}) or module:attribute")
        return _call_factory(factory, options, target)
    obj = _import_attribute(target)
    if isinstance(obj, Workload):
        if options:
            raise WorkloadError(
                f"{target} is a Workload instance and takes no options; make it a function "
                f"that takes keyword options to pass {sorted(options)}"
            )
        return obj
    if callable(obj):
        return _call_factory(obj, options, target)
    raise WorkloadError(f"{target} is a {type(obj).__name__}, not a Workload or a function returning one")


def _arguments(options: Mapping[str, OptionValue]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


def _call_factory(factory: Callable[..., Any], options: dict[str, OptionValue], target: str) -> Workload:
    try:
        workload = factory(**options)
    except AutotuneError:  # a WorkloadError of its own (an unknown optimizer name): already says what
        raise
    except TypeError as exc:
        if where(exc) is None or exc.__traceback__ is None or exc.__traceback__.tb_next is None:
            # Raised by the call itself: the options do not match the factory's parameters.
            raise WorkloadError(f"bad options {options} for {target}: {exc}") from None
        raise attach(WorkloadError(f"{target}({_arguments(options)}) failed: {describe(exc)}"), exc) from None
    except SystemExit as exc:
        raise attach(
            WorkloadError(
                f"{target}({_arguments(options)}) exited with code {exc.code!r}"
                + (f" (at {where(exc)})" if where(exc) else "")
                + ": a workload factory must return a Workload, not exit"
            ),
            exc,
        ) from None
    except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
        raise attach(WorkloadError(f"{target}({_arguments(options)}) failed: {describe(exc)}"), exc) from None
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{target} returned {type(workload).__name__}, not a Workload")
    return workload
