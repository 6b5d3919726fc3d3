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
import itertools
import json
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web

from ..config import FleetConfig
from .pool import ModelPool, NoReplica, Pools, QueueFull, Slot
from ..reqstats import RequestStats
from .upstream import ConnectFailed, Response, Upstream, UpstreamFailed, UpstreamTimeout

log = logging.getLogger(__name__)
access_log = logging.getLogger("slurmfleet.access")

HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length", "authorization", "x-api-key", "cookie",
       "expect"}  # the body is sent whole at once: a replica's 100 Continue would only be noise
HOP_BYTES = frozenset(h.encode() for h in HOP) | {b"x-request-id"}
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

    def check(self, request: web.BaseRequest) -> bool:
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
    def __init__(self, cfg: FleetConfig, pools: Pools, upstream: Upstream, stats: RequestStats):
        self.cfg, self.pools, self.upstream, self.stats = cfg, pools, upstream, stats
        self.keys = KeySet(cfg.gateway.api_keys, cfg.gateway.api_keys_file)
        self.budget = RetryBudget(cfg.gateway.retry_budget_ratio)
        self.shutting_down = False
        # request ids: a random per-process prefix and a counter (uuid4 per request costs more than routing)
        self._rid_prefix = uuid.uuid4().hex[:16]
        self._rid_seq = itertools.count(1)

    def set_config(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.keys = KeySet(cfg.gateway.api_keys, cfg.gateway.api_keys_file)
        self.pools.set_models(cfg.models)
        self.upstream.connect_timeout_s = cfg.gateway.connect_timeout_s

    def server(self) -> web.Server:
        """The gateway as a low-level aiohttp server: one dispatch function instead of the Application
        router and middleware chain, which cost about a quarter of a proxied request's CPU time."""
        loop = asyncio.get_running_loop()

        def make_request(message, payload, protocol, writer, task) -> web.BaseRequest:
            return web.BaseRequest(message, payload, protocol, writer, task, loop,
                                   client_max_size=self.cfg.gateway.max_body_bytes)
        return web.Server(self.handle, request_factory=make_request)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request: ``/v1/*`` is proxied (this function is the hot path, so the proxying is inline
        and the few other routes branch off first)."""
        path = request.path
        if not path.startswith("/v1/") or path.startswith("/v1/models") and (
                len(path) == 10 or path[10] == "/"):
            return await self._other(request, path)
        t0 = time.monotonic()
        rid = request.headers.get("x-request-id") or f"{self._rid_prefix}{next(self._rid_seq):016x}"
        info = {"request_id": rid, "method": request.method, "path": path, "model": None, "replica": None,
                "status": None, "retries": 0, "ttft_s": None}
        resp = await self._forward(request, rid, info, t0)
        if access_log.isEnabledFor(logging.INFO):
            info["status"] = resp.status
            info["duration_s"] = round(time.monotonic() - t0, 4)
            access_log.info(json.dumps(info))
        if not resp.prepared:
            resp.headers["x-request-id"] = rid
        return resp

    async def _other(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        method = request.method
        if path.startswith("/v1/models"):
            if method != "GET":
                return error_response(405, f"Method {method} not allowed on {path}.", "invalid_request_error",
                                      "method_not_allowed", {"Allow": "GET"})
            return await (self.list_models(request) if path == "/v1/models" else
                          self.get_model(request, path[len("/v1/models/"):]))
        if path in ("/healthz", "/readyz"):
            if method not in ("GET", "HEAD"):
                return error_response(405, f"Method {method} not allowed on {path}.", "invalid_request_error",
                                      "method_not_allowed", {"Allow": "GET"})
            return await (self.healthz(request) if path == "/healthz" else self.readyz(request))
        return error_response(404, f"No route for {method} {path}.", "invalid_request_error", "not_found")

    async def healthz(self, _: web.BaseRequest) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.BaseRequest) -> web.Response:
        missing = [name for name, p in self.pools.pools.items() if p.model.replicas > 0 and not p.slots]
        if self.shutting_down or missing:
            return web.json_response({"status": "not ready", "shutting_down": self.shutting_down,
                                      "models_without_ready_replica": missing}, status=503)
        return web.json_response({"status": "ready"})

    async def list_models(self, request: web.BaseRequest) -> web.Response:
        if not self.keys.check(request):
            return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "slurmfleet", "root": p.model.name}
                for n, name in self.pools.names.items() for p in [self.pools.pools[name]]]
        return web.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.BaseRequest, name: str) -> web.Response:
        if not self.keys.check(request):
            return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
        pool = self.pools.resolve(name)
        if pool is None:
            return error_response(404, f"The model `{name}` does not exist.", "invalid_request_error",
                                  "model_not_found")
        return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "slurmfleet",
                                  "root": pool.model.name})

    async def _forward(self, request: web.BaseRequest, rid: str, info: dict, t0: float) -> web.StreamResponse:
        if self.keys.digests and not self.keys.check(request):
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
        # the request head minus the lines naming the replica and its secret, built once for all attempts
        lines = [f"{request.method} {request.raw_path} HTTP/1.1\r\nx-request-id: {rid}\r\n".encode()]
        for k, v in request.raw_headers:
            if k.lower() not in HOP_BYTES:
                lines += (k, b": ", v, b"\r\n")
        if raw or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"Content-Length: %d\r\n" % len(raw))
        head = b"".join(lines)
        tried: set[str] = set()
        attempt = 0
        gw = self.cfg.gateway
        stats = self.stats
        stats.inflight[model] = stats.inflight.get(model, 0) + 1
        try:
            while True:
                try:
                    slot = pool.try_acquire(body, request.headers, tried) or await pool.acquire(
                        body, request.headers, tried, gw.queue_timeout_s, lambda n: stats.queued.__setitem__(model, n))
                except QueueFull:
                    stats.request(model, 429, "none")
                    return error_response(429, f"Too many requests queued for `{model}`.", "rate_limit_exceeded",
                                          "queue_full", {"Retry-After": "1"})
                except NoReplica:
                    stats.request(model, 503, "none")
                    return error_response(503, f"No replica of `{model}` became ready within "
                                          f"{gw.queue_timeout_s:.0f}s.", "service_unavailable", "no_replica",
                                          {"Retry-After": "10"})
                self.pools.started(slot)
                info["replica"] = f"{model}/{slot.backend.slot}"
                outcome = await self._attempt(request, pool, slot, raw, head, info, t0, model)
                if isinstance(outcome, web.StreamResponse):
                    return outcome
                # retryable failure before anything reached the client
                tried.add(slot.backend.job_id)
                if attempt >= gw.max_retries or not self.budget.take():
                    return outcome[1]
                attempt += 1
                info["retries"] = attempt
                stats.count("retries", model, outcome[0])
                await asyncio.sleep(min(0.5, 0.025 * 2 ** attempt) * (0.5 + pool.rng.random()))
        finally:
            stats.inflight[model] -= 1
            stats.hist("duration", model).observe(time.monotonic() - t0)

    async def _attempt(self, request: web.BaseRequest, pool: ModelPool, slot: Slot, raw: bytes, head: bytes,
                       info: dict, t0: float, model: str):
        """One try on one replica: a response, or (reason, error response) when another replica may help."""
        ep = slot.backend.endpoint
        gw = self.cfg.gateway
        if not slot.head_tail:
            host = f"[{ep.host}]" if ":" in ep.host else ep.host
            slot.head_tail = f"Host: {host}:{ep.port}\r\nAuthorization: Bearer {ep.secret}\r\n\r\n".encode()
        verdict: bool | None = None
        slot_label = str(slot.backend.slot)
        try:
            try:
                upstream = await self.upstream.request(ep.host, ep.port, head + slot.head_tail, raw,
                                                       first_byte_timeout_s=gw.first_byte_timeout_s,
                                                       total_timeout_s=gw.request_timeout_s)
            except (ConnectFailed, UpstreamFailed) as exc:
                verdict = False
                reason = ("connect" if isinstance(exc, ConnectFailed) else
                          "timeout" if isinstance(exc, UpstreamTimeout) else "reset")
                log.debug("attempt on %s/%s failed: %s", model, slot_label, exc)
                return reason, error_response(502, f"Replica unreachable: {type(exc).__name__}", "bad_gateway",
                                              "upstream_unreachable")
            try:
                if upstream.status in RETRY_STATUS:
                    verdict = False if upstream.status != 429 else None
                    text = await upstream.read()
                    self.stats.request(model, upstream.status, slot_label)
                    return f"status_{upstream.status}", self._relay_error(upstream.status, text)
                verdict = upstream.status < 500
                resp = await self._relay(request, upstream, info, t0, model, slot_label)
                if info.get("upstream_failed"):
                    verdict = False
                return resp
            finally:
                upstream.release()
        finally:
            if self.pools.finished(pool, slot, verdict):
                self.stats.count("ejections", model)
                log.warning("ejected replica %s/%s after repeated failures", model, slot.backend.slot)

    def _relay_error(self, status: int, text: bytes) -> web.Response:
        try:
            body = json.loads(text)
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                return web.json_response(body, status=status)
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        return error_response(status, f"Upstream returned {status}.", "upstream_error")

    async def _relay(self, request: web.BaseRequest, upstream: Response, info: dict, t0: float,
                     model: str, slot_label: str) -> web.StreamResponse:
        ctype = upstream.content_type or "application/json"
        out_headers = {"Content-Type": ctype, "x-request-id": info["request_id"]}
        if upstream.status == 401:  # the backend rejected the gateway's secret: never leak its body
            self.stats.request(model, 502, slot_label)
            return error_response(502, "Replica rejected the gateway's credentials.", "bad_gateway")
        if "text/event-stream" not in ctype and upstream.content_length is not None:
            # a complete JSON document: read it whole (SSE is never buffered)
            try:
                data = await upstream.read()
            except UpstreamFailed as exc:
                info["upstream_failed"] = True
                self.stats.request(model, 502, slot_label)
                log.warning("replica %s/%s failed mid-response: %s", model, slot_label, exc)
                return error_response(502, "Replica failed before responding.", "bad_gateway", "upstream_error")
            self.stats.hist("ttft", model).observe(time.monotonic() - t0)
            self.stats.request(model, upstream.status, slot_label)
            return web.Response(status=upstream.status, body=data, headers=out_headers)
        resp = web.StreamResponse(status=upstream.status, headers=out_headers)
        if "text/event-stream" in ctype:
            resp.headers["Cache-Control"] = "no-cache"
        first = True
        try:
            async for chunk in upstream.iter_chunks():
                if first:
                    first = False
                    ttft = time.monotonic() - t0
                    info["ttft_s"] = round(ttft, 4)
                    self.stats.hist("ttft", model).observe(ttft)
                    await resp.prepare(request)
                await resp.write(chunk)
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: closing the upstream response makes vLLM abort the request
            upstream.close()
            self.stats.count("stream_aborts", model, "client")
            self.stats.request(model, 499, slot_label)
            raise
        except UpstreamFailed as exc:
            upstream.close()
            self.stats.count("stream_aborts", model, "upstream")
            self.stats.request(model, 502, slot_label)
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
        self.stats.request(model, upstream.status, slot_label)
        return resp
