"""The gateway's own endpoints, beside the proxied ``/v1`` generations: the model list, health and
readiness, and the Files and Batch APIs (loaded by their first request); and how a proxied request's body is
read (:func:`request_body`)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from aiohttp.helpers import parse_mimetype
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.multipart import parse_content_disposition
from aiohttp.web_protocol import RequestPayloadError

from ..errors import error_response, method_not_allowed, unknown_url
from . import stored

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .server import Gateway


# vLLM's /v1 paths that change a replica for everyone (runtime LoRA loading, when an operator allows it): never
# a client's to call through the gateway, which would add the job's secret
MAX_DEPTH = 254   # the deepest JSON orjson writes back: deeper is a 400
UNREADABLE = (RequestPayloadError, HttpProcessingError)   # reading a body failed: bad gzip, broken chunked framing
ENGINE_ONLY = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
MODEL_PATHS = frozenset({   # vLLM's /v1 paths that take a request naming its model (POST)
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/score",
    "/v1/rerank", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/messages/count_tokens", "/v1/systemone",
    "/v1/chat/completions/batch", *(f"{p}/{r}" for p in ("/v1/chat/completions", "/v1/completions", "/v1/messages",
                                                         "/v1/responses") for r in ("render", "derender"))})
CONTROL = re.compile(r"[\x00-\x1f\x7f]")   # refused in a decoded path: "/v1/load_lora_adapter\n" matched the
# engine's route (Python's `$` matches before a trailing newline) while it passed the gateway's as another path


def canonical(path: str) -> str:
    """``path`` with its dot segments resolved, empty segments and a trailing slash dropped."""
    if "//" not in path and "/." not in path and not path.endswith("/"):
        return path
    out: list[str] = []
    for seg in path.split("/"):
        if seg == "..":
            if out:
                out.pop()
        elif seg not in ("", "."):
            out.append(seg)
    return "/" + "/".join(out)


async def read_body(request: web.BaseRequest, limit: int) -> bytes | web.Response:
    """The whole request body, or its refusal: one over ``limit`` bytes is refused before it is sent (no 100
    Continue) and its connection closed; one that cannot be read (bad gzip, broken chunked framing) is a 400."""
    try:
        if (request.content_length or 0) > limit:
            raise web.HTTPRequestEntityTooLarge(limit, request.content_length)
        if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client may now send its body
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        too_large = error_response(413, f"Request body exceeds {limit} bytes.", "invalid_request_error",
                                   "request_too_large")
        too_large.force_close()   # (what is left of its body is not read)
        return too_large
    except UNREADABLE as exc:
        return error_response(400, f"Cannot read the request body: {exc}", "invalid_request_error", "invalid_body")


def served_here(path: str) -> bool:
    """Whether a request for the decoded ``path`` is the gateway's own, not proxied: outside ``/v1``, the model
    list, the Files and Batch APIs, the engine-only paths (however spelled) and paths with control characters."""
    if path in MODEL_PATHS:   # (a generation's: the hot path)
        return False
    return (not path.startswith("/v1/") or path.startswith("/v1/models") and (len(path) == 10 or path[10] == "/")
            or path.startswith("/v1/files") and (len(path) == 9 or path[9] == "/")
            or path.startswith("/v1/batches") and (len(path) == 11 or path[11] == "/")
            or CONTROL.search(path) is not None or canonical(path) in ENGINE_ONLY)


def route_refusal(method: str, path: str, known: str) -> web.Response | None:
    """OpenAI's answer for a ``/v1`` path no engine serves (404) or a method its path does not take (405),
    whatever the body names (a request naming a model went to a replica, and its client got the engine's
    ``{"detail": "Not Found"}``); None for a route the gateway proxies."""
    if known in MODEL_PATHS:
        return None if method == "POST" else method_not_allowed(method, path, "POST")
    if known.startswith("/v1/responses/"):   # (a stored response's, by its id: GET, or its cancel's POST)
        if stored.by_id(method, known) is not None:
            return None
        parts = known.split("/")
        if len(parts) == 4 or len(parts) == 5 and parts[4] == "cancel":
            return method_not_allowed(method, path, "GET" if len(parts) == 4 else "POST")
    return unknown_url(method, path)


async def other(gw: "Gateway", request: web.BaseRequest, path: str) -> web.StreamResponse:
    """The gateway's own answer, with the client's ``x-request-id`` back (or one of its own), as a proxied one."""
    resp = await _own(gw, request, path)
    if not resp.prepared:
        resp.headers.setdefault("x-request-id", request.headers.get("x-request-id") or gw.request_id())
    return resp


async def _own(gw: "Gateway", request: web.BaseRequest, path: str) -> web.StreamResponse:
    method = request.method
    if CONTROL.search(path) is not None:
        return error_response(400, "The request path contains a control character.", "invalid_request_error",
                              "invalid_path")
    if path.startswith("/v1/files"):
        from .files import FilesApi   # the Files API: loaded by the first upload or listing
        return await FilesApi(gw).handle(request, path)
    if path.startswith("/v1/batches"):
        from ..batches import BatchStore
        from ..batchfiles import FileStore
        from .batchapi import BatchApi
        tenant = gw.tenants.identify(request.headers)
        if tenant is None:
            return gw.tenants.refusal(request.headers)
        root = Path(gw.cfg.state_dir)
        return await BatchApi(BatchStore(root / "batches"), FileStore(root / "files"), gw.tenants.budget_refusal,
                              lambda m: p.model if (p := gw.pools.resolve(m)) else None,
                              lambda owner: shard_limit(gw, owner)).handle(request, tenant, path)
    if path.startswith("/v1/models"):
        if method != "GET":
            return method_not_allowed(method, path, "GET")
        return await (list_models(gw, request) if path in ("/v1/models", "/v1/models/") else
                      get_model(gw, request, path[len("/v1/models/"):]))
    if path in ("/healthz", "/readyz"):
        if method not in ("GET", "HEAD"):
            return method_not_allowed(method, path, "GET")
        return await (healthz(gw, request) if path == "/healthz" else readyz(gw, request))
    return unknown_url(method, path)


def shard_limit(gw: "Gateway", owner: str) -> int:
    """The array tasks a key's unfinished dedicated batches may have: its own ``max_shards``, else the default."""
    policy = gw.tenants.policies.get(owner)
    if policy is not None and policy.max_shards is not None:
        return policy.max_shards
    return gw.cfg.batches.max_shards_per_key


