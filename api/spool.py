"""A finished probe's outcome, visible to every worker of the node before the store has it.

The worker that runs a job knows its outcome first; the store, which every other worker reads, may
not be writable then (a full disk, PostgreSQL down). Without this, the other workers of the node
went on answering `running` for a probe that had finished. So each running job has a spool file
beside the device locks (AUTOTUNE_LOCK_DIR/jobs/<id>.spool), made when the job is claimed (the
store was just written: there is room) and given its whole size then (`posix_fallocate`), mapped
in memory. Its outcome is written into that mapping, which needs no more room on the disk and no
write(2) (a full disk, or RLIMIT_FSIZE, refuses those), before the worker itself answers with it,
and the file is removed once the store has recorded it. Another worker reading a job the store
says is running, whose owner is a live process of this host, asks the spool: running, finished
(the outcome, as the owner answers it), or nothing to go by, which it answers with 503.

Layout: b"ATS1", a state byte (RUNNING, FINISHED, UNKEPT: finished, outcome too large), padding,
the outcome's length (8 bytes, little-endian) at 8, the outcome (JSON) from 16.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from autotune.results import ProbeResult
from autotune.store import JobRecord

log = logging.getLogger(__name__)

MAGIC = b"ATS1"
RUNNING, FINISHED, UNKEPT = 0, 1, 2
HEADER = 16
SIZE = 4 * 2**20  # bytes per running job: a result with hundreds of trials is a few hundred KiB
_ID = re.compile(r"^[0-9a-f]{32}$")

State = Literal["running", "finished", "unkept"]


@dataclass(frozen=True)
class Spooled:
    """What the spool says of a job: still running, finished with its outcome, or finished with
    an outcome too large to keep here."""

    state: State
    record: JobRecord | None = None
    result: ProbeResult | None = None


class Entry:
    """The spool file of one job this process runs: its outcome goes in, and it goes away."""

    def __init__(self, path: Path, fd: int, mapped: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._map = mapped

    def finish(self, record: JobRecord, result: ProbeResult | None) -> bool:
        """Write the outcome (no disk space or write(2) needed); False when it does not fit."""
        document = json.dumps(
            {
                "record": record.model_dump(mode="json"),
                "result": None if result is None else result.model_dump(mode="json"),
            },
            separators=(",", ":"),
        ).encode()
        if len(document) > SIZE - HEADER:
            self._map[4] = UNKEPT
            return False
        self._map[HEADER : HEADER + len(document)] = document
        self._map[8:16] = struct.pack("<Q", len(document))
        self._map[4] = FINISHED  # last: a reader that sees it finds the outcome whole
        return True

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class JobSpool:
    """The node's spool directory (AUTOTUNE_LOCK_DIR/jobs): every worker of the node shares it."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory: Path | None
        try:
            if directory is None:
                from autotune.engine.lock import lock_dir

                directory = lock_dir() / "jobs"
            directory.mkdir(mode=0o700, exist_ok=True)
            self.directory = directory
        except Exception as exc:  # noqa: BLE001 - no spool: statuses of other workers' jobs are refused instead
            log.warning("no job spool (%s): other workers answer 503 for this node's unrecorded outcomes", exc)
            self.directory = None

    def _path(self, job_id: str) -> Path | None:
        if self.directory is None or not _ID.match(job_id):
            return None
        return self.directory / f"{job_id}.spool"

    def start(self, job_id: str) -> Entry | None:
        """The spool file of a job just claimed, its room taken now; None when it cannot be made."""
        path = self._path(job_id)
        if path is None:
            return None
        fd = -1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.posix_fallocate(fd, 0, SIZE)  # the room, now: the outcome will need none
            mapped = mmap.mmap(fd, SIZE)
            mapped[0:HEADER] = MAGIC + bytes([RUNNING]) + bytes(11)
        except OSError as exc:
            log.warning("probe job %s: no spool file (%s): other workers answer 503 for it once it ends", job_id, exc)
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return Entry(path, fd, mapped)

    def read(self, job_id: str) -> Spooled | None:
        """What the spool says of a job another worker runs; None when it has no spool file."""
        path = self._path(job_id)
        if path is None:
            return None
        try:
            with open(path, "rb") as file:
                header = file.read(HEADER)
                if len(header) < HEADER or header[:4] != MAGIC:
                    return None
                state = header[4]
                if state == RUNNING:
                    return Spooled("running")
                if state == UNKEPT:
                    return Spooled("unkept")
                (length,) = struct.unpack("<Q", header[8:16])
                document = json.loads(file.read(min(length, SIZE - HEADER)))
            record = JobRecord.model_validate(document["record"])
            result = None if document["result"] is None else ProbeResult.model_validate(document["result"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("probe job %s: unreadable spool file (%s)", job_id, exc)
            return None
        return Spooled("finished", record, result)
