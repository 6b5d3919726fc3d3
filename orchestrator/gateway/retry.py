"""Retrying a request on another replica: what a failed attempt says (:class:`Retry`), the budget
that keeps retries from multiplying load across the fleet (:class:`RetryBudget`), and when a held request
tries again a replica that refused its connection (:func:`revive`)."""

from __future__ import annotations

from aiohttp import web

from ..errors import NO_RETRY, error_response


class RetryBudget:
    """Retries stay under ``ratio`` of traffic: every request earns ``ratio`` of a token."""

    def __init__(self, ratio: float, burst: float = 5.0):
        self.ratio, self.burst, self.tokens = ratio, burst, burst

    def on_request(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def take(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Retry:
    """An attempt that failed before anything reached the client, so another replica may still serve:
    ``reason`` labels slurmfleet_request_retries_total, ``response`` is the error to answer if none will.

    ``broken``: the replica's connection failed (refused, reset, closed before a whole answer), which a
    dead or killed replica does to every request it holds at once: those are retried up to
    ``max_retries`` whatever the retry budget (each costs one fast failed attempt, and the replica is
    ejected).  Answers that say "overloaded" (429, 502-504) and timeouts spend the budget, which keeps
    retries from multiplying load across the fleet."""

    __slots__ = ("reason", "response", "broken")

    def __init__(self, reason: str, response: web.Response, broken: bool = False):
        self.reason, self.response, self.broken = reason, response, broken


RESETS_TRIED = 2   # replicas that may drop one request mid-work before it is answered (see :func:`dropped_twice`)


def dropped_twice() -> web.Response:
    """The answer to a request that two replicas dropped while serving it.  One replica that dies takes every
    request it held, and those go on elsewhere; a request that then loses a second replica may be what kills
    them (a prompt that crashes the engine: a "query of death"), and ``max_retries`` tries of it would take that
    many replicas down with it.  ``x-should-retry: false`` keeps the openai SDKs, which retry a 5xx twice by
    default, from sending it to two more pairs."""
    return error_response(502, "Two replicas failed while serving this request; it is not sent to another, as it "
                          "may be what made them fail.", "bad_gateway", "upstream_error", NO_RETRY)


DEAD_RETRY_S = 2.0   # a replica that refused a held request's connection is tried again after this


def revive(dead: dict[str, float], exclude: set[str], now: float) -> None:
    """A held request's replicas (job id -> when) that refused its connection, tried again ``DEAD_RETRY_S`` later:
    one lost connect (or a job requeued to a new endpoint) cost the request the whole hold, while the replica
    served every other request.  An engine that did die leaves the table once the fleet's probes say so."""
    for j in [j for j, t in dead.items() if now - t >= DEAD_RETRY_S]:
        del dead[j]
        exclude.discard(j)