async def healthz(gw: "Gateway", _: web.BaseRequest) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(gw: "Gateway", request: web.BaseRequest | None) -> web.Response:
    """Ready when every model the fleet wants replicas of (the routing table's desired count, the same
    number the reconciler works toward) has one READY.  The models that have none are named only to a key
    that may use them (any client of an open gateway, as its model list): a health checker needs the status
    code, and without a key the names told anyone which models exist (``/admin/status`` has them all).  An
    autoscaled model with ``min_replicas: 0`` waking from zero counts not: its requests are held meanwhile (a
    load balancer that took the whole gateway out for a cold start cut every other model's clients off)."""
    missing = [name for name, p in gw.pools.pools.items() if p.desired > 0 and not p.slots and (
        p.model.autoscale is None or p.model.autoscale.min_replicas > 0)]
    if gw.shutting_down or missing:
        out = {"status": "not ready", "shutting_down": gw.shutting_down}
        t = gw.tenants.identify(request.headers) if request is not None else None
        if t is not None:
            out["models_without_ready_replica"] = [n for n in missing if t.models is None or n in t.models]
        return web.json_response(out, status=503)
    return web.json_response({"status": "ready"})


async def list_models(gw: "Gateway", request: web.BaseRequest) -> web.Response:
    t = gw.tenants.identify(request.headers)
    if t is None:
        return gw.tenants.refusal(request.headers)
    data = [_card(gw, n, name) for n, name in gw.pools.names.items() if t.models is None or name in t.models]
    return web.json_response({"object": "list", "data": data})


def _card(gw: "Gateway", served: str, name: str) -> dict:
    """A model as vLLM's /v1/models lists it: ``created`` now (as vLLM's), and the context length its READY
    replicas say they have (``max_model_len``; clients size their prompts by it), when one has said."""
    pool = gw.pools.pools.get(name)
    lens = [s.replica.max_model_len for s in pool.slots.values()] if pool is not None else ()
    card = {"id": served, "object": "model", "created": int(time.time()), "owned_by": "slurmfleet", "root": name}
    if pool is not None and served in pool.model.lora_adapters:   # a LoRA adapter: as vLLM lists one, its base its
        card["parent"] = name                                      # parent (no path: the nodes' business)
    if lens and max(lens) > 0:
        card["max_model_len"] = min(n for n in lens if n > 0)   # (the least, while a roll changes it: it fits all)
    return card


async def get_model(gw: "Gateway", request: web.BaseRequest, name: str) -> web.Response:
    t = gw.tenants.identify(request.headers)
    if t is None:
        return gw.tenants.refusal(request.headers)
    pool = gw.pools.resolve(name)
    if pool is None or t.models is not None and pool.model.name not in t.models:
        return error_response(404, f"The model `{name}` does not exist or you do not have access to it.",
                              "invalid_request_error", "model_not_found")
    return web.json_response(_card(gw, name, pool.model.name))


