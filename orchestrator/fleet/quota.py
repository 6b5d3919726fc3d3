"""Per-key limits over every gateway process: the fleet's half.

Facts in: each gateway process's cumulative per-key counters (:class:`~orchestrator.contract.TenantUsage`),
sampled every report (:class:`QuotaBook` keeps the last window of samples per process incarnation).
State out: :func:`allocate`, a pure function, gives each live process an
:class:`~orchestrator.contract.Allowance` per key: caps on its own cumulative counters.

How a limit holds over N processes: over the last ``window_s`` the processes used ``U`` of a limit ``L``;
what is left (``L - U``) is split into whole shares by each process's recent demand (plus a little for
every process, so a key's first request on a quiet process is not refused), and each process may admit
until its counter reaches ``counter now + share``.  The shares sum to what is left, so the admitted
requests over every process stay within the limit whatever the timing (the tolerance is 0 requests for
rpm; tokens are known only when a request ends, so tpm and budgets can be passed by the tokens of the
requests in flight when the cap is reached).  The cost of exactness is the other way: a process whose
share is used up refuses (``Retry-After: 1``) while another's share is idle, until the next table (every
report, 0.5 s) moves the share to where the demand is.  Concurrency is split the same way over what the
processes have in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping

from ..contract import RATE_WINDOW_S, Allowance, GatewayReport, ProcessAllowances

WINDOW_S = RATE_WINDOW_S   # rpm and tpm are per minute
DEMAND_S = 2.0      # demand is what the processes were asked over the last this long


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_tokens: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    t: float
    requests: int = 0
    tokens: int = 0
    demand: int = 0
    inflight: int = 0


ZERO = Sample(float("-inf"))
History = Mapping[tuple[int, str], Mapping[str, "deque[Sample]"]]   # (process, incarnation) -> key -> samples


class QuotaBook:
    """The samples :func:`allocate` needs: per process incarnation and key, the last window and a bit."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.history: dict[tuple[int, str], dict[str, deque[Sample]]] = {}
        self.live: dict[int, str] = {}   # process -> its incarnation now
        self.first: dict[int, str] = {}  # process -> the incarnation it first reported with (a later one: restarted)

    def observe(self, now: float, reports: Iterable[GatewayReport], departed: Iterable[GatewayReport] = ()) -> None:
        """``reports``: the live processes'; ``departed``: the last reports of processes that ended since the
        previous call (what they admitted after their last live report still counts in the window)."""
        self.live = {}
        reports = list(reports)
        live_ids = {id(r) for r in reports}
        for r in [*departed, *reports]:
            live = id(r) in live_ids
            self.first.setdefault(r.process, r.incarnation)   # (one seen only as it departed was there too)
            if live:
                self.live[r.process] = r.incarnation
            keys = self.history.setdefault((r.process, r.incarnation), {})
            for name in [k for k in keys if live and k not in r.tenants]:
                # a live process that no longer reports a key forgot it (a reload removed it, its last request
                # a minute gone): added back, it counts from 0 again, and its old counters must not be its base
                del keys[name]
            for name, u in r.tenants.items():
                samples = keys.get(name)
                if samples is None:
                    samples = keys[name] = deque()
                s = Sample(now, u.requests, u.tokens, u.demand, u.inflight)
                if samples and (samples[-1].requests, samples[-1].tokens, samples[-1].demand,
                                samples[-1].inflight) == (s.requests, s.tokens, s.demand, s.inflight):
                    continue   # nothing new: the older sample says the same
                samples.append(s)
        horizon = now - self.window_s
        for inc in list(self.history):
            keys = self.history[inc]
            for name in list(keys):
                samples = keys[name]
                while len(samples) > 1 and samples[1].t <= horizon:
                    samples.popleft()   # keep one sample at or before the window's start: the baseline
                if inc[1] != self.live.get(inc[0]) and samples[-1].t <= horizon:
                    del keys[name]      # a process gone for a whole window counts no more
            if not keys and inc[1] != self.live.get(inc[0]):
                del self.history[inc]


