"""Who is asking, and may they: the gateway's side of named API keys (tenants).

A request's key resolves to a :class:`Tenant` (one dict lookup by the key's SHA-256; with no keys
configured every request is the open gateway's ``anonymous`` tenant).  :meth:`Tenants.admit` checks the
models the key may use and its limits, then counts the request; :meth:`Tenant.finish` counts its tokens
(from the replica's ``usage``) and ends it.

Limits hold over every gateway process: the fleet sums each process's counters
(:class:`~orchestrator.contract.TenantUsage` in its report) and hands each process, in the routing
table, caps on its own cumulative counters (:class:`~orchestrator.contract.Allowance`, a demand-weighted
share of what is left of each limit).  A process that has no allowance yet (it just started) uses an
even split: ``limit // gateway.workers``; one started again after its process died (``restarted``) none (the
others may have spent the window meanwhile): it refuses a limited key, ``Retry-After: 1``, until its first
allowance, one report (about half a second) later.  Refusals are OpenAI's: 429 ``rate_limit_exceeded`` (rpm, tpm,
concurrency) or ``insufficient_quota`` (the period's token budget), with ``Retry-After`` and the
``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable, Mapping

from aiohttp import web

from ..auth import key_digest
from ..config import GatewayConfig
from ..contract import RATE_WINDOW_S, Allowance, RoutingTable, TenantUsage
from ..errors import error_response
from ..keys import ANONYMOUS, BATCH_OWNER, BATCHES
from ..timefmt import utc_iso

RETIRED_KEEP_S = 60.0   # a key a reload removed is still reported this long after its last request ended

def _reset(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``1h2m3s``."""
    s = max(0, math.ceil(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


class Tenant:
    """One key's policy and this process's counters for it."""

    __slots__ = ("name", "digest", "group", "models", "rank", "rpm", "tpm", "max_concurrent", "budget",
                 "period", "limited", "limits", "requests", "tokens", "demand", "inflight", "rejected", "usage",
                 "allow", "allow_at", "since", "expires")

    def __init__(self, name: str, digest: str, rank: int, group: str | None = None,
                 models: frozenset[str] | None = None, rpm: int | None = None, tpm: int | None = None,
                 max_concurrent: int | None = None, budget: int | None = None, period: str = "day",
                 expires: float | None = None):
        self.name = name
        self.configure(digest, rank, group, models, rpm, tpm, max_concurrent, budget, period, expires)
        self.requests = self.tokens = self.demand = self.inflight = 0
        self.rejected: dict[str, int] = {}
        self.usage: dict[str, list[int]] = {}   # model -> [requests, prompt tokens, completion tokens]
        self.allow: Allowance | None = None
        self.allow_at = 0.0   # when the allowance came (its reset times count from then)
        self.since: float | None = None   # when the first request the allowance's counters miss was admitted

    def configure(self, digest: str, rank: int, group: str | None = None, models: frozenset[str] | None = None,
                  rpm: int | None = None, tpm: int | None = None, max_concurrent: int | None = None,
                  budget: int | None = None, period: str = "day", expires: float | None = None) -> "Tenant":
        """Set the key's policy; a reload calls it on the same object, so the requests in flight, which hold
        it, end on the counters the key goes on with (a copy would keep their concurrency for ever)."""
        self.digest, self.rank, self.group, self.models = digest, rank, group, models
        self.rpm, self.tpm, self.max_concurrent, self.budget, self.period = rpm, tpm, max_concurrent, budget, period
        self.limited = any(x is not None for x in (rpm, tpm, max_concurrent, budget))
        self.limits = (rpm, tpm, max_concurrent, budget)
        self.expires = expires   # epoch seconds (None: never)
        return self

    def expired(self, wall: float) -> str | None:
        """Since when the key no longer works, as ISO 8601 UTC (None: it works at ``wall``)."""
        if self.expires is None or wall < self.expires:
            return None
        return utc_iso(self.expires)

    def stale(self, a: Allowance | None) -> bool:
        """Whether ``a`` was computed for other limits than the key has now (a reload changed them; the table
        with the new ones is about half a second away): its cap holds, its wait does not."""
        return a is not None and a.limits is not None and a.limits != self.limits

    def finish(self, model: str, prompt: int, completion: int, answered: bool = True) -> None:
        """The request ended (whatever its outcome): count its tokens, free its concurrency.  Usage counts
        requests a replica answered, not those the gateway refused itself (queue full, no replica)."""
        self.inflight -= 1
        if not answered:
            return
        self.charge(model, prompt, completion)
        self.tokens += prompt + completion

    def charge(self, model: str, prompt: int, completion: int) -> None:
        """Count an answered request in the key's usage (the ledger, and its budget)."""
        u = self._row(model)
        u[0] += 1
        u[1] += prompt
        u[2] += completion

    def charge_prompt(self, model: str, tokens: int, completion: int = 0) -> None:
        """A request's prompt tokens, counted after it ended (its client left before the usage came; or a
        background response's, with its ``completion`` tokens, once it ended)."""
        u = self._row(model)
        u[1] += tokens
        u[2] += completion
        self.tokens += tokens + completion

    def _row(self, model: str) -> list[int]:
        u = self.usage.get(model)
        if u is None:
            u = self.usage[model] = [0, 0, 0]
        return u

    @property
    def budget_spent(self) -> str:
        """What a refusal for the spent token budget says."""
        return f"Key `{self.name}` has used its token budget for this {self.period} ({self.budget} tokens)."

    def snapshot(self) -> TenantUsage:
        return TenantUsage(self.requests, self.tokens, self.demand, self.inflight, dict(self.rejected),
                           {m: (u[0], u[1], u[2]) for m, u in self.usage.items()})


def _retry_after(headers: dict[str, str], retry_s: float, etype: str) -> dict[str, str]:
    """``headers`` with a refusal's ``Retry-After``; a spent budget's also with ``x-should-retry: false`` (the
    openai SDK waits at most 60 s of a Retry-After, then retries), but for one a reload has just changed (1 s)."""
    headers["Retry-After"] = str(max(1, math.ceil(retry_s)))
    if etype == "insufficient_quota" and retry_s > 1:
        headers["x-should-retry"] = "false"
    return headers


OPENAI_TYPE = {"rpm": "requests", "tpm": "tokens"}   # a refusal's reason -> OpenAI's error type for it


def _next_free(reset_s: float, age: float, since: float | None) -> float:
    """Seconds until a window frees what it counts: its oldest use in the fleet's count (``reset_s`` when the
    allowance came, ``age`` ago; more than ``RATE_WINDOW_S`` when it held none) or the first this process counted
    since (``since`` ago), whichever leaves first."""
    oldest = math.inf if reset_s > RATE_WINDOW_S else reset_s - age
    left = oldest if since is None else min(oldest, RATE_WINDOW_S - since)
    return 0.0 if left == math.inf else left


def _share(limit: int, n: int) -> int:
    """A process's even split of ``limit`` over ``n`` processes (0: none)."""
    return limit // n if n else 0


class Tenants:
    """Every configured key of this gateway process."""

    def __init__(self, cfg: GatewayConfig, process: int, incarnation: str, names: Mapping[str, str],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.process, self.incarnation, self.clock, self.wall = process, incarnation, clock, wall
        self.by_digest: dict[str, Tenant] = {}
        self.by_name: dict[str, Tenant] = {}
        # keys a reload removed (or renamed), with counts: their requests still running finish on them, and
        # they stay in the reports until RETIRED_KEEP_S after the last one ended, so the ledger gets every count
        self.retired: dict[str, Tenant] = {}
        self._idle_since: dict[str, float] = {}
        self.spent: Mapping[str, float] = {}   # the table's keys whose budget is spent (-> the period's end, epoch s)
        self.groups_spent: Mapping[str, float] = {}   # ... and groups (gateway.groups)
        self.restarted = False   # this process was started again: no even split before its first allowance
        self.carried = False     # ... nor while the table says the windows hold a previous daemon's use
        self.set_config(cfg, names)

    def set_config(self, cfg: GatewayConfig, names: Mapping[str, str]) -> None:
        """Build the keys anew (``names``: served name or alias -> model); a key whose name stays keeps
        its counters, so a reload drops no request and resets no limit; one that goes is retired (its
        requests in flight and their tokens are still reported), and one that comes back takes its counters back."""
        self.workers = cfg.workers
        classes = {c: i for i, c in enumerate(cfg.priority_classes)}
        default = classes[cfg.default_priority]
        old, by_digest, by_name = {**self.retired, **self.by_name}, {}, {}
        self.policies = {k.name: k for k in cfg.keys()}   # (what else a key's entry says: its file storage limits)
        self.groups = dict(cfg.groups)   # group -> its shared budget
        for k in self.policies.values():
            models = None if k.models is None else frozenset(names.get(n, n) for n in k.models)
            policy = (k.digest, classes.get(k.priority, default) if k.priority else default, k.group, models,
                      k.rpm, k.tpm, k.max_concurrent, k.budget_tokens, k.budget_period,
                      k.expires_at.timestamp() if k.expires_at is not None else None)
            t = old[k.name].configure(*policy) if k.name in old else Tenant(k.name, *policy)
            t.limited = t.limited or k.group in self.groups   # (its group's budget is checked as its own)
            by_digest[k.digest] = by_name[k.name] = t
        if cfg._batch_key:   # the fleet's batch runner: below every class, no limits
            policy = (key_digest(cfg._batch_key), len(cfg.priority_classes))
            t = old[BATCHES].configure(*policy) if BATCHES in old else Tenant(BATCHES, *policy)
            by_digest[t.digest] = by_name[BATCHES] = t
        self.anonymous: Tenant | None = None
        if cfg.open:   # an open gateway: every client is the one anonymous tenant
            t = self.anonymous = old[ANONYMOUS].configure("", default) if ANONYMOUS in old else \
                Tenant(ANONYMOUS, "", default)
            by_name[ANONYMOUS] = t
        self.by_digest, self.by_name = by_digest, by_name
        self.retired = {n: t for n, t in old.items()
                        if n not in by_name and (t.demand or t.requests or t.usage or t.inflight)}
        for n in [n for n in self._idle_since if n not in self.retired]:
            del self._idle_since[n]

    def batch_owner(self, t: Tenant, headers: Mapping[str, str], model: str) -> tuple[Tenant | None, web.Response | None]:
        """The key a batch line is for, when the batch runner (and only it) sends one, named in ``BATCH_OWNER``,
        and why the line may not run for it now: the key is gone (a reload revoked it: 401), may no longer use
        the model (404), or has spent its token budget for the period (429 ``insufficient_quota``: the runner
        tries again later, so the batch waits for the next period or its expiry)."""
        if t.name != BATCHES:
            return None, None
        name = headers.get(BATCH_OWNER)
        if not name:
            return None, None
        owner = self.by_name.get(name)
        if owner is None or owner.name == BATCHES:
            return None, error_response(401, f"The batch's key `{name}` no longer exists.", "invalid_request_error",
                                        "invalid_api_key")
        if (when := owner.expired(self.wall())) is not None:
            return None, error_response(401, f"The batch's key `{name}` expired at {when}.", "invalid_request_error",
                                        "invalid_api_key")
        if owner.models is not None and model not in owner.models:
            return None, error_response(404, f"Key `{name}` may no longer use the model `{model}`.",
                                        "invalid_request_error", "model_not_found")
        spent = self.budget_refusal(owner)
        if spent is not None:
            return None, spent
        return owner, None

    def budget_refusal(self, t: Tenant) -> web.Response | None:
        """The 429 ``insufficient_quota`` (with the seconds to the period's end) of a key whose token budget
        is spent, or None."""
        retry_s, msg = self._spent(t), t.budget_spent
        if retry_s is None and (group := self._group_spent(t)) is not None:
            msg, retry_s = group
        if retry_s is None:
            return None
        return error_response(429, msg, "insufficient_quota", "insufficient_quota",
                              _retry_after({}, retry_s, "insufficient_quota"))

    def identify(self, headers: Mapping[str, str]) -> Tenant | None:
        """The request's tenant, or None for a missing, unknown or expired key (:meth:`refusal` says which)."""
        if self.anonymous is not None and not self.by_digest:
            return self.anonymous
        t = self._known(headers)
        if t is not None and t.expires is not None and t.expired(self.wall()) is not None:
            return None
        return t if t is not None else self.anonymous   # an open gateway knows only the batch runner's key

    def _known(self, headers: Mapping[str, str]) -> Tenant | None:
        auth = headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if not token:
            return None
        d = key_digest(token)
        t = self.by_digest.get(d)
        return t if t is not None and hmac.compare_digest(d, t.digest) else None

    def refusal(self, headers: Mapping[str, str]) -> web.Response:
        """The 401 of a request :meth:`identify` took no key of: an expired key's says so, and since when."""
        t = self._known(headers)
        when = t.expired(self.wall()) if t is not None else None
        return error_response(401, f"The API key `{t.name}` expired at {when}." if when else
                              "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")

    def apply(self, table: RoutingTable) -> None:
        """This process's allowances from a new routing table (those of another incarnation are ignored)."""
        self.spent, self.groups_spent = table.budgets_spent, table.groups_spent
        self.carried = table.limits_carried   # (a minute partly spent under the last daemon: no even split of it)
        if not table.allowances:   # no limit left (a reload took the last): no allowance holds any more
            for t in self.by_name.values():
                t.allow = None
        mine = table.allowances.get(self.process)
        if mine is None or mine.incarnation != self.incarnation:
            return
        now = self.clock()
        for name, t in self.by_name.items():   # (a key without one has no limit left: a reload took them away)
            allow = mine.keys.get(name)
            if allow != t.allow:   # (every table carries the allowances: one seen again is no new one)
                t.allow, t.allow_at = allow, now
                if allow is None or t.requests <= allow.requests_seen:   # (else the first of those it misses,
                    t.since = None                                      # or a little before it)

    def named(self, name: str) -> Tenant:
        """The key ``name``'s counters, to charge work it started (a background response taken over from another
        process): a key a reload removed gets retired counters, reported while in use and a while after."""
        t = self.by_name.get(name) or self.retired.get(name)
        if t is None:
            t = self.retired[name] = Tenant(name, "", 0)
        return t

    def report(self) -> dict[str, TenantUsage]:
        out = {name: t.snapshot() for name, t in self.by_name.items() if t.demand or t.requests or t.usage}
        now = self.clock()
        for name, t in list(self.retired.items()):
            if t.inflight:
                self._idle_since.pop(name, None)
            elif now - self._idle_since.setdefault(name, now) > RETIRED_KEEP_S:
                del self.retired[name], self._idle_since[name]
                continue
            out[name] = t.snapshot()
        return out

    # -- admission ----------------------------------------------------------------------------------------
    def admit(self, t: Tenant, model: str, body: dict, tokens: bool = True) -> web.Response | None:
        """None: admitted and counted (the caller must :meth:`Tenant.finish` it). Else the refusal.  ``tokens``
        False: a request that spends none (a stored response read or cancelled): a spent budget or tpm does not
        refuse it (a key out of budget can still stop its background response), rpm and concurrency do."""
        if t.models is not None and model not in t.models:
            return error_response(404, f"The model `{body.get('model') or model}` does not exist or you do not "
                                  "have access to it.", "invalid_request_error", "model_not_found")
        if t.limited:
            refusal = self._check(t, tokens)
            if refusal is not None:
                t.demand += 1
                t.rejected[refusal[0]] = t.rejected.get(refusal[0], 0) + 1
                reason, etype, msg, retry_s = refusal
                return error_response(429, msg, OPENAI_TYPE.get(reason, etype), etype,   # (OpenAI's type of an rpm
                                      _retry_after(self.headers(t), retry_s, etype))   # or tpm 429, its code ours)
            if t.since is None:
                t.since = self.clock()
        t.demand += 1
        t.requests += 1
        t.inflight += 1
        return None

    def _check(self, t: Tenant, tokens: bool = True) -> tuple[str, str, str, float] | None:
        a = t.allow
        age = self.clock() - t.allow_at
        n = 0 if self.restarted or self.carried else max(1, self.workers)   # (the even split, before an allowance)
        soon = a is None or t.stale(a)   # (no allowance yet, or one for the limits before a reload: one second)
        if tokens and (spent := self._spent(t)) is not None:
            return "budget", "insufficient_quota", t.budget_spent, spent
        if tokens and (group := self._group_spent(t)) is not None:
            return "budget", "insufficient_quota", *group
        if t.rpm is not None:
            cap = a.requests_upto if a is not None else _share(t.rpm, n)
            if cap is not None and t.requests >= cap:
                left = a is not None and (a.requests_left or 0) > 0
                return ("rpm", "rate_limit_exceeded",
                        f"Rate limit reached for key `{t.name}` on requests per minute: limit {t.rpm}.",
                        1.0 if left or soon else a.requests_reset_s - age)
        if tokens and (t.tpm is not None or t.budget is not None):
            cap = a.tokens_upto if a is not None else (_share(t.tpm, n) if t.tpm is not None else None)
            if cap is not None and t.tokens >= cap:
                left = a is not None and (a.tokens_left or 0) > 0
                minute = t.tpm is not None and not (a is not None and a.tokens_by_budget)   # (or the budget's share,
                return ("tpm" if minute else "budget", "rate_limit_exceeded",                # near its end)
                        f"Rate limit reached for key `{t.name}` on tokens per minute: limit {t.tpm}." if minute else
                        f"Key `{t.name}` is near its token budget for this {t.period} ({t.budget} tokens).",
                        1.0 if left or soon else a.tokens_reset_s - age)
        if t.max_concurrent is not None:
            cap = a.concurrent if a is not None else _share(t.max_concurrent, n)
            if cap is not None and t.inflight >= cap:
                return ("concurrency", "rate_limit_exceeded",
                        f"Key `{t.name}` has {t.max_concurrent} requests in flight, its limit.", 1.0)
        return None

    def _spent(self, t: Tenant) -> float | None:
        """Seconds to the end of the period whose token budget ``t`` has spent, or None: by this process's
        allowance, or before it has one (it just started) by the table's word for every process."""
        if t.budget is None:   # (an allowance from before a reload took the budget away says nothing)
            return None
        if t.allow is not None:
            if not t.allow.budget_exhausted:
                return None
            return 1.0 if t.stale(t.allow) else t.allow.tokens_reset_s - (self.clock() - t.allow_at)
        return self.spent[t.name] - self.wall() if t.name in self.spent else None

    def _group_spent(self, t: Tenant) -> tuple[str, float] | None:
        """What the refusal of a key whose group has spent its shared budget says, and the seconds to the
        period's end (by the table); None when it has not (or the key has no group with a budget)."""
        end = self.groups_spent.get(t.group) if t.group is not None else None
        g = self.groups.get(t.group) if end is not None else None
        if g is None or end <= self.wall():   # (a table from before a reload that took the group's budget away, or
            return None                       # from before its period ended, says nothing)
        return (f"Group `{t.group}` of key `{t.name}` has used its token budget for this {g.budget_period} "
                f"({g.budget_tokens} tokens).", end - self.wall())

    def headers(self, t: Tenant) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for a key with rpm or tpm limits (what is left over every
        process, as of the last allowance, less what this process admitted since)."""
        out: dict[str, str] = {}
        a = None if t.stale(t.allow) else t.allow   # (the old limits' allowance says nothing of the new ones)
        now = self.clock()
        age, since = now - t.allow_at, None if t.since is None else now - t.since
        if t.rpm is not None:
            out["x-ratelimit-limit-requests"] = str(t.rpm)
            if a is not None and a.requests_left is not None:
                out["x-ratelimit-remaining-requests"] = str(max(0, a.requests_left - (t.requests - a.requests_seen)))
                out["x-ratelimit-reset-requests"] = _reset(_next_free(a.requests_reset_s, age, since))
        if t.tpm is not None:
            out["x-ratelimit-limit-tokens"] = str(t.tpm)
            if a is not None and a.tokens_left is not None:
                out["x-ratelimit-remaining-tokens"] = str(max(0, a.tokens_left - (t.tokens - a.tokens_seen)))
                out["x-ratelimit-reset-tokens"] = _reset(a.tokens_reset_s - age if a.budget_exhausted else   # (tokens
                    _next_free(a.tokens_reset_s, age, 0.0 if t.tokens > a.tokens_seen else None))   # count as they end)
        return out
