"""Builds the routing table the fleet publishes: the reconciler's READY replicas and desired counts,
joined with the engine load scraped last and the gateway processes' shares of the keys' limits.  A new
table (with the next version) goes to the sink whenever any of them changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..contract import NO_LOAD, Background, EngineLoad, ModelRoutes, ProcessAllowances, RoutingSink, RoutingTable
from .reports import ReportHub


class TablePublisher:
    def __init__(self, sink: RoutingSink, hub: ReportHub):
        self.sink, self.hub = sink, hub
        self.routes: Mapping[str, ModelRoutes] = {}
        self.loads: Mapping[str, EngineLoad] = {}
        self.table = RoutingTable(0, {})
        self.allowances: Mapping[int, ProcessAllowances] = {}
        self.spent: Mapping[str, float] = {}
        self.groups_spent: Mapping[str, float] = {}
        self.adopt: Mapping[int, tuple[Background, ...]] = {}
        self.carried = False

    def on_allowances(self, allowances: Mapping[int, ProcessAllowances], spent: Mapping[str, float] | None = None,
                      groups_spent: Mapping[str, float] | None = None,
                      adopt: Mapping[int, tuple[Background, ...]] | None = None, carried: bool = False) -> int:
        """From the tenancy loop, every report interval: each gateway process's share of the keys' limits, the
        keys and groups whose budget is spent, the background responses each process is to take over, and whether
        the rate-limit windows hold a previous daemon's use (``carried``).
        Returns the version of the table that carries them."""
        self.allowances, self.spent, self.groups_spent = allowances, spent or {}, groups_spent or {}
        self.adopt, self.carried = adopt or {}, carried
        self._publish()
        return self.table.version

    def on_routes(self, routes: Mapping[str, ModelRoutes]) -> None:
        """From the reconciler, every tick: per model the desired count and the READY replicas."""
        self.routes = routes
        self._publish()

    def on_loads(self, loads: Mapping[str, EngineLoad]) -> None:
        """From the engine scraper: the latest load per job id."""
        self.loads = loads
        self._publish()

    def _publish(self) -> None:
        models = {name: dataclasses.replace(r, replicas=tuple(
            dataclasses.replace(x, load=self.loads.get(x.job_id, NO_LOAD)) for x in r.replicas))
            for name, r in self.routes.items()}
        if (models == dict(self.table.models) and self.allowances == self.table.allowances
                and self.spent == self.table.budgets_spent and self.groups_spent == self.table.groups_spent
                and self.adopt == self.table.adopt and self.carried == self.table.limits_carried):
            return
        self.table = RoutingTable(self.table.version + 1, models, allowances=self.allowances,
                                  budgets_spent=self.spent, groups_spent=self.groups_spent, adopt=self.adopt,
                                  limits_carried=self.carried)
        self.hub.published(self.table.version)
        self.sink.publish(self.table)