def _used(samples: deque[Sample], base: Sample) -> tuple[int, int]:
    """Requests and tokens counted after ``base``: the counters' rises, so a key whose counters started again
    (removed by one reload, added back by another) adds what it did since, never a negative use."""
    req = tok = 0
    prev = base
    for s in samples:
        if s.t <= base.t:
            continue
        req += s.requests - prev.requests if s.requests >= prev.requests else s.requests
        tok += s.tokens - prev.tokens if s.tokens >= prev.tokens else s.tokens
        prev = s
    return req, tok


def _at(samples: deque[Sample], t: float) -> Sample:
    """The last sample at or before ``t`` (counters start at zero before the first)."""
    best = ZERO
    for s in samples:
        if s.t > t:
            break
        best = s
    return best


def split(amount: int, weights: Mapping[int, float]) -> dict[int, int]:
    """``amount`` in whole shares proportional to ``weights`` (largest remainder; the shares sum to it)."""
    total = sum(weights.values())
    if amount <= 0 or not weights:
        return {p: 0 for p in weights}
    raw = {p: amount * w / total for p, w in weights.items()}
    out = {p: int(x) for p, x in raw.items()}
    rest = amount - sum(out.values())
    for p in sorted(raw, key=lambda p: (out[p] - raw[p], p))[:rest]:
        out[p] += 1
    return out


def _grant(left: int | None, weights: Mapping[int, float], held: Mapping[int, int]) -> dict[int, int]:
    """New shares of ``left`` (what a limit has left) that never promise more than it, though a process may
    still act on an older, larger allowance until it has seen the new one: ``held`` is what each process
    may still take under the allowances it may be acting on.  Each gets the smaller of its demand share
    and what it holds, plus its part of what nobody holds."""
    if left is None:
        return {}
    want = split(left, weights)
    keep = {p: min(want[p], held[p]) for p in weights}
    room = left - sum(held.values())
    short = {p: want[p] - keep[p] for p in weights if want[p] > keep[p]}
    extra = split(min(room, sum(short.values())), short) if short and room > 0 else {}
    return {p: keep[p] + extra.get(p, 0) for p in weights}


