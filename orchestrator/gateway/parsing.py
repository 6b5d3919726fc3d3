"""A proxied request as the gateway reads it (:func:`parse`): its body checked, the model it names (a served name,
an alias, a LoRA adapter) and the bytes its replica gets; and the same request aimed at one of its model's
``gateway.fallbacks`` when that model cannot take it (:func:`fall_back`)."""

from __future__ import annotations

import dataclasses

import orjson
from aiohttp import web

from ..errors import error_response
from . import endpoints, stored
from .headers import forwarded, strip_credentials
from .metering import ask_usage, lax_true
from .pool import ModelPool, Pools
from .resumeplan import plan
from .stitch import Spec
from .tenants import BATCHES, Tenant


class Rejected(Exception):
    """A request answered without reaching a replica (bad key, bad body, unknown model, ...)."""

    def __init__(self, response: web.Response):
        self.response = response


@dataclasses.dataclass(slots=True)
class Parsed:
    """A proxied request after parsing: what every attempt on a replica needs."""

    request: web.BaseRequest
    pool: ModelPool
    model: str
    body: dict
    raw: bytes
    head: bytes   # the request head minus the lines naming the replica and its secret
    tenant: Tenant
    resume: Spec | None = None   # a generation that can be continued on another replica
    strip_usage: bool = False    # the gateway asked for a usage (chunk, metadata header) the client did not
    usage: tuple[int, int] = (0, 0)   # prompt and completion tokens the replica reported
    metered: bool = False   # the replica's final usage came: a client that leaves after it pays exactly that
    fingerprint: str | None = None   # ... with vLLM's system_fingerprint ("" without one)
    answered: bool = False   # a replica answered (the key's usage counts the request; the gateway's refusals not)
    headers: dict | None = None   # x-ratelimit-* for the client (a limited key's)
    waited_from: float | None = None   # when it was first held (a cold start): a second hold ends with the first
    queued_s: float | None = None   # its waits in the queue for a replica, summed: its one queue_wait observation
    dead: dict[str, float] | None = None   # replicas that refused a held request's connection, and when
    slot: str = "none"   # requests_total's slot: the replica whose answer or failure the client got
    code: int | None = None   # the status it counts when not the answer's (a stream cut: 502)
    died: int = 0   # engines that died generating it (EngineDeadError), over its retries and migrations
    sent: bytes = b""   # its body as the client sent it (a fallback starts from it)
    rid: str = ""   # the id the replica gets (x-request-id)
    fallback_from: str | None = None   # the model it asked, when a fallback took it
    asked: ModelPool | None = None   # that model's pool (its fallbacks are the ones tried, in order)
    fell: int = 0   # how many of its fallbacks were tried
    pin: str | None = None   # the one replica (job id) that may take it: the one that holds the response it names
    stored: bool = False   # it reads or cancels a stored response (no tokens of its own to charge)
    stamp: stored.Stamp | None = None   # a new response's: its id, each replica's own, spliced into ``raw``
    responses: bool = False   # a POST /v1/responses (however spelled): a new response, named by the gateway
    path: str = ""   # the path as checked (endpoints.canonical: a trailing slash or an empty segment dropped)

    @property
    def unmetered(self) -> bool:
        """Its answer's tokens are not charged: a stored response read or cancelled (charged when it was made),
        or a background response (charged when it ends: :func:`.stored.follow`)."""
        return self.stored or self.stamp is not None and self.stamp.background


