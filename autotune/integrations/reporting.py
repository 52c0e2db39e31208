"""How an integration's failure reaches the user: as the CLI says it, in a traceback of a few lines.

The integrations run inside the user's training script, so what they raise is printed by Python
with every frame it passed through: the trial's, the search's, the framework's (33 to 52 lines,
none of them the user's, for a `KeyError` in the user's forward). So a failure caused by the job's
own code is raised as that code's exception (its type: `except KeyError` still catches it), with
the user's frames only and the one that raised it, and autotune's one line as a note:

    Traceback (most recent call last):
      File "train.py", line 40, in <module>
        tune_accelerator(accelerator, model, optimizer, dataset, "max", loss=loss_fn)
      File ".../autotune/integrations/reporting.py", line 66, in tune_accelerator
        raise failure from failure.__cause__
      File "train.py", line 21, in loss_fn
        return model(batch["features"])
                     ~~~~~^^^^^^^^^^^^
    KeyError: 'features'
    autotune: batch 4 failed with an error that is not out-of-memory: KeyError: 'features' (at train.py:21 in loss_fn)

autotune's own errors (a refusal, nothing fits) are raised without the frames inside autotune.
AUTOTUNE_DEBUG=1 keeps every frame of both. Lightning calls the callback from inside `fit`, whose
frames the failure passes through on its way out: the callback cuts them in `on_exception`
(`lightning_frames_cut`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch.utils.data import DataLoader, default_collate

from autotune.errors import AutotuneError, NotAnOOMError
from autotune.settings import get_settings
from autotune.workloads import live, usercode

F = TypeVar("F", bound=Callable[..., Any])

# A note for the failure, from the call's arguments (the integration knows what the user left out).
Hint = Callable[[AutotuneError, inspect.BoundArguments], str | None]


def for_the_caller(error: AutotuneError, *notes: str) -> BaseException:
    """What to raise in the user's process for `error` (`autotune.workloads.usercode.for_the_caller`)."""
    return usercode.for_the_caller(error, *notes, debug=get_settings().debug)


def reports_to_the_caller(hint: Hint | None = None) -> Callable[[F], F]:
    """Decorate an integration's entry point: its failures are raised for the caller to read
    (`for_the_caller`), with `hint`'s note when it has one."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def tuning(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except AutotuneError as error:
                noted = hint(error, signature.bind(*args, **kwargs)) if hint is not None else None
                failure = for_the_caller(error, *([noted] if noted else []))
                # `from` its own cause: the error being handled here is autotune's, not the
                # context of the job's exception.
                raise failure from failure.__cause__

        # The one frame of autotune's in the traceback names the function the user called.
        tuning.__code__ = tuning.__code__.replace(  # type: ignore[attr-defined]
            co_name=fn.__name__, co_qualname=fn.__qualname__
        )
        return tuning  # type: ignore[return-value]

    return decorate


def lightning_frames_cut(exception: BaseException) -> None:
    """For Lightning's `on_exception` hook, with the failure a callback raised: the frames of `fit`
    it passed through (and the callback's own but the innermost) are dropped before Lightning raises
    it again."""
    if not get_settings().debug:
        exception.__traceback__ = usercode.users_traceback(exception.__traceback__)


def default_collate_hint(error: AutotuneError, call: inspect.BoundArguments) -> str | None:
    """When the job's code asked the batch for a field that torch's default_collate did not make,
    because the call had a Dataset and no `collate=` (the job's own collate_fn adds `lengths`, say)."""
    arguments = call.arguments
    data: Any = arguments.get("data", arguments.get("batch"))
    if (
        not isinstance(error, NotAnOOMError)
        or arguments.get("collate") is not None
        or isinstance(data, DataLoader)
        or not live.is_dataset(data)
    ):
        return None
    missing = next((e for e in usercode.chain(error) if isinstance(e, KeyError)), None)
    try:
        batch = default_collate([data[0]])
    except Exception:  # noqa: BLE001 - no hint then: the error says what it says
        return None
    if missing is None or not missing.args or not isinstance(batch, Mapping) or missing.args[0] in batch:
        return None
    return (
        f"autotune: the batches were made by torch's default_collate, since no collate= was given with the "
        f"Dataset, and they have no field {missing.args[0]!r} (their fields: {', '.join(map(str, batch))}): "
        "pass collate=, the collate_fn of the job's DataLoader (or pass the DataLoader)"
    )
