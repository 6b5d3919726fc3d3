"""SLURM time-limit and memory formats, and the UTC moments messages name."""

from __future__ import annotations

import re
import time

_TIME_FORMS = [
    (re.compile(r"^(\d+)$"), lambda m: int(m[1]) * 60),
    (re.compile(r"^(\d+):(\d{1,2})$"), lambda m: int(m[1]) * 60 + _s(m[2])),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), lambda m: int(m[1]) * 3600 + _m(m[2]) * 60 + _s(m[3])),
    (re.compile(r"^(\d+)-(\d{1,2})$"), lambda m: int(m[1]) * 86400 + _h(m[2]) * 3600),
    (re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2})$"), lambda m: int(m[1]) * 86400 + _h(m[2]) * 3600 + _m(m[3]) * 60),
    (re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2}):(\d{1,2})$"),
     lambda m: int(m[1]) * 86400 + _h(m[2]) * 3600 + _m(m[3]) * 60 + _s(m[4])),
]
UNLIMITED = ("UNLIMITED", "INFINITE", "NONE")
MAX_MINUTES = (2**31 - 1 - 59) // 60
"""The longest finite limit sbatch reads (35791393 minutes, 24855-03:13:00): it adds up ``--time`` in seconds in
a signed 32-bit int, then 59 more to round up to minutes; a longer one wraps (SLURM's uint32 minutes never get
that far)."""


def _bounded(v: str, hi: int, what: str) -> int:
    n = int(v)
    if n >= hi:
        raise ValueError(f"{what} must be below {hi}, got {n}")
    return n


def _s(v: str) -> int:
    return _bounded(v, 60, "seconds")


def _m(v: str) -> int:
    return _bounded(v, 60, "minutes")


def _h(v: str) -> int:
    return _bounded(v, 24, "hours")


def _at_most_max(seconds: int) -> int:
    if -(-seconds // 60) > MAX_MINUTES:
        raise ValueError(f"time limit must be at most {MAX_MINUTES} minutes ({format_time_limit(MAX_MINUTES * 60)}), "
                         "the longest sbatch reads (a longer --time wraps); UNLIMITED sets none")
    return seconds


def parse_time_limit(value: str | int) -> int | None:
    """Parse a SLURM time limit into seconds; ``None`` means unlimited.

    Accepts every ``--time`` form: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S`` and ``UNLIMITED``/``INFINITE``, up to :data:`MAX_MINUTES`.  Anything else raises ValueError.
    """
    if isinstance(value, bool):
        raise ValueError("time limit must be a SLURM time string, not a boolean")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("time limit in minutes must be positive")
        return _at_most_max(value * 60)
    text = str(value).strip()
    if text.upper() in UNLIMITED:
        return None
    for rx, conv in _TIME_FORMS:
        m = rx.match(text)
        if m:
            seconds = conv(m)
            if seconds <= 0:
                raise ValueError("time limit must be positive")
            return _at_most_max(seconds)
    raise ValueError(
        f"invalid SLURM time limit {text!r}: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED")


def format_time_limit(seconds: int | None) -> str:
    """Render seconds as ``D-HH:MM:SS`` for ``sbatch --time`` (rounded up to a minute)."""
    if seconds is None:
        return "UNLIMITED"
    minutes = -(-seconds // 60)
    d, rem = divmod(minutes * 60, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}"


_MEM = re.compile(r"^(\d+)([KMGT]?)B?$", re.IGNORECASE)


def parse_memory(value: str | int) -> str:
    """Validate a SLURM ``--mem`` value and return it normalised (e.g. ``64G``)."""
    if isinstance(value, bool):
        raise ValueError("memory must be like 64G or 512M")
    m = _MEM.match(str(value).strip())
    if not m or int(m[1]) <= 0:
        raise ValueError(f"invalid memory {value!r}: use a positive number with K, M, G or T (e.g. 64G)")
    if not m[2]:   # (sbatch reads one as megabytes: `memory: 64` meant for 64 GB ran out of memory at 64 MB)
        raise ValueError(f"memory {value!r} has no unit: write {m[1]}G, or {m[1]}M (SLURM reads a bare number as MB)")
    if int(m[1]) * 1024 ** "KMGT".index(m[2].upper()) >= 2 ** 40:   # KiB (sbatch: "Invalid --mem specification")
        raise ValueError(f"memory {value!r} is more than a node has (below 1024T)")
    return f"{int(m[1])}{m[2].upper()}"


def utc_minute(epoch_s: float) -> str:
    """``2026-12-01 13:05 UTC``: a moment as messages and the CLI name it."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch_s))


def utc_iso(epoch_s: float) -> str:
    """``2027-01-31T23:59:59Z``: a moment as ISO 8601 UTC (a key's expiry, as its config may write it)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))

