"""The types of the CLI's arguments: a bad one is argparse's clear error (exit 2), not a traceback later."""

from __future__ import annotations

import argparse
import re

from .config import MAX_REPLICAS


MAX_SECONDS = 86400.0


def seconds(v: str) -> float:
    """A number of seconds above 0, at most a day (``--watch``: a negative or NaN one failed in time.sleep, and
    so did infinity or 1e10, after the first print)."""
    try:
        s = float(v)
    except ValueError:
        s = float("nan")
    if not 0 < s <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number of seconds above 0 and at most {MAX_SECONDS:.0f}")
    return s


def shards(v: str) -> int:
    """A dedicated batch's array tasks (0 became a shared batch, -1 a 400 after its file was uploaded)."""
    from .batches import MAX_SHARDS
    if not (v.isascii() and v.isdigit() and 1 <= int(v) <= MAX_SHARDS):
        raise argparse.ArgumentTypeError(f"{v!r} is not a number of shards from 1 to {MAX_SHARDS}")
    return int(v)


def list_limit(v: str) -> int:
    """How many batches a list asks for: 1-100, as OpenAI's ``limit``."""
    if not (v.isascii() and v.isdigit() and 1 <= int(v) <= 100):
        raise argparse.ArgumentTypeError(f"{v!r} is not a number from 1 to 100")
    return int(v)


def slot(v: str) -> int:
    """A replica's slot: 0, 1, ... (a negative one rendered a job tag no daemon makes)."""
    if not (v.isascii() and v.isdigit()):
        raise argparse.ArgumentTypeError(f"{v!r} is not a slot (0, 1, 2, ...)")
    return int(v)


def job_id(v: str) -> str:
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", v):
        raise argparse.ArgumentTypeError(f"{v!r} is not a SLURM job id (digits, or JOB_TASK for an array task)")
    return v


def replicas(v: str) -> int | str:
    """A replica count (at most the file's limit) or ``auto``."""
    if v == "auto":
        return v
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is neither a count nor 'auto'") from None
    if not 0 <= n <= MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"a count must be from 0 to {MAX_REPLICAS}")
    return n
