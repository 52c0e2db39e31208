"""Progress inside a trial, for a person to watch: which optimizer step and micro-step is running.

A trial runs for seconds on a large model, and a probe for minutes; its trials arrive only when
they end. So the runner also reports the start of every micro-step (`TrialProgress`: the batch,
step 2/2, micro-step 1/3, seconds since the trial started), the isolated child sends those reports
to its caller, and the command line shows them as they come. `throttled` keeps a fast loop from
flooding a pipe or a log: the first micro-step of every trial always passes, later ones at most
every `interval` seconds. Nothing here imports torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field

INTERVAL_SECONDS = 0.1  # at most this often, after the first micro-step of a trial


class TrialProgress(BaseModel):
    """A micro-step begins: micro-step `micro_step` of optimizer step `step` of a trial at `batch`.

    `step` 0 (and `micro_step` 0) says that a fresh process is starting and no step has begun."""

    batch: int = Field(ge=1)
    step: int = Field(ge=0, description="The optimizer step that is running, from 1; 0 while starting.")
    steps: int = Field(ge=1)
    micro_step: int = Field(ge=0, description="The micro-step of that optimizer step, from 1; 0 while starting.")
    micro_steps: int = Field(ge=1)
    seconds: float = Field(ge=0, description="Seconds since the trial (or its fresh process) started.")
    phase: Literal["search", "confirm"] = Field(
        default="search", description="search: a trial of the probe; confirm: a fresh-process confirmation run."
    )

    @property
    def starting(self) -> bool:
        return self.step == 0

    @property
    def first(self) -> bool:
        """The first report of a trial (its start, or its first micro-step)."""
        return self.step <= 1 and self.micro_step <= 1


ProgressCallback = Callable[[TrialProgress], None]


def throttled(
    callback: ProgressCallback, interval: float = INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic
) -> ProgressCallback:
    """`callback`, called for the first report of every trial and otherwise at most every `interval` s."""
    last = -math.inf

    def relay(progress: TrialProgress) -> None:
        nonlocal last
        now = clock()
        if progress.first or now - last >= interval:
            last = now
            callback(progress)

    return relay
