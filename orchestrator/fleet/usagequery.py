"""Reading the usage ledger (the daemon writes it: :mod:`.usage`): ``<state_dir>/usage.sqlite3`` for ``slurmfleet
usage`` (:func:`query`), and the per-key series of ``/metrics`` (:func:`key_usage`)."""

from __future__ import annotations

import dataclasses
import math
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..contract import GatewayReport
from .usage import HOUR_S, UsageLedger, hour_bucket

DIMENSIONS = {"key": "key", "group": "grp", "model": "model", "day": "substr(hour, 1, 10)", "hour": "hour"}


def query(path: str | Path, since_epoch_s: float, until_epoch_s: float, by: list[str]) -> list[dict]:
    """Usage in the hours from the one ``since_epoch_s`` falls in up to ``until_epoch_s``: an hour it falls
    inside is counted whole, an hour that starts at it is not (``--until 2026-11-02`` ends with Nov 1), summed by ``by`` (any of :data:`DIMENSIONS`), read-only.  Each row: the dimensions (a key
    without a group has ``group`` None), ``requests``, ``prompt_tokens``, ``completion_tokens``, ``tokens``.
    FileNotFoundError when there is no file; sqlite3.Error when it cannot be read."""
    path = Path(path)
    unknown = [b for b in by if b not in DIMENSIONS]
    if unknown:
        raise ValueError(f"cannot group by {', '.join(unknown)} (one of {', '.join(DIMENSIONS)})")
    if not path.is_file():
        raise FileNotFoundError(path)
    lo = hour_bucket(since_epoch_s)
    hi = hour_bucket(math.ceil(until_epoch_s / HOUR_S) * HOUR_S)
    dims = [DIMENSIONS[b] for b in by]
    sql = ("SELECT " + "".join(f"{d}, " for d in dims)
           + "SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) FROM usage WHERE hour >= ? AND hour < ?"
           + (f" GROUP BY {', '.join(dims)} ORDER BY {', '.join(dims)}" if dims else ""))
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute(sql, (lo, hi)).fetchall()
    finally:
        db.close()
    out = []
    for row in rows:
        requests, prompt, completion = row[len(by):]
        if requests is None:   # no group by and no rows: SUM gives one row of NULLs
            continue
        d = {b: (v or None) if b == "group" else v for b, v in zip(by, row)}
        out.append({**d, "requests": requests, "prompt_tokens": prompt, "completion_tokens": completion,
                    "tokens": prompt + completion})
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class KeyUsage:
    """The per-key series ``/metrics`` exports (see :func:`key_usage`)."""

    keys: tuple[str, ...]                                     # the label values: every configured key name
    totals: Mapping[tuple[str, str], tuple[int, int, int]]     # (key, model) -> requests, prompt, completion
    rejected: Mapping[tuple[str, str], int]                    # (key, reason) -> refused requests
    inflight: Mapping[str, int]                                # key -> requests in flight now
    # ("key", name) or ("group", name) -> its token budget, the tokens used in its period (the ledger's), the
    # period's end (epoch seconds): the keys and groups with a budget
    budgets: Mapping[tuple[str, str], tuple[int, int, float]] = dataclasses.field(default_factory=dict)
    background: Mapping[str, int] = dataclasses.field(default_factory=dict)   # key -> background responses not
    # charged yet (:meth:`.background.BackgroundBook.by_key`)


def key_usage(ledger: UsageLedger, reports: Iterable[GatewayReport], keys: Iterable[str],
              budgets: Mapping[tuple[str, str], tuple[int, int, float]] | None = None,
              background: Mapping[str, int] | None = None) -> KeyUsage:
    """The per-key series for ``/metrics``: counters from ``ledger`` (they include processes that died),
    in flight from the live processes' ``reports``, ``budgets`` as the tenancy loop last saw them (its ledger's
    tokens of each budget's period, every half second).  Labels are bounded by ``keys`` (the configured key
    names); with none configured (an open gateway), the names the gateway reported (its one anonymous
    tenant)."""
    inflight: dict[str, int] = {}
    for r in reports:
        for name, u in r.tenants.items():
            inflight[name] = inflight.get(name, 0) + u.inflight
    totals, rejected = ledger.totals(), ledger.rejections()
    names = set(keys) or {k for k, _ in totals} | {k for k, _ in rejected} | set(inflight)
    return KeyUsage(
        tuple(sorted(names)), {k: v for k, v in totals.items() if k[0] in names},
        {k: v for k, v in rejected.items() if k[0] in names}, {k: v for k, v in inflight.items() if k in names},
        dict(budgets or {}), {k: v for k, v in (background or {}).items() if k in names})

