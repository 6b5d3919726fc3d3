"""The gateway: an OpenAI-compatible aiohttp reverse proxy in front of the READY replicas.

Routes ``/v1/*`` by ``model``, streams SSE chunk by chunk, retries on another
replica only while nothing has reached the client, adds each job's secret and
never forwards the client's credentials.  Every error it makes is an
OpenAI-style JSON body.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

from .config import FleetConfig
from .metrics import Metrics
from .pool import ModelPool, NoReplica, Pools, QueueFull, Slot

log = logging.getLogger(__name__)
access_log = logging.getLogger("slurmfleet.access")

HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length", "authorization", "x-api-key", "cookie"}
RETRY_STATUS = {429, 502, 503, 504}


def error_response(status: int, message: str, etype: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": code or str(status)}}
    return web.json_response(body, status=status, headers=headers)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeySet:
    """API keys, plain or ``sha256:<hex>``; compared in constant time by digest."""

    def __init__(self, keys: list[str], file: str | None = None):
        entries = list(keys)
        if file:
            entries += [ln.strip() for ln in Path(file).read_text().splitlines()
                        if ln.strip() and not ln.lstrip().startswith("#")]
        self.digests = [e.split(":", 1)[1].lower() if e.startswith("sha256:") else key_digest(e) for e in entries]

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def check(self, request: web.Request) -> bool:
        if not self.digests:
            return True
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not token:
            return False
        d = key_digest(token)
        return any(hmac.compare_digest(d, x) for x in self.digests)


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


class Gateway:
    def __init__(self, cfg: FleetConfig, pools: Pools, session: aiohttp.ClientSession, metrics: Metrics):
        self.cfg, self.pools, self.session, self.metrics = cfg, pools, session, metrics
        self.keys = KeySet(cfg.gateway.api_keys, cfg.gateway.api_keys_file)
        self.budget = RetryBudget(cfg.gateway.retry_budget_ratio)
        self.shutting_down = False
        self._children: dict[str, tuple] = {}
        self._timeout = aiohttp.ClientTimeout(total=cfg.gateway.request_timeout_s,
                                              sock_connect=cfg.gateway.connect_timeout_s)

    def set_config(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.keys = KeySet(cfg.gateway.api_keys, cfg.gateway.api_keys_file)
        self.pools.set_models(cfg.models)
        self._timeout = aiohttp.ClientTimeout(total=cfg.gateway.request_timeout_s,
                                              sock_connect=cfg.gateway.connect_timeout_s)

    def _per_model(self, model: str) -> tuple:
        """Metric children bound to a model once (label lookups are not free on the hot path)."""
        kids = self._children.get(model)
        if kids is None:
            m = self.metrics
            kids = self._children[model] = (m.inflight.labels(model), m.duration.labels(model), m.ttft.labels(model))
        return kids

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.gateway.max_body_bytes)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{name:.+}", self.get_model)
        app.router.add_route("*", "/v1/{tail:.*}", self.forward)
        return app

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        missing = [name for name, p in self.pools.pools.items() if p.model.replicas > 0 and not p.slots]
        if self.shutting_down or missing:
            return web.json_response({"status": "not ready", "shutting_down": self.shutting_down,
                                      "models_without_ready_replica": missing}, status=503)
        return web.json_response({"status": "ready"})

    async def list_models(self, request: web.Request) -> web.Response:
        if not self.keys.check(request):
            return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "slurmfleet", "root": p.model.name}
                for n, name in self.pools.names.items() for p in [self.pools.pools[name]]]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        if not self.keys.check(request):
            return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
        name = request.match_info["name"]
        pool = self.pools.resolve(name)
        if pool is None:
            return error_response(404, f"The model `{name}` does not exist.", "invalid_request_error",
                                  "model_not_found")
        return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "slurmfleet",
                                  "root": pool.model.name})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        info = {"request_id": rid, "method": request.method, "path": request.path, "model": None, "replica": None,
                "status": None, "retries": 0, "ttft_s": None}
        resp = await self._forward(request, rid, info, t0)
        if access_log.isEnabledFor(logging.INFO):
            info["status"] = resp.status
            info["duration_s"] = round(time.monotonic() - t0, 4)
            access_log.info(json.dumps(info))
        if not resp.prepared:
            resp.headers["x-request-id"] = rid
        return resp

    async def _forward(self, request: web.Request, rid: str, info: dict, t0: float) -> web.StreamResponse:
        if not self.keys.check(request):
            return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
        if self.shutting_down:
            return error_response(503, "The gateway is shutting down.", "service_unavailable", "shutting_down",
                                  {"Retry-After": "5"})
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"Request body exceeds {self.cfg.gateway.max_body_bytes} bytes.",
                                  "invalid_request_error", "request_too_large")
        try:
            body = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"Malformed JSON body: {exc}", "invalid_request_error", "invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "The JSON body must be an object.", "invalid_request_error", "invalid_json")
        name = body.get("model") or request.query.get("model")
        if not isinstance(name, str) or not name:
            return error_response(400, "The request must name a `model`.", "invalid_request_error", "missing_model")
        pool = self.pools.resolve(name)
        if pool is None:
            return error_response(404, f"The model `{name}` does not exist.", "invalid_request_error",
                                  "model_not_found")
        model = pool.model.name
        info["model"] = model
        if name != model and "model" in body:  # an alias: the engine only knows the served name
            body["model"] = model
            raw = json.dumps(body).encode()
        self.budget.on_request()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP and k.lower() != "x-request-id"}
        headers["x-request-id"] = rid
        tried: set[str] = set()
        attempt = 0
        gw = self.cfg.gateway
        inflight, duration, _ = self._per_model(model)
        inflight.inc()
        try:
            while True:
                try:
                    slot = await pool.acquire(body, request.headers, tried, gw.queue_timeout_s,
                                              lambda n: self.metrics.queued.labels(model).set(n))
                except QueueFull:
                    self.metrics.requests.labels(model, "429", "none").inc()
                    return error_response(429, f"Too many requests queued for `{model}`.", "rate_limit_exceeded",
                                          "queue_full", {"Retry-After": "1"})
                except NoReplica:
                    self.metrics.requests.labels(model, "503", "none").inc()
                    return error_response(503, f"No replica of `{model}` became ready within "
                                          f"{gw.queue_timeout_s:.0f}s.", "service_unavailable", "no_replica",
                                          {"Retry-After": "10"})
                self.pools.started(slot)
                info["replica"] = f"{model}/{slot.backend.slot}"
                outcome = await self._attempt(request, pool, slot, raw, headers, info, t0, model)
                if isinstance(outcome, web.StreamResponse):
                    return outcome
                # retryable failure before anything reached the client
                tried.add(slot.backend.job_id)
                if attempt >= gw.max_retries or not self.budget.take():
                    return outcome[1]
                attempt += 1
                info["retries"] = attempt
                self.metrics.retries.labels(model, outcome[0]).inc()
                await asyncio.sleep(min(0.5, 0.025 * 2 ** attempt) * (0.5 + pool.rng.random()))
        finally:
            inflight.dec()
            duration.observe(time.monotonic() - t0)

    async def _attempt(self, request: web.Request, pool: ModelPool, slot: Slot, raw: bytes, headers: dict,
                       info: dict, t0: float, model: str):
        """One try on one replica: a response, or (reason, error response) when another replica may help."""
        ep = slot.backend.endpoint
        gw = self.cfg.gateway
        hdrs = {**headers, "Authorization": f"Bearer {ep.secret}"}
        url = f"{ep.url}{request.rel_url.path_qs}"
        verdict: bool | None = None
        slot_label = str(slot.backend.slot)
        try:
            try:
                async with asyncio.timeout(gw.first_byte_timeout_s):
                    upstream = await self.session.request(request.method, url, data=raw or None, headers=hdrs,
                                                          timeout=self._timeout, allow_redirects=False)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                verdict = False
                reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else "connect"
                return reason, error_response(502, f"Replica unreachable: {type(exc).__name__}", "bad_gateway",
                                              "upstream_unreachable")
            try:
                if upstream.status in RETRY_STATUS:
                    verdict = False if upstream.status != 429 else None
                    text = await upstream.read()
                    self.metrics.requests.labels(model, str(upstream.status), slot_label).inc()
                    return f"status_{upstream.status}", self._relay_error(upstream.status, text)
                verdict = upstream.status < 500
                resp = await self._relay(request, upstream, info, t0, model, slot_label)
                if info.get("upstream_failed"):
                    verdict = False
                return resp
            finally:
                upstream.release()
        finally:
            if await self.pools.finished(pool, slot, verdict):
                self.metrics.ejections.labels(model).inc()
                log.warning("ejected replica %s/%s after repeated failures", model, slot.backend.slot)

    def _relay_error(self, status: int, text: bytes) -> web.Response:
        try:
            body = json.loads(text)
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                return web.json_response(body, status=status)
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        return error_response(status, f"Upstream returned {status}.", "upstream_error")

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, info: dict, t0: float,
                     model: str, slot_label: str) -> web.StreamResponse:
        ctype = upstream.headers.get("Content-Type", "application/json")
        out_headers = {"Content-Type": ctype, "x-request-id": info["request_id"]}
        if upstream.status == 401:  # the backend rejected the gateway's secret: never leak its body
            self.metrics.requests.labels(model, "502", slot_label).inc()
            return error_response(502, "Replica rejected the gateway's credentials.", "bad_gateway")
        if "text/event-stream" not in ctype and upstream.content_length is not None:
            # a complete JSON document: read it whole (SSE is never buffered)
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                info["upstream_failed"] = True
                self.metrics.requests.labels(model, "502", slot_label).inc()
                log.warning("replica %s/%s failed mid-response: %s", model, slot_label, exc)
                return error_response(502, "Replica failed before responding.", "bad_gateway", "upstream_error")
            self._per_model(model)[2].observe(time.monotonic() - t0)
            self.metrics.requests.labels(model, str(upstream.status), slot_label).inc()
            return web.Response(status=upstream.status, body=data, headers=out_headers)
        resp = web.StreamResponse(status=upstream.status, headers=out_headers)
        if "text/event-stream" in ctype:
            resp.headers["Cache-Control"] = "no-cache"
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                if first:
                    first = False
                    ttft = time.monotonic() - t0
                    info["ttft_s"] = round(ttft, 4)
                    self._per_model(model)[2].observe(ttft)
                    await resp.prepare(request)
                await resp.write(chunk)
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: closing the upstream response makes vLLM abort the request
            upstream.close()
            self.metrics.stream_aborts.labels(model, "client").inc()
            self.metrics.requests.labels(model, "499", slot_label).inc()
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            upstream.close()
            self.metrics.stream_aborts.labels(model, "upstream").inc()
            self.metrics.requests.labels(model, "502", slot_label).inc()
            log.warning("replica %s/%s failed mid-response: %s", model, slot_label, exc)
            info["upstream_failed"] = True
            if not resp.prepared:
                return error_response(502, "Replica failed before responding.", "bad_gateway", "upstream_error")
            if "text/event-stream" in ctype:
                err = {"error": {"message": "The replica failed mid-stream.", "type": "upstream_error",
                                 "param": None, "code": "502"}}
                await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                await resp.write_eof()
            elif request.transport is not None:
                # a non-SSE body cut short: break the connection so the client never sees a truncated success
                request.transport.close()
            return resp
        if first:
            await resp.prepare(request)
        await resp.write_eof()
        self.metrics.requests.labels(model, str(upstream.status), slot_label).inc()
        return resp