def parse(pools: Pools, request: web.BaseRequest, rid: str, raw: bytes, tenant: Tenant) -> Parsed:
    """The request aimed at the model it names, or :class:`Rejected` with the answer it gets instead."""
    path = endpoints.canonical(request.path)
    if (refused := endpoints.route_refusal(request.method, request.path, path)) is not None:
        raise Rejected(refused)   # (a path or method no engine serves, whatever the body names)
    if (named := stored.by_id(request.method, path)) is not None:
        return _stored(pools, request, rid, named, raw, tenant)   # (no model named: the response's replica's)
    body = endpoints.request_body(request, raw)   # a JSON object, a multipart form's model field, or a refusal
    if not isinstance(body, dict):   # (a web.Response: a MutableMapping, whose isinstance check is slow)
        raise Rejected(body)
    name = body.get("model") or request.query.get("model")
    if not isinstance(name, str) or not name:   # (a number or a list: not the model it names)
        raise Rejected(error_response(400, "`model` must be a string." if name else "The request must name a "
                                      "`model`.", "invalid_request_error", "invalid_type" if name else
                                      "missing_model", param="model"))
    pool = pools.resolve(name)
    if pool is None or tenant.models is not None and pool.model.name not in tenant.models:   # one answer for
        # both, before any other check (a 400 for a bad `stream` told a model that exists from one that does not)
        raise Rejected(error_response(404, f"The model `{name}` does not exist or you do not have access to it.",
                                      "invalid_request_error", "model_not_found"))
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:   # the engine takes 1 or "yes" for true: unmetered
        raise Rejected(error_response(400, "`stream` must be a boolean.", "invalid_request_error", "invalid_type"))
    p = Parsed(request, pool, pool.model.name, body, raw, b"", tenant, rid=rid,
               sent=raw if pool.model.gateway.fallbacks else b"",   # (kept only for a model with fallbacks)
               responses=path == stored.RESPONSES, path=path)
    if p.responses and isinstance(prev := body.get("previous_response_id"), str):   # continued where its
        # history is, or not at all
        # (or, when one of its fallbacks answered it, on that model)
        got = stored.find([pool, *_allowed(pools, tenant, pool.model.gateway.fallbacks)], tenant.name, prev)
        if got is None:
            raise Rejected(stored.not_found(prev))
        if got[0] is not pool:
            pool = got[0]
            p.pool, p.model, p.fallback_from, name, body["model"] = pool, pool.model.name, name, pool.model.name, \
                pool.model.name
            p.headers = {"x-slurmfleet-fallback-from": p.fallback_from}
        p.pin, p.sent = got[1].job_id, b""
    _aim(p, pool, name, body, raw, bool(p.fallback_from))
    return p


def _allowed(pools: Pools, tenant: Tenant, names) -> list[ModelPool]:
    """The pools of the models ``names`` (served names or aliases) that the key may use."""
    out = [pools.resolve(n) for n in names]
    return [q for q in out if q is not None and (tenant.models is None or q.model.name in tenant.models)]


def _stored(pools: Pools, request: web.BaseRequest, rid: str, named: str, raw: bytes, tenant: Tenant) -> Parsed:
    """A request for stored response ``named``, pinned to the replica that holds it for this key, as it came."""
    got = stored.find(_allowed(pools, tenant, pools.pools), tenant.name, named)
    if got is None:
        raise Rejected(stored.not_found(named))
    pool, slot = got
    if request.method == "GET" and not all(a.isascii() and a.isdigit() for a in request.query.getall(
            "starting_after", ())):
        raise Rejected(error_response(   # (vLLM indexes a replay's events by it: a negative one replays them twice,
            400, "'starting_after' must be an event's sequence number: an integer of 0 or more.",   # out of order)
            "invalid_request_error", "invalid_value", param="starting_after"))
    # the path as checked (an id of the gateway's: hex), not as sent (dot segments), with the client's query
    target = _target(f"{stored.RESPONSES}/{named}{'/cancel' if request.method == 'POST' else ''}", request)
    return Parsed(request, pool, pool.model.name, {}, raw, _head(request, target, rid, raw), tenant, rid=rid,
                  pin=slot.job_id, stored=True, path=target.partition("?")[0])


def _target(path: str, request: web.BaseRequest) -> str:
    """The request target a replica gets: ``path`` as the gateway checked it, with the client's query (less the
    credentials in it)."""
    query = request.raw_path.partition("?")[2]
    return strip_credentials(f"{path}?{query}") if query else path


