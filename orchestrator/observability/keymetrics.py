"""The per-API-key series of ``/metrics``: what each key asked and was charged, its refusals, its requests in
flight and background responses, its budget (and its group's), read at scrape from the fleet's tenancy state."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..fleet.usage import REJECT_REASONS
from ..fleet.usagequery import KeyUsage


class KeyCollector:
    """Per API key (its configured name): requests and tokens answered by model, refusals by reason, requests in
    flight, background responses not charged yet; for a key or a group with a token budget, the budget, what its
    period used and when it ends.  Every key gets its refusal, in-flight and background series at zero; a (key,
    model) pair appears with its first answered request."""

    def __init__(self, source: Callable[[], KeyUsage | None]):
        self.source = source

    def describe(self):
        return []

    def collect(self):
        u = self.source()
        requests = CounterMetricFamily("slurmfleet_key_requests", "Requests answered per API key and model "
                                       "(since the daemon started).", labels=["key", "model"])
        tokens = CounterMetricFamily("slurmfleet_key_tokens", "Tokens per API key and model, by kind (prompt, "
                                     "completion), from the replicas' usage.", labels=["key", "model", "kind"])
        rejections = CounterMetricFamily("slurmfleet_key_rejections", "Requests refused by an API key's limits, "
                                         "by reason (rpm, tpm, concurrency, budget).", labels=["key", "reason"])
        inflight = GaugeMetricFamily("slurmfleet_key_inflight", "Requests of an API key in flight over every "
                                     "gateway process.", labels=["key"])
        background = GaugeMetricFamily("slurmfleet_key_background_responses", "Background responses (the Responses "
                                       "API's) of an API key not charged yet: followed to their end by a gateway "
                                       "process, or waiting to be taken over from one that is gone.", labels=["key"])
        who = {"key": "an API key with budget_tokens", "group": "a group of keys with a budget (gateway.groups)"}
        budget = {k: GaugeMetricFamily(f"slurmfleet_{k}_budget_tokens", f"The token budget (prompt + completion) per "
                                       f"budget period of {w}.", labels=[k]) for k, w in who.items()}
        used = {k: GaugeMetricFamily(f"slurmfleet_{k}_budget_used_tokens", f"Tokens used in its current budget period "
                                     f"(UTC) by {w}, by the usage ledger.", labels=[k]) for k, w in who.items()}
        reset = {k: GaugeMetricFamily(f"slurmfleet_{k}_budget_reset_timestamp_seconds", f"When the budget period of {w} "
                                      "ends and its budget is whole again (Unix time).", labels=[k]) for k, w in who.items()}
        if u is not None:
            for (key, model), (n, prompt, completion) in sorted(u.totals.items()):
                requests.add_metric([key, model], n)
                tokens.add_metric([key, model, "prompt"], prompt)
                tokens.add_metric([key, model, "completion"], completion)
            rejected = {**{(k, r): 0 for k in u.keys for r in REJECT_REASONS}, **u.rejected}
            for (key, reason), n in sorted(rejected.items()):
                rejections.add_metric([key, reason], n)
            for key in u.keys:
                inflight.add_metric([key], u.inflight.get(key, 0))
                background.add_metric([key], u.background.get(key, 0))
            for (kind, name), (limit, spent, end) in sorted(u.budgets.items()):
                budget[kind].add_metric([name], limit)
                used[kind].add_metric([name], spent)
                reset[kind].add_metric([name], end)
        yield from (requests, tokens, rejections, inflight, background)
        for fams in (budget, used, reset):
            yield from fams.values()
