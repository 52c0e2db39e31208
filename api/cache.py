"""Stored results in memory, and the plans made from them, so a plan query never touches SQLite.

`ResultCache` holds the result that answers each request key: loaded from the store at start-up,
updated by the probe workers and by `POST /v1/results` after the store has committed. Each entry
carries a version number, so a plan cached for an older result of the same key is never served
again after a new one is stored.

`PlanCache` keeps the serialized JSON of recent plan answers: a repeated query (every job of a
fleet asks the same one) costs a dictionary lookup. It is bounded, since queries choose the
effective batch and world size freely.

`PlotCache` keeps the PNGs of recent plot requests, drawn once per result off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from autotune.results import ProbeResult
from autotune.store import StoredResult


@dataclass(frozen=True)
class Cached:
    stored: StoredResult
    version: int


class ResultCache:
    def __init__(self, initial: dict[str, StoredResult] | None = None) -> None:
        self._versions = itertools.count(1)
        self._lock = threading.Lock()  # writers only: readers take one dict lookup, atomic under the GIL
        self._entries: dict[str, Cached] = {}
        for key, stored in (initial or {}).items():
            self.put(key, stored)

    def get(self, key: str) -> Cached | None:
        return self._entries.get(key)

    def put(self, key: str, stored: StoredResult) -> Cached:
        with self._lock:
            current = self._entries.get(key)
            # The same result stored again (a worker caches its probe's result before the store
            # records it, with a later time) keeps its version: the plans made from it still hold.
            # Any difference at all is a new version (a plan depends on more than the answer).
            if current is not None and current.stored.result == stored.result:
                version = current.version
            else:
                version = next(self._versions)
            entry = Cached(stored=stored, version=version)
            self._entries[key] = entry
            return entry

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, Cached]]:
        """Every request key and its result (a copy: the refresher may add entries meanwhile)."""
        return list(self._entries.items())


class PlanCache:
    """A bounded LRU of serialized plan answers, used from the event loop thread only."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[object, ...], bytes] = OrderedDict()

    def get(self, key: tuple[object, ...]) -> bytes | None:
        body = self._entries.get(key)
        if body is not None:
            self._entries.move_to_end(key)
        return body

    def newest(self) -> list[tuple[tuple[object, ...], bytes]]:
        """The cached answers, most recently used first."""
        return list(reversed(self._entries.items()))

    def put(self, key: tuple[object, ...], body: bytes) -> None:
        self._entries[key] = body
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


@dataclass
class PlotStats:
    renders: int = 0  # pictures drawn
    hits: int = 0  # answered from the cache
    joined: int = 0  # waited for a drawing another request had started


class PlotCache:
    """Rendered plot PNGs (`GET /v1/probes/{id}/plot.png`), a bounded LRU used from the event loop.

    Keyed by the result: its fingerprint, with its creation time and number of run failures (a
    probe run again, or a result lowered by a run failure, keeps the fingerprint and changes the
    picture). A picture takes a quarter of a second of CPU to draw: it is drawn in a worker thread,
    once however many requests ask for it at the same time (they await the same task), and kept
    for the next ones. At most `size` pictures (tens of KiB each) are kept."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.stats = PlotStats()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._drawing: dict[str, asyncio.Task[bytes]] = {}

    @staticmethod
    def key(result: ProbeResult) -> str:
        return f"{result.fingerprint}:{result.created_at.isoformat()}:{len(result.run_failures)}"

    async def get(self, result: ProbeResult, render: Callable[[ProbeResult], bytes]) -> bytes:
        """The PNG of `result`: from the cache, or drawn by `render` in a thread."""
        key = self.key(result)
        png = self._entries.get(key)
        if png is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return png
        task = self._drawing.get(key)
        if task is None:
            task = asyncio.ensure_future(self._draw(key, result, render))
            self._drawing[key] = task
        else:
            self.stats.joined += 1
        # shield: a client that goes away cancels its own wait, never the drawing others await.
        return await asyncio.shield(task)

    async def _draw(self, key: str, result: ProbeResult, render: Callable[[ProbeResult], bytes]) -> bytes:
        try:
            self.stats.renders += 1
            png = await asyncio.to_thread(render, result)
        finally:
            self._drawing.pop(key, None)
        self._entries[key] = png
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return png

    def __len__(self) -> int:
        return len(self._entries)