class Form(dict):
    """A multipart/form-data body's ``model`` field (vLLM's audio endpoints), the rest the engine's to read; the
    body goes to the replica as it came, with its Content-Type."""

    __slots__ = ("span",)

    def renamed(self, raw: bytes, model: str) -> bytes:
        """``raw`` with the model field's value replaced by ``model`` (an alias's served name), nothing else."""
        a, b = self.span
        return raw[:a] + model.encode() + raw[b:]


def engine_fields(body: dict, model: ModelConfig, rank: int) -> bool:
    """Set what the engine must see of a JSON request; True when ``body`` changed.  vLLM's ``priority`` is
    the key's class (a client may ask for a lower one).  A ``kv_aware`` model's engine never re-announces the
    cached prefix it reuses (``vllm_xargs.kv_cache_report_mode``): the gateway's index counts every store as a
    physical copy, so a re-announcement would outlive the block's eviction."""
    changed = False
    if model.scheduling_policy == "priority" and not (type(body.get("priority")) is int and body["priority"] >= rank):
        body["priority"], changed = rank, True
    xargs = body.get("vllm_xargs")
    if model.routing == "kv_aware" and type(xargs) is dict and "kv_cache_report_mode" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
        changed = True
    return changed


def request_body(request: web.BaseRequest, raw: bytes) -> dict | web.Response:
    """A proxied request's body as the gateway reads it: a JSON object (no Content-Type, application/json or
    application/*+json, as vLLM's FastAPI reads JSON), a multipart form's model field (:class:`Form`), or the
    refusal of anything else (a body of another type is no request the engine reads)."""
    if not raw:
        return {}
    ctype = request.headers.get("Content-Type")
    if ctype is not None and ctype != "application/json":
        mt = parse_mimetype(ctype)
        if mt.type == "multipart" and mt.subtype == "form-data":
            return form(raw, mt.parameters.get("boundary"))
        if mt.type != "application" or (mt.subtype != "json" and mt.suffix != "json"):
            return error_response(415, f"Unsupported Content-Type `{ctype}`: the body must be JSON (application/json) "
                                  "or multipart/form-data.", "invalid_request_error", "unsupported_media_type")
    try:   # (after a UTF-8 byte order mark, as vLLM reads a body: PowerShell's utf8 files start with one)
        body = orjson.loads(raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw)
    except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"Malformed JSON body: {exc}", "invalid_request_error", "invalid_json")
    except RecursionError:
        return error_response(400, "Malformed JSON body: nested too deeply.", "invalid_request_error", "invalid_json")
    if not isinstance(body, dict):
        return error_response(400, "The JSON body must be an object.", "invalid_request_error", "invalid_json")
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH:   # (a body the gateway may write back: an alias, a stream's
        try:                                             # usage, a resumable one; exact and in C: a walk over a
            orjson.dumps(body)                           # list of token-id lists doubled its cost)
        except orjson.JSONEncodeError as exc:
            return error_response(400, f"Malformed JSON body: {exc} (the gateway writes JSON at most {MAX_DEPTH} "
                                  "levels deep).", "invalid_request_error", "invalid_json")
    return body


def form(raw: bytes, boundary: str | None) -> Form | web.Response:
    """The ``model`` field of a multipart/form-data body (RFC 7578), read without copying the other parts."""
    def bad(why: str) -> web.Response:
        return error_response(400, f"Malformed multipart/form-data body: {why}.", "invalid_request_error",
                              "invalid_body")
    if not boundary:
        return bad("its Content-Type has no boundary")
    out, dash = Form(), b"--" + boundary.encode("utf-8", "surrogateescape")   # (the header's bytes, as aiohttp read them)
    at = raw.find(dash)   # (after a preamble, if any)
    while at >= 0 and raw[at + len(dash):at + len(dash) + 2] != b"--":   # (up to the closing delimiter)
        start = at + len(dash)
        head_end = raw.find(b"\r\n\r\n", start)
        end = raw.find(b"\r\n" + dash, head_end)
        if head_end < 0 or end < 0:
            return bad("a part is not closed by its boundary")
        for line in raw[start:head_end].split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-disposition" and parse_content_disposition(
                    value.decode("latin-1"))[1].get("name") == "model":
                if "model" in out:   # (routed by one, served by the other: vLLM's form keeps the last)
                    return bad("it has two model fields")
                try:
                    out["model"], out.span = raw[head_end + 4:end].decode(), (head_end + 4, end)
                except UnicodeDecodeError:
                    return bad("its model field is not UTF-8")
        at = end + 2
    if at < 0:
        return bad("no closing boundary")
    return out
