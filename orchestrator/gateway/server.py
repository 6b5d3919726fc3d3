"""The gateway: an OpenAI-compatible aiohttp reverse proxy in front of the READY replicas.

Routes ``/v1/*`` by ``model`` on the latest routing table, streams SSE chunk by chunk, retries elsewhere only while
nothing reached the client, adds each job's secret, never forwards client credentials, errs in OpenAI's JSON.

A proxied request goes through four steps: :func:`.parsing.parse` (key, body, model), :meth:`Gateway._route` (a
lease on a replica, waiting in the model's queue if none has room), :meth:`Gateway._attempt` (one try there: the
response or a :class:`Retry`) and the relay to the client.  The lease carries the outcome; releasing it is the
only place a replica's in-flight count goes down.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable

from aiohttp import web

from ..config import FleetConfig
from ..contract import GatewayReport, RoutingTable
from ..errors import error_response, method_not_allowed
from ..reqstats import RequestStats
from . import endpoints, files, stored
from .clientip import ClientAddress
from .cors import Cors, CorsRequest
from .http import BODY_LATE, Server, connection_cap
from .pool import Lease, NoReplica, Pools, QueueFull
from .metering import charge_prompt, choices
from .parsing import Parsed, Rejected, fall_back, parse
from .relay import relay, relay_refusal
from .resume import relay as resume_relay
from .retry import RESETS_TRIED, Retry, RetryBudget, dropped_twice, revive
from .tenants import BATCHES, Tenants
from .upstream import Upstream
from .upstreamerrors import ConnectFailed, UpstreamFailed, UpstreamTimeout

log = logging.getLogger(__name__)
# a stopping gateway's wait for its requests' chores (a /tokenize): within the 5 s a worker gets past its grace
CHORES_WAIT_S = 3.0
access_log = logging.getLogger("slurmfleet.access")

RETRY_STATUS = {429, 502, 503, 504}
PROXIED_METHODS = frozenset({"GET", "POST", "DELETE", "PUT", "PATCH"})
UNRESOLVED = "(none)"   # requests_total's model for a request refused before its model was known (no model has it)


Attempt = web.StreamResponse | Retry
"""One try's result: the client's response, or a :class:`Retry` (allocated only on failure)."""


class Gateway:
    def __init__(self, cfg: FleetConfig, pools: Pools, upstream: Upstream, stats: RequestStats, process: int = 0):
        self.cfg, self.pools, self.upstream, self.stats, self.process = cfg, pools, upstream, stats, process
        self.incarnation = uuid.uuid4().hex[:12]
        self.tenants = Tenants(cfg.gateway, process, self.incarnation, pools.names)
        self.budget, self.cors = RetryBudget(cfg.gateway.retry_budget_ratio), Cors.of(cfg.gateway.cors_allowed_origins)
        self.clients = ClientAddress(cfg.gateway.trusted_proxies)
        self.file_uploads = files.Uploads()   # the Files API's uploads in progress, per key (its storage quotas)
        self.shutting_down = False
        self.on_hold: Callable[[], None] = lambda: None   # a request waits for a model without a READY replica
        self.on_follow: Callable[[], None] = lambda: None   # a background response is followed: report it now
        self.chores: set[asyncio.Task] = set()   # work a request leaves behind (its prompt counted after it ended)
        self.following = stored.Following()   # background responses followed to their end, to charge them then
        # request ids: a random per-process prefix and a counter (uuid4 per request costs more than routing)
        self._rid_prefix, self._rid_seq = uuid.uuid4().hex[:16], itertools.count(1)
        self._zero_fallbacks(cfg)

    def _zero_fallbacks(self, cfg: FleetConfig) -> None:
        """Each (model, fallback) series from 0: rate() sees an outage's first fallbacks."""
        for m in cfg.models:
            for name in m.gateway.fallbacks:
                if (to := self.pools.resolve(name)) is not None:
                    self.stats.fallbacks.setdefault((m.name, to.model.name), 0)

    def later(self, coro) -> None:
        """Run ``coro`` after the request that asks it has ended (held until it ends: no task is lost)."""
        self.chores.add(task := asyncio.get_running_loop().create_task(coro))
        task.add_done_callback(self.chores.discard)

    async def settle(self, chores_s: float = CHORES_WAIT_S) -> None:
        """After the server stopped: its requests' chores (their counts, for the last report) get ``chores_s``."""
        if self.chores:
            _, late = await asyncio.wait(set(self.chores), timeout=chores_s)
            for t in late:
                t.cancel()
            if late:   # (their ends count what they had not: for the report that follows, not after it)
                await asyncio.wait(late, timeout=1.0)

    async def close(self) -> None:
        """The chores settled, the connections to the replicas closed."""
        await self.settle()
        self.upstream.close()
        await self.pools.close()

    def closing(self) -> None:
        """Stopping: new requests get 503, and so do those held for a replica that will not come now (a
        cold start's hold outlasts the shutdown grace: they would end cut off, not with an answer)."""
        self.shutting_down = True
        self.pools.close_queues("The gateway is shutting down.")

    # -- the contract ---------------------------------------------------------------------------------
    def set_config(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.pools.set_models(cfg.gateway, cfg.models)
        self.tenants.set_config(cfg.gateway, self.pools.names)
        self._zero_fallbacks(cfg)
        self.upstream.connect_timeout_s = cfg.gateway.connect_timeout_s
        self.budget.ratio = cfg.gateway.retry_budget_ratio
        self.cors = Cors.of(cfg.gateway.cors_allowed_origins)
        self.clients = ClientAddress(cfg.gateway.trusted_proxies)

    def publish(self, table: RoutingTable) -> None:
        """Route on this table from now on (the in-process :class:`~orchestrator.contract.RoutingSink`)."""
        self.pools.apply(table)
        self.tenants.apply(table)
        if table.adopt or self.following.taken:
            stored.take(self, table)

    def report(self, urgent: bool = False) -> GatewayReport:
        """This process's report to the fleet (``urgent``: sent out of turn for a held request)."""
        queued = self.pools.queued()
        if self.pools.kv is not None:
            self.pools.kv.export()
        snap = self.stats.snapshot(inflight=self.pools.inflight_by_model(),
                                   queued={m: q.depth for m, q in queued.items()})
        return GatewayReport(self.process, self.pools.table.version, self.pools.inflight_by_job(), queued, snap,
                             urgent, incarnation=self.incarnation, tenants=self.tenants.report(),
                             background=self.following.report())

    # -- serving --------------------------------------------------------------------------------------
    def request_id(self) -> str:
        return f"{self._rid_prefix}{next(self._rid_seq):016x}"

    def server(self) -> web.Server:
        """The gateway as a low-level aiohttp server: one dispatch function instead of the Application
        router and middleware chain, which cost about a quarter of a proxied request's CPU time."""
        loop = asyncio.get_running_loop()

        def make_request(message, payload, protocol, writer, task) -> web.BaseRequest:
            size = self.cfg.gateway.max_body_bytes
            if self.cors is None:
                return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=size)
            return CorsRequest(message, payload, protocol, writer, task, loop, client_max_size=size, cors=self.cors)
        gw = self.cfg.gateway
        # handler_cancellation: a client that disconnects cancels its request, which closes the replica
        # connection of an unfinished response, and the engine aborts the generation (streamed or not)
        return Server(self.handle, request_factory=make_request, keepalive_timeout=gw.keepalive_timeout_s,
                      handler_cancellation=True, access_log=None,  # slurmfleet.access logs requests
                      max_connections=connection_cap(gw.max_connections), header_timeout_s=gw.header_timeout_s)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request: ``/v1/*`` is proxied (the hot path, so the few other routes branch off first)."""
        path = request.path
        if request.method == "OPTIONS" and self.cors is not None and (pre := self.cors.preflight(request)):
            return pre   # (a browser's preflight: no key, before any other answer)
        if endpoints.served_here(path):   # (the model list, health, files, batches; refusals of odd paths)
            return await endpoints.other(self, request, path)
        if request.method not in PROXIED_METHODS:   # (a HEAD's answer has a length and no body: never proxied)
            return method_not_allowed(request.method, path, "GET, POST, DELETE, PUT, PATCH")
        t0 = time.monotonic()
        # the engine gets an id of the gateway's own (vLLM takes x-request-id as its request's id: a client's
        # could be another's, and collide), the client its own back, and the log both
        own = self.request_id()
        rid = request.headers.get("x-request-id") or own
        info = {"request_id": rid, "upstream_id": own, "method": request.method, "path": path, "model": None,
                "replica": None, "status": None, "retries": 0, "ttft_s": None, "client": None, "key": None}
        parsed, left = None, None
        try:
            tenant = self.tenants.identify(request.headers)
            if tenant is None:
                raise Rejected(self.tenants.refusal(request.headers))
            parsed = parse(self.pools, request, own, await self._body(request), tenant)
            info["model"], info["key"] = parsed.model, tenant.name
            refused = self.tenants.admit(tenant, parsed.model, parsed.body, not parsed.stored)
            if refused is not None:
                parsed.slot = "refused"
                raise Rejected(refused)
            owner, refused = self.tenants.batch_owner(tenant, request.headers, parsed.model)
            if refused is not None:
                tenant.finish(parsed.model, 0, 0, False)
                parsed.slot = "refused"
                raise Rejected(refused)
            try:
                if tenant.limited:
                    parsed.headers = self.tenants.headers(tenant)
                resp = await self._proxy(parsed, info, t0)
            finally:
                if parsed.stamp is not None and parsed.stamp.background and parsed.answered:   # (its charge, when
                    stored.start(self, parsed)   # it ends; its client may have left its stream)
                if self.pools.kv is not None:   # (what kv_aware kept of it for its retries and waits goes)
                    self.pools.kv.forget(parsed.pool.model.name, parsed.body)
                # a batch line (its owner named): the runner's concurrency only; the runner charges the owner from
                # (a stored response read or cancelled: its tokens were charged when it was made; a background
                # one's are charged when it ends, stored.follow)
                tenant.finish(parsed.model, *((0, 0) if parsed.unmetered else parsed.usage),
                              parsed.answered and owner is None)   # what it writes down
        except Rejected as exc:
            resp = exc.response
        except BaseException as exc:   # the client left before its answer ended (499; a body too slow: 408), or a
            left = (408 if request.get(BODY_LATE) else 499) if isinstance(   # bug (500)
                exc, (asyncio.CancelledError, ConnectionResetError)) else 500
            if type(exc) is ConnectionResetError:   # (a client that stopped reading, let go: no traceback in the log)
                raise asyncio.CancelledError from None
            raise
        finally:
            if parsed is not None:   # once a request, its final status (the attempts retried: retries_total)
                status = parsed.code or left or resp.status
                self.stats.ended(parsed.model, status, parsed.slot, time.monotonic() - t0, info["ttft_s"],
                                 parsed.usage if parsed.answered and not parsed.unmetered else None,
                                 choices(parsed.body))
                if parsed.queued_s is not None:
                    self.stats.hist("queue_wait", parsed.model).observe(parsed.queued_s)
            else:   # refused before its model was known (key, body, model name): no client string as a label
                self.stats.request(UNRESOLVED, status := left or resp.status, "none")
            if self.cfg.gateway.access_log and access_log.isEnabledFor(logging.INFO):   # (answered or not)
                info.update(status=status, duration_s=round(time.monotonic() - t0, 4))
                info["client"] = self.clients.of(request.remote, request.headers.getall(   # (behind a load
                    "X-Forwarded-For", ())) if self.clients.trusted else request.remote   # balancer: the one it names)
                access_log.info(json.dumps(info))
        if not resp.prepared:
            resp.headers["x-request-id"] = rid
            if parsed is not None and parsed.headers:   # a limited key's x-ratelimit-* on its refusals and errors too
                for k, v in parsed.headers.items():
                    resp.headers.setdefault(k, v)
        return resp

    # -- the four steps of a proxied request ----------------------------------------------------------
    async def _body(self, request: web.BaseRequest) -> bytes:
        """The whole request body, once the gateway's state allows reading it."""
        if self.shutting_down:
            raise Rejected(error_response(503, "The gateway is shutting down.", "service_unavailable",
                                          "shutting_down", {"Retry-After": "5"}))
        body = await endpoints.read_body(request, self.cfg.gateway.max_body_bytes)
        if type(body) is not bytes:   # (its refusal: a web.Response, a MutableMapping, whose isinstance is slow)
            raise Rejected(body)
        return body

    async def _proxy(self, p: Parsed, info: dict, t0: float) -> web.StreamResponse:
        """Route, attempt, and retry on another replica while the failures allow it."""
        self.budget.on_request()
        tried: set[str] = set() if p.pin is None else stored.Only(p.pin)   # (pinned: the replica of its stored response)
        attempt = resets = 0
        gw = self.cfg.gateway
        while True:
            # oldest first: while requests wait for this model, a new one queues behind them
            if p.stored:   # a stored response read or cancelled: straight to its replica (no generation: no
                lease = self._pinned(p)   # queue nor cap, which a full replica's background work would hold it in)
            else:
                lease = (None if p.pool.waiting_since else p.pool.try_acquire(p.body, p.request.headers, tried)
                         ) or await self._route(p, tried, info)
            p.slot = lease.slot.label
            info["replica"] = f"{p.model}/{p.slot}"
            result = await self._attempt(p, lease, info, t0)
            if type(result) is not Retry:
                return result
            tried.add(lease.slot.job_id)
            resets += result.reason in ("reset", "engine_error")   # (a replica that dropped it, or died on it)
            every = p.pool.slots and tried.issuperset(p.pool.slots) or p.pin is not None   # every replica tried
            # (or the one it may go to): answer now, unless
            # held through a cold start: the replica that ended the hold refuses connections (its engine died before
            # a probe saw it, or a connect was lost): wait, within the hold (not max_retries; after it, as any
            # request), for the next one or this one again a little later (retry.revive), rather than a 502 at once
            if result.reason == "connect" and info.get("cold") and time.monotonic() < p.waited_from + p.pool.hold_s(True):
                p.dead = {**(p.dead or {}), lease.slot.job_id: time.monotonic()}
            elif every or attempt >= gw.max_retries or resets >= RESETS_TRIED or not (result.broken or self.budget.take()):
                # (a token only for a retry that will be made: one spent with no replica left drained every model's)
                return dropped_twice() if resets >= RESETS_TRIED else result.response
            attempt = info["retries"] = attempt + 1
            self.stats.count("retries", p.model, result.reason)
            await asyncio.sleep(min(0.5, 0.025 * 2 ** min(attempt, 5)) * (0.5 + self.pools.rng.random()))

    @staticmethod
    def _pinned(p: Parsed) -> Lease:
        """A lease on the replica that holds the stored response ``p`` names, or its 404 (the replica has gone)."""
        slot = p.pool.slots.get(p.pin)
        if slot is None:
            raise Rejected(stored.not_found(p.path.split("/")[3]))
        return Lease(slot, p.pool)

    async def _route(self, p: Parsed, tried: set[str], info: dict) -> Lease:
        """Wait in the model's queue for a replica with room (none had room, or others wait already).
        With no READY replica at all the request is held (a cold start): for an autoscaled model up to
        its ``cold_start_hold_s``, and the fleet hears of it at once (an urgent report)."""
        pool, p.slot, dead = p.pool, "none", p.dead or {}   # (no replica yet)
        revive(dead, tried, time.monotonic())
        cold = all(j in dead for j in pool.slots)   # none READY, or none but the dead ones it tried
        t = time.monotonic()
        if cold:
            info["cold"], p.waited_from = True, t if p.waited_from is None else p.waited_from
            # the first one: report once it is in the queue (the report shows it); a model that cannot hold it
            # (blocked: nothing would start it; or no queue, no hold) reports at most once a second, not per request
            if not pool.waiting_since and not pool.blocked and t - pool.hold_reported >= 1.0:
                pool.hold_reported = t
                asyncio.get_running_loop().call_soon(self.on_hold)
        try:
            lease = await pool.acquire(p.body, p.request.headers, tried, None, p.tenant.rank, p.tenant.name,
                                       p.waited_from if dead or cold else None, dead)   # (a hold from arrival)
        except (QueueFull, NoReplica) as exc:   # a fallback model that can take it now, else the refusal
            if isinstance(exc, NoReplica):
                p.queued_s = (p.queued_s or 0.0) + time.monotonic() - t
            first = p.fallback_from is None   # (counted once, by the model that took it: not a hop that could not)
            if not self.shutting_down and fall_back(self.pools, p) is not None:
                info.pop("cold", None)   # (a cold start of the model it asked; its fallback has a READY replica)
                info.update(model=p.model, fallback_from=p.fallback_from)
                # (a replica with room now: a fallback with no queue of its own takes it too)
                lease = (None if p.pool.waiting_since else p.pool.try_acquire(p.body, p.request.headers, tried)
                         ) or await self._route(p, tried, info)
                if first:
                    self.stats.count("fallbacks", p.fallback_from, p.model)
                return lease
            if isinstance(exc, QueueFull):
                raise Rejected(error_response(429, f"Too many requests queued for `{p.model}`.", "rate_limit_exceeded",
                                              "queue_full", {"Retry-After": "1"})) from None
            cold = all(j in dead for j in pool.slots)   # (the wait it had, by the config it waited under)
            why = exc.args[0] if exc.args else (
                f"No replica of `{p.model}` became ready within {round(exc.waited_s, 1):g}s{pool.waited_on()}" if cold
                else f"No replica of `{p.model}` had room within {round(exc.waited_s, 1):g}s.")
            if self.shutting_down:   # (another gateway process, or this one started again, will answer)
                raise Rejected(error_response(503, why, "service_unavailable", "shutting_down", {"Retry-After": "5"})) from None
            # blocked (args): nothing changes before an operator acts, and the SDK would wait out two Retry-Afters
            raise Rejected(error_response(503, why, "service_unavailable", "no_replica", {
                "Retry-After": "30" if cold else "10", **({"x-should-retry": "false"} if exc.args else {})})) from None
        p.queued_s = (p.queued_s or 0.0) + time.monotonic() - t   # (a held request waits again: one request)
        if lease.held and not cold:   # its replicas died while it waited: held since, as a cold start's (see _proxy)
            info["cold"], p.waited_from = True, t
        transport = p.request.transport
        if transport is None or transport.is_closing():   # the client left while it waited: no engine work for it
            lease.release()
            raise Rejected(error_response(499, "The client closed the request.", "invalid_request_error",
                                          "client_closed"))
        return lease

    async def _attempt(self, p: Parsed, lease: Lease, info: dict, t0: float) -> Attempt:
        """One try on the leased replica; the lease is released (with its outcome) whatever happens."""
        slot, gw, ep = lease.slot, p.pool.limits, lease.slot.replica.endpoint   # (the model's timeouts)
        try:
            try:
                # (an answer not streamed has its headers only when it is whole: the request's timeout is its)
                streamed = p.resume is not None or p.body.get("stream") is True
                upstream = await self.upstream.request(ep.host, ep.port, p.head + slot.tail(),
                                                       p.raw if p.stamp is None else p.stamp.body(p.raw, slot),
                                                       first_byte_timeout_s=gw.first_byte_timeout_s if streamed
                                                       else gw.request_timeout_s,
                                                       total_timeout_s=gw.request_timeout_s,
                                                       stream_idle_timeout_s=gw.stream_idle_timeout_s)
            except (asyncio.CancelledError, ConnectionResetError):   # the client left: the engine stops, and for an
                if not streamed and p.tenant.name != BATCHES and not p.unmetered:   # answer not streamed the key
                    self.later(charge_prompt(self, p, slot))   # pays the prompt it prefilled (a stream: what it
                    # was sent)
                raise
            except (ConnectFailed, UpstreamFailed) as exc:
                reason = ("connect" if isinstance(exc, ConnectFailed) else
                          "timeout" if isinstance(exc, UpstreamTimeout) else "reset")
                answer = error_response(504, "The replica did not answer in time.", "gateway_timeout",
                                        "upstream_timeout") if reason == "timeout" else error_response(
                    502, f"Replica unreachable: {type(exc).__name__}", "bad_gateway", "upstream_unreachable")
                if reason == "timeout" and not streamed:   # its whole time spent (the engine may be just busy):
                    lease.ok = None                        # not another try, nor a failure of the replica
                    if p.tenant.name != BATCHES and not p.unmetered:   # the key pays the prompt it had prefilled,
                        self.later(charge_prompt(self, p, slot))       # as a client that leaves: never free
                    return answer
                lease.ok = False
                log.debug("attempt on %s/%s failed: %s", p.model, slot.label, exc)
                return Retry(reason, answer, reason != "timeout")
            p.answered = True
            try:
                if upstream.status == 401:   # the gateway's secret refused (a stale endpoint): nothing ran there
                    lease.ok = False
                    return Retry("auth", error_response(502, "Replica rejected the gateway's credentials.",
                                                        "bad_gateway"), True)
                if upstream.status == 500 and upstream.content_length == 0:   # vLLM's answer when its engine died
                    lease.ok = False   # (EngineDeadError) before any output: tried elsewhere, as a dropped request
                    return Retry("engine_error", error_response(500, "The replica's engine failed while answering.",
                                                                "upstream_error", "engine_error"), True)
                if upstream.status in RETRY_STATUS:
                    lease.ok = False if upstream.status != 429 else None
                    try:
                        text = await upstream.read()
                    except UpstreamFailed:
                        text = b""
                    return Retry(f"status_{upstream.status}", relay_refusal(p, upstream, text))
                lease.ok = upstream.status < 500
                if p.resume is not None and upstream.status == 200 and "text/event-stream" in (
                        upstream.content_type or ""):
                    return await resume_relay(self, p, lease, upstream, info, t0)
                return await relay(self, p, lease, upstream, info, t0)
            finally:
                upstream.release()
        finally:
            if lease.release():
                self.stats.count("ejections", p.model)
                log.warning("ejected replica %s/%s after repeated failures", p.model, slot.label)

