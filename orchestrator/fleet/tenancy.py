"""The fleet's tenancy loop: every report interval it reads every gateway process's per-key counters,
adds what is new to the durable usage ledger, and gives each process its share of every key's limits
(:func:`orchestrator.fleet.quota.allocate`) through the routing table.

Root task ``tenancy``; :meth:`Tenancy.close` runs once the gateway processes have stopped and sent their
last reports, so a SIGTERM loses no count.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping

from ..config import FleetConfig
from ..contract import Background, ProcessAllowances
from ..keys import ANONYMOUS, period_end, period_start
from ..statedir import StateDir
from ..timefmt import utc_iso
from .background import SPOOL_MARGIN_S, BackgroundBook
from .quota import Limits, QuotaBook, allocate
from .quotawindow import LAST_DAEMON, QuotaWindow
from .reports import ReportHub
from .usage import UsageLedger, hour_bucket
from .usagequery import KeyUsage, key_usage

log = logging.getLogger("slurmfleet.tenancy")
INTERVAL_S = 0.5
FLUSH_EVERY = 4   # ticks: the ledger is written every 2 s


class Tenancy:
    def __init__(self, cfg: FleetConfig, hub: ReportHub, ledger: UsageLedger,
                 publish: Callable[..., int],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.hub, self.ledger, self.publish, self.clock, self.wall = hub, ledger, publish, clock, wall
        self.book = QuotaBook()
        self.issued: dict[int, Mapping[int, ProcessAllowances]] = {}   # table version -> the allowances it carries
        # ("key", name) or ("group", name) -> its budget, what its period used, the period's end (for /metrics)
        self.budgets: dict[tuple[str, str], tuple[int, int, float]] = {}
        self.ticks = 0
        self.spools = None   # the spool's listing out in the ledger's thread
        self.spool = StateDir(cfg.state_dir).usage_spool   # (the state dir cannot change on reload)
        # background responses not charged yet, over every process and across daemons (written with the ledger)
        self.background = BackgroundBook(cfg.gateway.shutdown_grace_s + SPOOL_MARGIN_S, self.spool, clock)
        ledger.attach(self.background)
        self.set_config(cfg)
        # the rpm and tpm windows: what each key used in the last minute, for the next daemon too
        ledger.attach(QuotaWindow(self.book, lambda: self.limits, clock, wall))

    def set_config(self, cfg: FleetConfig) -> None:
        keys = cfg.gateway.keys()
        self.groups = {k.name: k.group for k in keys}
        # what the ledger books usage under: a key a reload removed keeps its last group (its requests still in
        # flight end after the reload, and a batch of its own may be charged later)
        self.ledger_groups = {**getattr(self, "ledger_groups", {}), **self.groups}
        self.group_policies = dict(cfg.gateway.groups)   # group -> its shared budget
        self.members_read = self._booked_members()
        names = {n: m.name for m in cfg.models for n in m.served_names}   # a key may name a model by an alias
        self.models = {k.name: None if k.models is None else {names.get(n, n) for n in k.models} for k in keys}
        self.workers = cfg.gateway.workers   # (a reload cannot change it: a restart only)
        self.open = cfg.gateway.open   # no keys asked: every client is the open gateway's anonymous tenant
        self.periods = {k.name: k.budget_period for k in keys if k.budget_tokens is not None}
        self.expires = {k.name: k.expires_at.timestamp() for k in keys if k.expires_at is not None}   # (epoch s)
        self.limits = {k.name: Limits(k.rpm, k.tpm, k.max_concurrent, k.budget_tokens) for k in keys
                       if any(x is not None for x in (k.rpm, k.tpm, k.max_concurrent, k.budget_tokens))}

    def _booked_members(self) -> bool:
        """A group's keys, as the ledger books them: a key a reload removed (or renamed) still counts toward its
        group's budget for the rest of the period, after a restart too (the keys the ledger booked under the group
        in its period are read); False when the ledger could not be read (the tick tries again)."""
        wall, read = self.wall(), True
        starts = {g: period_start(p.budget_period, wall) for g, p in self.group_policies.items()}
        since = {g: hour_bucket(t) for g, t in starts.items()}
        if since and (booked := self.ledger.booked_groups(min(starts.values()))) is not None:
            for g, key, hour in booked:
                if g in since and hour >= since[g]:
                    self.ledger_groups.setdefault(key, g)
        elif since:
            read = False
        self.members = {g: [k for k, kg in self.ledger_groups.items() if kg == g] for g in self.group_policies}
        return read

    def owner_refusal(self, key: str, model: str) -> str | None:
        """Why work ``key`` started (a batch) may not go on with ``model`` now, as the gateway refuses it: the
        key is gone (a reload revoked it), has expired, or may no longer use the model.  None: it may (or no key
        owns it: an open gateway's)."""
        if not key or (key == ANONYMOUS and self.open):
            return None
        if key not in self.models:
            return f"the key `{key}` no longer exists"
        if (end := self.expires.get(key)) is not None and self.wall() >= end:
            return f"the key `{key}` expired at {utc_iso(end)}"
        allowed = self.models[key]
        if allowed is not None and model not in allowed:
            return f"the key `{key}` may no longer use the model `{model}`"
        return None

    def budget_left(self, key: str) -> tuple[int, float] | None:
        """``key``'s token budget: (tokens left in this period, by the ledger; the period's end, epoch
        seconds), or None when it has none; with its group's shared budget too, the one with fewer left."""
        lim = self.limits.get(key)
        wall = self.wall()
        own = None if lim is None or lim.budget_tokens is None else (
            lim.budget_tokens - self.ledger.period_tokens(key, period_start(self.periods[key], wall)),
            period_end(self.periods[key], wall))
        group = self.groups.get(key)
        if group not in self.group_policies:
            return own
        budget, used, end = self._group_budget(group, wall)
        return min(own, (budget - used, end)) if own is not None else (budget - used, end)

    def _group_budget(self, group: str, wall: float) -> tuple[int, int, float]:
        """A group's budget, what its keys used in its period (by the ledger), the period's end."""
        g = self.group_policies[group]
        since = period_start(g.budget_period, wall)
        return (g.budget_tokens, sum(self.ledger.period_tokens(k, since) for k in self.members[group]),
                period_end(g.budget_period, wall))

    def key_usage(self, reports) -> KeyUsage:
        """The per-key series of ``/metrics`` (``reports``: the live gateway processes')."""
        return key_usage(self.ledger, reports, self.groups, self.budgets, self.background.by_key())

    def tick(self) -> None:
        """Observe every report once, then hand out the allowances."""
        reports, departed = self.hub.reports(), self.hub.departed()
        if not self.members_read:
            self.members_read = self._booked_members()
        for r in departed:   # (their process ended: the spool it wrote as it did is booked as the ledger closes)
            self.ledger.observe(r, self.ledger_groups, last=True)
        for r in reports:
            self.ledger.observe(r, self.ledger_groups)
        now = self.clock()
        self.book.observe(now, reports, departed)
        self.background.observe(reports, departed, now)
        adopt = self.background.adopt(r.process for r in reports)
        wall = self.wall()
        groups = {g: self._group_budget(g, wall) for g in self.group_policies}
        groups_spent = {g: float(math.ceil(end)) for g, (budget, used, end) in groups.items() if used >= budget}
        self.budgets = {("group", g): v for g, v in groups.items()}
        if not self.limits:
            self.background.published(self.publish({}, {}, groups_spent, adopt, False))
            return
        used, ends = {}, {}
        for key, period in self.periods.items():
            used[key] = self.ledger.period_tokens(key, period_start(period, wall))
            ends[key] = period_end(period, wall)
        reset = {key: end - wall for key, end in ends.items()}
        self.budgets.update({("key", key): (self.limits[key].budget_tokens, used[key], ends[key]) for key in used})
        acting = self._acting(reports)
        allowances = allocate(now, self.limits, self.book.history, self.book.live, used, reset, acting,
                              expected=self.workers, first=self.book.first)
        spent = {key: float(math.ceil(end)) for key, end in ends.items() if used[key] >= self.limits[key].budget_tokens}
        version = self.publish(allowances, spent, groups_spent, adopt, LAST_DAEMON in self.book.history)
        self.issued[version] = allowances
        self.background.published(version)

    def _acting(self, reports) -> dict[int, list]:
        """Per process, the allowances it may be acting on: those of the newest table it reported routing
        on (or the last issued before it) and of every table published since."""
        out: dict[int, list] = {}
        oldest = None
        for r in reports:
            acked = max((v for v in self.issued if v <= r.table_version), default=None)
            lo = acked if acked is not None else r.table_version + 1
            oldest = lo if oldest is None else min(oldest, lo)
            out[r.process] = [a[r.process].keys for v, a in self.issued.items()
                              if v >= lo and r.process in a and a[r.process].incarnation == r.incarnation]
        for v in [v for v in self.issued if oldest is None or v < oldest]:
            del self.issued[v]
        return out

    async def run(self) -> None:
        while True:
            self.turn()
            await asyncio.sleep(INTERVAL_S)

    def turn(self) -> None:
        """A tick (every ``FLUSH_EVERY``-th with a flush).  The daemon takes one before its gateway starts: the
        first table tells the gateway's processes which keys' budgets are spent before they admit one."""
        try:
            self.tick()
            self.ticks += 1
            if self.ticks % FLUSH_EVERY == 0:   # (both in the ledger's thread: a state dir may stall, or hang)
                self.book_spool_soon()
                self.ledger.flush_soon()   # a few rows in one transaction: milliseconds
        except Exception:  # one bad tick (a full disk) must not stop the daemon: the next one retries
            log.exception("tenancy tick failed")

    def book_spool(self) -> None:
        """Book the usage spooled by gateway workers whose daemon died (they finish their requests after it,
        for up to ``gateway.shutdown_grace_s``: looked for at every flush), each file once, then remove it."""
        try:
            files = sorted(self.spool.glob("*.json"))
        except OSError:
            return
        self._book(files)

    def book_spool_soon(self) -> None:
        """:meth:`book_spool`, the spool looked for in the ledger's thread (what it found is booked at the next
        flush: on the loop, after a killed daemon only); not while the last look is out."""
        out, self.spools = self.spools, None
        if out is not None and not out.done():
            self.spools = out
            return
        if out is not None and out.exception() is None and out.result():
            if not self.ledger.idle():   # (its booking writes the ledger on the loop: not beside a write out)
                self.spools = out
                return
            self._book(out.result())
        self.spools = self.ledger.io.run(lambda: sorted(self.spool.glob("*.json")))

    def _book(self, files) -> None:
        if files and not self.background.loaded:
            return   # (the responses a spool settles are the last daemon's rows: read first)
        for f in files:
            try:
                doc = json.loads(f.read_text())
                tenants = {str(k): {str(m): tuple(int(x) for x in c) for m, c in v.items()}
                           for k, v in doc["tenants"].items()}
                inc, at = str(doc["incarnation"]), doc.get("at")   # (at: when it was spooled; older spools have none)
                background = [Background(str(b[0]), str(b[1]), str(b[2]), str(b[3]), int(b[4]))
                              for b in doc.get("background", ())]   # (followed still: not charged)
                charged = [str(rid) for rid in doc.get("charged", ())]   # (background responses it charged)
                at = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.error("unreadable usage spool %s (%s): moved to %s.bad", f, exc, f.name)
                with contextlib.suppress(OSError):
                    f.rename(f.with_name(f.name + ".bad"))
                continue
            booked: list[bool] = []

            def rows(db, inc=inc, background=background, charged=charged) -> None:
                """The background responses the spool settles, written with its counters (one transaction)."""
                self.background.spooled(inc, background, charged)
                if self.background.loaded:   # (not over what the last daemon left before it was read)
                    self.background.write(db)
                    booked.append(True)
            if not self.ledger.ingest(inc, tenants, self.ledger_groups, at, also=rows):
                return   # the ledger cannot be written now: the next flush tries again
            if booked:
                self.background.written()
            log.info("booked the usage a gateway worker spooled after its daemon died (%s)", f.name)
            f.unlink(missing_ok=True)

    def close(self) -> None:
        """The gateway has stopped: take its last reports and write everything down."""
        try:
            self.settle()
        finally:
            self.ledger.flush()

    def settle(self) -> None:
        """The gateway has stopped: take its last reports, in memory (the ledger's next flush writes them; the
        daemon's last one runs off the event loop: :mod:`.lastwrite`)."""
        self.tick()
        self.background.close()