def _head(request: web.BaseRequest, target: str, rid: str, raw: bytes, json: bool = False) -> bytes:
    """The request head a replica gets (less the lines naming the replica and its secret): the client's own
    header lines but for the gateway's (:func:`.headers.forwarded`), and the body's length."""
    head = f"{request.method} {target} HTTP/1.1\r\nx-request-id: {rid}\r\n".encode() + forwarded(
        request.raw_headers, json)
    if raw or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        head += b"Content-Length: %d\r\n" % len(raw)
    return head


def _aim(p: Parsed, pool: ModelPool, name: str, body: dict, raw: bytes, dirty: bool) -> None:
    """Point ``p`` at ``pool``'s model, which the client named ``name``: the body and head its replicas get."""
    model = pool.model.name
    request = p.request
    if name != model and "model" in body and name not in pool.model.lora_adapters:   # an alias: the engine
        # knows the served name alone
        body["model"], dirty = model, True
    form = type(body) is endpoints.Form   # relayed as it came (vLLM's audio endpoints have no priority)
    if not form and endpoints.engine_fields(body, pool.model, p.tenant.rank):   # (priority, kv_aware's fields)
        dirty = True
    resume = None if form else plan(p.path, body, pool.model, pool.gen_limits)
    strip = False
    if resume is not None:  # ask the replica for what a continuation needs
        resume, upstream_body = resume
        raw = orjson.dumps(upstream_body)
    else:
        dirty, strip = ask_usage(p.path, body, dirty)   # (the key is charged the replica's usage)
        if responses := p.responses and not form:
            body.pop("request_id", None)   # (its id, each replica's own, see .stored: the body's last string)
            body["request_id"], dirty = stored.PLACEHOLDER, True
        if dirty:
            raw = body.renamed(raw, model) if form else orjson.dumps(body)
        p.stamp = stored.Stamp(raw, p.tenant.name, lax_true(body.get("background"))) if responses else None
    # (a trailing slash or an empty segment dropped: vLLM's redirect for one named the replica's host and port)
    head = _head(request, _target(p.path, request), p.rid, raw, bool(raw) and not form)
    p.pool, p.model, p.body, p.raw, p.head, p.resume, p.strip_usage = pool, model, body, raw, head, resume, strip


def fall_back(pools: Pools, p: Parsed) -> str | None:
    """Aim ``p``, which its model could not take (no replica in its wait, its queue full, none to come), at the
    next of the asked model's ``gateway.fallbacks`` (in their order, after the one that could not take it
    either) that has a READY replica and that the key may use; the name of that model, or None (no fallback
    left; or none at all: a batch line, a multipart form, a request naming a LoRA adapter).  Each fallback's own
    wait and queue hold; a fallback's own fallbacks are not tried."""
    asked = p.asked or p.pool
    if (not p.sent or p.tenant.name == BATCHES or type(p.body) is endpoints.Form
            or p.fallback_from is None and p.body.get("model") in asked.model.lora_adapters):   # (an adapter's
        return None   # answer is its own)
    names = asked.model.gateway.fallbacks
    while p.fell < len(names):
        name = names[p.fell]
        p.fell += 1
        pool = pools.resolve(name)
        if pool is None or pool is asked or pool is p.pool or not pool.slots or (
                p.tenant.models is not None and pool.model.name not in p.tenant.models):
            continue
        body = endpoints.request_body(p.request, p.sent)   # the client's body again (not the first model's fields)
        if isinstance(body, web.Response) or "model" not in body:
            return None
        if pools.kv is not None:   # (what kv_aware kept of it for the model it tried goes)
            pools.kv.forget(p.model, p.body)
        first = p.fallback_from or p.model
        p.fallback_from, p.asked, body["model"] = first, asked, name
        p.headers = {**(p.headers or {}), "x-slurmfleet-fallback-from": first}
        p.waited_from = p.dead = None
        _aim(p, pool, name, body, p.sent, True)
        return p.model
    return None
