"""The fleet's side of the gateway reports: every gateway process's latest report, summed in one place.

Drains ask it how many requests are still in flight on a job, ``/metrics`` sums the request
statistics, ``slurmfleet status`` shows the queues.  The in-process gateway is read when asked
(:meth:`ReportHub.attach`); worker processes push a report every half second
(:meth:`ReportHub.receive`).  A process that dies is retired: its counters stay in the sums (counters
never go down), its in-flight and queued numbers leave them.
"""

from __future__ import annotations

from collections.abc import Callable

from ..contract import GatewayReport, QueueState
from ..reqstats import GAUGES, RequestStats


class ReportHub:
    def __init__(self, on_urgent: Callable[[], None] = lambda: None) -> None:
        self.on_urgent = on_urgent   # a process holds a request for a model without a READY replica
        self.table_version = 0   # the newest routing table the fleet has published
        self._pushed: dict[int, GatewayReport] = {}
        self._pulled: dict[int, Callable[[], GatewayReport]] = {}
        self._retired = RequestStats()
        self._departed: list[GatewayReport] = []   # last reports of retired processes, until departed()

    def attach(self, process: int, report: Callable[[], GatewayReport]) -> None:
        """A gateway in this process: read its report whenever one is needed."""
        self._pulled[process] = report

    def receive(self, report: GatewayReport) -> None:
        if report.process not in self._pulled:  # an in-process gateway's reports are read, not kept
            self._pushed[report.process] = report
        if report.urgent:
            self.on_urgent()

    def retire(self, process: int) -> None:
        """The process is gone: keep its counters, drop its gauges.  The requests it held as of its last report
        (in flight, or queued for a replica) were cut with it: each counts as ended, code 502, slot "lost"."""
        last = self._pushed.pop(process, None)
        if last is None:
            return
        self._departed.append(last)
        lost: dict[str, int] = {m: q.depth for m, q in last.queued.items() if q.depth}
        for m, n in (last.stats or {}).get("inflight", ()):
            lost[m] = lost.get(m, 0) + n
        for m, n in lost.items():
            if n > 0:
                self._retired.bump("requests", n, m, "502", "lost")
        if last.stats:
            self._retired.add({**last.stats, **{name: [] for name, *_ in GAUGES}})

    def departed(self) -> list[GatewayReport]:
        """The last reports of processes retired since the last call (their final counters)."""
        out, self._departed = self._departed, []
        return out

    def published(self, version: int) -> None:
        self.table_version = version

    def reports(self) -> list[GatewayReport]:
        return [pull() for pull in self._pulled.values()] + list(self._pushed.values())

    def inflight(self, job_id: str) -> int:
        """Requests on this job over every gateway process; at least 1 while a process has not yet
        routed on the newest table (it might still send the job a request)."""
        return self.inflight_by_job().get(job_id, 0)

    def inflight_by_job(self) -> dict[str, int]:
        """:meth:`inflight` for every job at once (one read of each process's report); a job missing from
        the dict has none, unless a process lags (then ``.get`` gives every job at least 1)."""
        reports = self.reports()
        total: dict[str, int] = {}
        for r in reports:
            for jid, n in r.inflight.items():
                total[jid] = total.get(jid, 0) + n
        if any(r.table_version < self.table_version for r in reports):
            return _AtLeastOne(total)
        return total

    def queued(self) -> dict[str, QueueState]:
        """Per model: requests waiting for a replica over every process, and the oldest one's age."""
        out: dict[str, QueueState] = {}
        for r in self.reports():
            for model, q in r.queued.items():
                prev = out.get(model, QueueState())
                out[model] = QueueState(prev.depth + q.depth, max(prev.oldest_age_s, q.oldest_age_s))
        return out

    def requests_by_model(self) -> dict[str, int]:
        """Requests for each model the gateway processes alive now have ended (their counters only grow): the
        model's activity.  A request a key's limits or rights refused (slot "refused") asked nothing of the
        model; one that found no replica and no room to wait (slot "none") wanted it all the same."""
        out: dict[str, int] = {}
        for r in self.reports():
            for labels, n in r.stats.get("requests", ()):
                if labels[2] != "refused":
                    out[labels[0]] = out.get(labels[0], 0) + n
        return out

    def stats_snapshots(self) -> list[dict]:
        """What ``/metrics`` sums: every live process's statistics and those of processes that died."""
        return [dict(r.stats) for r in self.reports()] + [self._retired.snapshot()]


class _AtLeastOne(dict):
    """In-flight counts while a gateway process lags behind the newest table: every job counts at least 1."""

    def get(self, key, default=0):
        return max(1, super().get(key, default))
