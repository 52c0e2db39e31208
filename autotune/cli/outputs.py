"""The files a command writes (`--save`, `--plot`), checked before the probe spends minutes: the
same rules `autotune.results.write_file` writes them by."""

from __future__ import annotations

import os
from pathlib import Path

from autotune.errors import ConfigError


def check_output_file(flag: str, text: str, *, example: str, what: str, elsewhere: str) -> Path:
    """Where a flag's file will be written, refused before a probe spends minutes when it cannot be:
    empty, a directory, a FIFO, a device or a socket (written as Unix tools write a file: through a
    symlink to its target, a temporary file beside that renamed over it; `autotune.results.write_file`),
    in a directory that does not exist, or where this user cannot create a file (tried as the write
    will: permissions, a read-only file system, /proc; leaving no trace). Opens nothing that exists:
    a FIFO's open would wait for a reader."""
    import secrets
    import stat

    if not text.strip():
        raise ConfigError(f"{flag} is empty: give {what} to write, for example {flag} {example}")
    given = Path(text).expanduser()
    target = Path(os.path.realpath(given))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:  # a symlink loop, a path through a file
        raise ConfigError(f"{flag} {text!r} cannot be written: {exc.strerror or exc}; choose another path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ConfigError(f"{flag} {text!r} is a directory: name a file in it, for example {given / example}")
    if mode is not None and not stat.S_ISREG(mode):
        from autotune.results import file_kind

        raise ConfigError(f"{flag} {text!r} is {file_kind(mode)}, not a file: {elsewhere}, to a file")
    parent = target.parent
    if not parent.is_dir():
        state = "is not a directory" if parent.exists() else "does not exist"
        raise ConfigError(f"{flag} {text!r}: {parent} {state}: create it first or {elsewhere}")
    trial = parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
    try:
        os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(trial)
    except OSError as exc:
        raise ConfigError(f"{flag} {text!r} cannot be written: {exc.strerror or exc}; choose another path") from None
    return target
