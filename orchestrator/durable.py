"""Files written whole: a crash (kill -9, power loss after the fsyncs) leaves the old content or the new one,
never a part.  Every record the daemon keeps (batch records, a batch array's state, file records, scale pins,
the admin key, a gateway worker's usage spool) is written here."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_whole(path: Path, data: bytes, *, mode: int = 0o600, tmp: Path | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder (``tmp``, or ``<name>.tmp<pid>.<thread>``:
    two threads saving one record at once each write their own): written, fsync'd, renamed over ``path``, and the
    folder fsync'd (the rename is durable too)."""
    tmp = tmp or path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_native_id()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (a rename, a new or removed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
