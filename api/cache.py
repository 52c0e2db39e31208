"""Stored results in memory, and the plans made from them, so a plan query never touches SQLite.

`ResultCache` holds the result that answers each request key: loaded from the store at start-up,
updated by the probe workers and by `POST /v1/results` after the store has committed. Each entry
carries a version number, so a plan cached for an older result of the same key is never served
again after a new one is stored.

`PlanCache` keeps the serialized JSON of recent plan answers: a repeated query (every job of a
fleet asks the same one) costs a dictionary lookup. It is bounded, since queries choose the
effective batch and world size freely.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

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
            entry = Cached(stored=stored, version=next(self._versions))
            self._entries[key] = entry
            return entry

    def __len__(self) -> int:
        return len(self._entries)


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

    def put(self, key: tuple[object, ...], body: bytes) -> None:
        self._entries[key] = body
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