def allocate(now: float, limits: Mapping[str, Limits], history: History, live: Mapping[int, str],
             budget_used: Mapping[str, int] | None = None, budget_reset_s: Mapping[str, float] | None = None,
             in_effect: Mapping[int, list[Mapping[str, Allowance]]] | None = None,
             window_s: float = WINDOW_S, demand_s: float = DEMAND_S, expected: int = 0,
             first: Mapping[int, str] | None = None) -> dict[int, ProcessAllowances]:
    """Every live process's allowance per limited key (pure: same facts, same allowances).

    ``in_effect``: per live process, the allowances it may be acting on now (the one of the newest table it
    has reported routing on, and those published since); a process with none acts on the even split
    (``limit // expected``), as the gateway does before its first allowance.  ``expected``: the gateway
    processes configured (``gateway.workers``); those not reporting yet at the start admit their even split with
    nobody counting it, so it is held back from what the others are given.  ``first``: the incarnation each
    process first reported with: one that did and is gone, or reports with another (started again after it
    died), admits nothing before its first allowance (the gateway's ``restarted``), so nothing is held for it."""
    budget_used, budget_reset_s = budget_used or {}, budget_reset_s or {}
    in_effect, first = in_effect or {}, first or {}
    start = now - window_s
    n = max(1, expected or len(live))
    absent = max(0, expected - len(live) - sum(p not in live for p in first))
    restarted = {p for p, inc in live.items() if first.get(p, inc) != inc}
    per_process: dict[int, dict[str, Allowance]] = {p: {} for p in live}
    for key, lim in limits.items():
        used_req = used_tok = 0
        req_reset = tok_reset = window_s + 1   # (more than a window: it holds none; a use now leaves in a window)
        cur: dict[int, Sample] = {p: Sample(now) for p in live}
        demand: dict[int, float] = {p: 0.0 for p in live}
        inflight = 0
        for (process, inc), keys in history.items():
            samples = keys.get(key)
            if not samples:
                continue
            last, base = samples[-1], _at(samples, start)
            req, tok = _used(samples, base)
            used_req += req
            used_tok += tok
            # the oldest counted use leaves the window first
            first_req = next((s.t for s in samples if s.t > start and s.requests > base.requests), None)
            first_tok = next((s.t for s in samples if s.t > start and s.tokens > base.tokens), None)
            if first_req is not None:
                req_reset = min(req_reset, first_req + window_s - now)
            if first_tok is not None:
                tok_reset = min(tok_reset, first_tok + window_s - now)
            if live.get(process) == inc:
                cur[process] = last
                demand[process] = max(0, last.demand - _at(samples, now - demand_s).demand)
                inflight += last.inflight
        total_demand = sum(demand.values())
        floor = max(1.0, 0.05 * total_demand)
        weights = {p: d + floor for p, d in demand.items()}
        req_left = None if lim.rpm is None else max(0, lim.rpm - used_req - absent * (lim.rpm // n))
        tok_left = None if lim.tpm is None else max(0, lim.tpm - used_tok - absent * (lim.tpm // n))
        exhausted = by_budget = False
        if lim.budget_tokens is not None:
            b_left = max(0, lim.budget_tokens - budget_used.get(key, 0))
            exhausted = b_left <= 0
            if tok_left is None or b_left < tok_left:
                tok_left, by_budget = b_left, True
            if exhausted:
                tok_reset = budget_reset_s.get(key, tok_reset)
        conc_left = None if lim.max_concurrent is None else max(
            0, lim.max_concurrent - inflight - absent * (lim.max_concurrent // n))
        held_req, held_tok, held_conc = {}, {}, {}
        for p in live:
            acting = [a[key] for a in in_effect.get(p, ()) if key in a]
            c = cur[p]
            if acting:
                held_req[p] = max(((a.requests_upto or 0) - c.requests for a in acting), default=0)
                held_tok[p] = max(((a.tokens_upto or 0) - c.tokens for a in acting), default=0)
                held_conc[p] = max(((a.concurrent or 0) - c.inflight for a in acting), default=0)
            elif p not in restarted:   # the gateway's even split before its first allowance
                held_req[p] = (lim.rpm or 0) // n - c.requests
                held_tok[p] = (lim.tpm or 0) // n - c.tokens
                held_conc[p] = (lim.max_concurrent or 0) // n - c.inflight
            else:   # (started again: nothing before its first allowance)
                held_req[p] = held_tok[p] = held_conc[p] = 0
            held_req[p], held_tok[p], held_conc[p] = max(0, held_req[p]), max(0, held_tok[p]), max(0, held_conc[p])
        shares_req = _grant(req_left, weights, held_req)
        shares_tok = _grant(tok_left, weights, held_tok)
        shares_conc = _grant(conc_left, weights, held_conc)
        for p in live:
            c = cur[p]
            per_process[p][key] = Allowance(
                requests_upto=None if req_left is None else c.requests + shares_req[p],
                tokens_upto=None if tok_left is None else c.tokens + shares_tok[p],
                concurrent=None if conc_left is None else c.inflight + shares_conc[p],
                # whole seconds: an idle key's allowance stays the same table after table
                requests_left=req_left, tokens_left=tok_left, requests_reset_s=float(max(0, math.ceil(req_reset))),
                tokens_reset_s=float(max(0, math.ceil(tok_reset))), budget_exhausted=exhausted,
                tokens_by_budget=by_budget, requests_seen=c.requests, tokens_seen=c.tokens,
                limits=(lim.rpm, lim.tpm, lim.max_concurrent, lim.budget_tokens))
    return {p: ProcessAllowances(inc, per_process[p]) for p, inc in live.items()}
