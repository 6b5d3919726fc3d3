"""Lists of files and batches, a page at a time, as OpenAI's ``after`` cursors page them.

Ids made by :func:`time_id` start with their creation time (milliseconds, 12 hex digits), so a list's order
is the ids' order, and a cursor places itself even when it is no longer in the list: a client that deletes
what it pages through (``for f in client.files.list(): client.files.delete(f.id)``) asks for the page after
an id that is gone, and gets the rest, not an empty page that ends its loop.  A record with an older id (24
random hex digits) sorts by its ``created``/``created_at``; a cursor like it that is gone is refused
(:class:`UnknownCursor`), never answered with an empty page.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable


class UnknownCursor(ValueError):
    pass


def time_id(prefix: str, now: float | None = None) -> str:
    ms = int((time.time() if now is None else now) * 1000)
    return f"{prefix}{ms:012x}{secrets.token_hex(8)}"


def _ms(oid: str, prefix: str) -> int | None:
    rest = oid[len(prefix):] if oid.startswith(prefix) else ""
    if len(rest) not in (28, 29):   # (29: a batch's output or error file, its batch's id and "o" or "e")
        return None
    try:
        return int(rest[:12], 16)
    except ValueError:
        return None


def _key(rec: dict, prefix: str) -> tuple[float, str]:
    ms = _ms(rec["id"], prefix)
    return (ms if ms is not None else rec.get("created", rec["created_at"]) * 1000.0, rec["id"])


def page(recs: Iterable[dict], prefix: str, limit: int, after: str | None = None,
         newest_first: bool = True) -> tuple[list[dict], bool]:
    """``recs`` in order, those after ``after``: (at most ``limit`` of them, whether more follow)."""
    keyed = sorted(((_key(r, prefix), r) for r in recs), key=lambda kr: kr[0], reverse=newest_first)
    if after is not None:
        at = next((i for i, (_, r) in enumerate(keyed) if r["id"] == after), None)
        if at is not None:
            keyed = keyed[at + 1:]
        else:
            ms = _ms(after, prefix)
            if ms is None:
                raise UnknownCursor(f"No object with the id `{after}` to list after.")
            k = (float(ms), after)
            keyed = [kr for kr in keyed if (kr[0] < k if newest_first else kr[0] > k)]
    return [r for _, r in keyed[:limit]], len(keyed) > limit
