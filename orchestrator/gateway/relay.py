"""A replica's response to the client, as it is (requests that are not continued on another replica, see
:mod:`orchestrator.gateway.resume` for those), metering the tokens it used on the way.

Tokens come from the replica's own ``usage``: the JSON body's, or, for a stream, the usage chunk the
gateway asked for (``stream_options.include_usage``, added when the client did not ask: that chunk is then
taken out of the client's stream).  A stream is relayed event-aligned: each write carries whole events
(an event cut between two reads waits for its end), so the usage chunk can be found and dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from ..errors import error_response
from .headers import end_to_end
from .retry import Retry
from .streamend import end_when_over, watched
from .pacing import WHOLE_PIECE, PacedBody, send
from .metering import (STREAM_USAGE, USAGE, charge_sent, choices, finish_held, meter_events, usage_in_body,
                       usage_in_metadata)
from .upstream import Response
from .upstreamerrors import UpstreamFailed, UpstreamTimeout

if TYPE_CHECKING:
    from .pool import Lease
    from .parsing import Parsed

log = logging.getLogger("orchestrator.gateway.server")
# a whole answer's choice that vLLM aborted (its engine shutting down: SIGTERM at its default --shutdown-timeout 0),
# as vLLM writes it (compact JSON; a quote in a text is escaped, so no text matches it)
ABORTED = b'"finish_reason":"abort"'
DONE = b"data: [DONE]"


def tokenless(events: bytes) -> bool:
    """Whether these whole SSE events carry no token, no end and no error: a chat's role chunk (sent when its first
    output comes, which for a request aborted before a token is the abort), a usage chunk, comments, ``[DONE]``."""
    for ev in events.split(b"\n\n"):
        if not ev.startswith(b"data: {"):
            if ev and ev[:1] != b":" and ev != DONE:
                return False
            continue
        try:
            obj = orjson.loads(ev[6:])
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):   # (an error event)
            return False
        for c in obj["choices"]:
            d = c.get("delta") if isinstance(c, dict) else None
            if not isinstance(d, dict) or c.get("finish_reason") is not None or c.get("logprobs") or \
                    d.get("content") or d.get("tool_calls") or d.get("reasoning_content") or d.get("reasoning"):
                return False
    return True


def aborted(lease: "Lease", model: str, label: str) -> Retry:
    """An answer its engine aborted (shutting down) before anything of it reached the client: another replica
    may answer it whole."""
    lease.ok = False
    log.warning("replica %s/%s aborted a request (shutting down)", model, label)
    return Retry("abort", error_response(502, "The replica aborted the request (it was shutting down).",
                                         "bad_gateway", "upstream_error"), True)


def failure(exc: UpstreamFailed) -> web.Response:
    """The answer to a replica that failed before the client got a byte: 504 when it timed out, else 502."""
    if isinstance(exc, UpstreamTimeout):
        return error_response(504, "The replica did not answer in time.", "gateway_timeout", "upstream_timeout")
    return error_response(502, "Replica failed before responding.", "bad_gateway", "upstream_error")


def comments(events: bytes) -> int:
    """How many of these whole SSE events are comments alone: vLLM's ``: keep-alive`` (``--sse-keep-alive-interval``,
    while a stream is queued, prefilling or between tokens), for the client's proxies, no token, not a first byte."""
    if events[:1] != b":" and b"\n\n:" not in events:
        return 0
    return sum(1 for ev in events.split(b"\n\n") if ev and all(ln[:1] == b":" for ln in ev.split(b"\n")))


def first_answer(stats, model: str, info: dict, t0: float, cold: bool = True) -> None:
    """The first token's event: time to first token (and the cold start's, when the request was held and
    ``cold``: the client's first byte)."""
    ttft = time.monotonic() - t0
    info["ttft_s"] = round(ttft, 4)
    stats.hist("ttft", model).observe(ttft)
    if cold and "cold" in info:
        stats.hist("cold_start", model).observe(ttft)


async def relay(gw, p: "Parsed", lease: "Lease", upstream: Response, info: dict, t0: float):
    """The replica's response to the client: a JSON body whole (a failure while reading it, or an answer its
    engine aborted, is a :class:`Retry`), anything else chunk by chunk.  A failure sets the lease's outcome to
    failed."""
    model, label, request, stats = p.model, lease.slot.label, p.request, gw.stats
    ctype = upstream.content_type or "application/json"
    out_headers = end_to_end(upstream.raw_headers)   # the replica's, under the gateway's own
    out_headers["Content-Type"], out_headers["x-request-id"] = ctype, info["request_id"]
    if p.headers:
        out_headers.update(p.headers)
    if upstream.status == 200 and "metadata" in out_headers:   # vLLM's bytes embeddings: usage in a header
        usage_in_metadata(p, out_headers.popone("metadata") if p.strip_usage else out_headers["metadata"])
    sse = "text/event-stream" in ctype
    if not sse and (upstream.content_length is not None or upstream.status >= 400):
        # a complete JSON document (an error too): read it whole (SSE is never buffered)
        try:
            data = await upstream.read()
        except UpstreamFailed as exc:  # nothing reached the client yet: another replica may answer
            log.warning("replica %s/%s failed mid-response: %s", model, label, exc)
            if isinstance(exc, UpstreamTimeout):   # the request's whole time spent (the engine may be just busy):
                lease.ok = None                    # not another try, as an answer whose headers never came
                return failure(exc)
            lease.ok = False
            return Retry("reset", failure(exc), True)
        if upstream.status == 200 and ABORTED in data:   # cut short, a 200 all the same
            return aborted(lease, model, label)
        lease.first_byte()   # (a whole answer: its time is the request's duration, not a first token's)
        if "cold" in info:
            stats.hist("cold_start", model).observe(time.monotonic() - t0)
        if upstream.status >= 400 and (shaped := openai_error(p, upstream.status, data, dict(p.headers or {}))):
            return shaped   # (in OpenAI's shape, whatever the replica's was)
        if upstream.status == 200:
            usage_in_body(p, data)
        if len(data) <= WHOLE_PIECE:
            return web.Response(status=upstream.status, body=data, headers=out_headers)
        return web.Response(status=upstream.status, body=PacedBody(data, p.pool.limits.stream_idle_timeout_s),
                            headers=out_headers)
    resp = web.StreamResponse(status=upstream.status, headers=out_headers)
    if sse:
        resp.headers["Cache-Control"] = "no-cache"
    carry = b""
    sent = 0   # events the client was sent (a client that leaves is charged one token each)
    ends = choices(p.body) if sse and p.strip_usage else None   # (finish_held: only the last choice's end waits)
    held, hold, passing = b"", ends is not None, (ends or 1) - 1
    errored = False   # the engine ended the stream with an error event of its own
    # a generation's stream: vLLM's end of one it aborted before a token is [DONE] with no token nor finish before it
    begun, early = not (sse and p.path in STREAM_USAGE), b""   # (early: its events before a token, held back)
    idle_s = p.pool.limits.stream_idle_timeout_s
    # a background response's events: ended by the gateway when it is cancelled or failed (its engine never does)
    ender = asyncio.ensure_future(end_when_over(gw, upstream, lease.slot, rid)) if sse and (
        rid := watched(p)) is not None else None
    try:
        async for chunk in upstream.iter_chunks():
            n = 1
            if sse:   # whole events only, so the usage chunk can be read (and dropped)
                if carry:
                    chunk, carry = carry + chunk, b""
                cut = chunk.rfind(b"\n\n") + 2   # (1: no event ends in it yet, however short it is)
                if cut < len(chunk) or cut == 1:
                    chunk, carry = (chunk[:cut], chunk[cut:]) if cut > 1 else (b"", chunk)
                if not begun:   # (a token, an end or an error begins the answer: how it ends is the engine's)
                    begun = not tokenless(chunk)
                    if not begun and DONE in chunk:
                        if resp.prepared:   # (keep-alives went out) the client gets a failed stream's error event
                            raise UpstreamFailed("the engine aborted the request before its first token")
                        upstream.close()
                        return aborted(lease, model, label)
                    if not begun and not resp.prepared and not comments(chunk):
                        early += chunk   # a chat's role chunk, a usage chunk: no answer yet, nothing sent
                        continue
                if early:
                    chunk, early = early + chunk, b""
                if USAGE in chunk:
                    chunk = meter_events(p, chunk)
                if hold:
                    chunk, held, passing = finish_held(p, held + chunk, passing)
                errored = errored or b'data: {"error"' in chunk
                if not chunk:
                    continue
                n = chunk.count(b"\n\n") - comments(chunk)   # events (JSON escapes a newline: only their ends are
                sent += n                                       # raw), keep-alives not
            if n and info["ttft_s"] is None:   # the first answer, not a keep-alive: the prefill is done
                lease.first_byte()
                first_answer(stats, model, info, t0)
            if not resp.prepared:
                await resp.prepare(request)
            await send(request, resp, chunk, idle_s)
        if early or held or carry:
            if not resp.prepared:
                await resp.prepare(request)
            await send(request, resp, early + held + carry, idle_s)
    except (ConnectionResetError, asyncio.CancelledError):
        # the client went away: closing the upstream response makes vLLM abort the request
        upstream.close()
        if p.metered:   # after the stream's last count: it had it all (the openai SDK may close at [DONE])
            p.code = upstream.status
            raise
        if sse:   # the output count comes last (a Messages stream says 1 in its message_start)
            charge_sent(gw, p, sent, lease.slot)
        stats.count("stream_aborts", model, "client")
        raise   # (a 499)
    except UpstreamFailed as exc:
        upstream.close()
        lease.ok = False
        log.warning("replica %s/%s failed mid-response: %s", model, label, exc)
        if not resp.prepared:   # its headers came (vLLM's do before the first token), nothing reached the client:
            return Retry("timeout" if isinstance(exc, UpstreamTimeout) else "reset",   # another replica may answer
                         failure(exc), not isinstance(exc, UpstreamTimeout))
        stats.count("stream_aborts", model, "upstream")
        p.code = 502   # (the client's answer began a 200)
        if sse and not p.metered:
            # what it was sent is charged, as a client that leaves pays (the replica's count never came); its prompt
            # counted by another replica of the model when there is one (this one failed)
            charge_sent(gw, p, sent, next((s for s in p.pool.slots.values() if s is not lease.slot and s.routed),
                                          lease.slot))
        if sse:
            # an event cut in two is dropped (its half and the error on one line: no JSON an SDK can read); a
            # Messages stream's error is its own `event: error` (the anthropic SDK ignores an unnamed one)
            await send(request, resp, held + stream_error(p.path), idle_s, eof=True)
        elif request.transport is not None:
            # a non-SSE body cut short: break the connection so the client never sees a truncated success
            request.transport.close()
        return resp
    finally:
        if ender is not None:
            ender.cancel()
    if errored and sent > 2 and not p.metered and p.path in STREAM_USAGE:   # the count asked for did not come:
        charge_sent(gw, p, sent - 2, lease.slot)   # the engine ended it with its error event and [DONE] (no tokens)
    try:
        if not resp.prepared:
            await resp.prepare(request)
        await send(request, resp, b"", idle_s, eof=True)
    except ConnectionResetError:  # the client left as the answer ended: nothing to abort, nothing to log
        pass
    return resp


def stream_error(path: str) -> bytes:
    """The event that ends a stream (to ``path``, as checked) whose replica failed mid-way: OpenAI's error object
    (the openai SDK raises ``APIError``), then a completion's ``[DONE]`` as vLLM ends one with an error; for the
    Messages API Anthropic's ``error`` event."""
    msg = "The replica failed mid-stream."
    if path == "/v1/messages":
        return b"event: error\ndata: " + json.dumps({"type": "error", "error": {
            "type": "api_error", "message": msg}}).encode() + b"\n\n"
    return b"data: " + json.dumps({"error": {"message": msg, "type": "upstream_error", "param": None, "code": "502"}
                                   }).encode() + b"\n\n" + (b"data: [DONE]\n\n" if path in STREAM_USAGE else b"")


def relay_refusal(p: "Parsed", upstream: Response, text: bytes) -> web.Response:
    """A replica's refusal (429, 5xx) or error for the client in OpenAI's shape (:func:`openai_error`), with its
    Retry-After (a 429 without one gets 1 s) and the key's x-ratelimit headers."""
    status = upstream.status
    headers = dict(p.headers or {})
    after = upstream.headers.get("retry-after") or ("1" if status == 429 else None)   # (SDKs back off by their
    if after:                                                                          # own rule without one)
        headers["Retry-After"] = after
    return openai_error(p, status, text, headers) or web.Response(
        status=status, body=text, content_type="application/json", headers=headers)


def openai_error(p: "Parsed", status: int, text: bytes, headers: dict) -> web.Response | None:
    """A replica's error body in OpenAI's shape, ``{"error": {message, type, param, code}}``, or None when it is in
    it already (vLLM's own): its older top-level ``{"object": "error", ...}`` nested, anything else the gateway's
    saying what came (an engine's failure is an empty 500; a path the model does not serve, FastAPI's
    ``{"detail": "Not Found"}``)."""
    try:
        body = orjson.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return None
        if body.get("object") == "error" and isinstance(body.get("message"), str):
            return error_response(status, body["message"], str(body.get("type") or "upstream_error"),
                                  str(body.get("code") or status), headers, body.get("param"))
        if status == 404 and body.get("detail") == "Not Found":   # (vLLM serves a task's paths only)
            return error_response(404, f"The model `{p.model}` does not serve {p.path}.", "invalid_request_error",
                                  "unsupported_endpoint", headers, "model")
    said = body.get("detail") if isinstance(body, dict) else text.decode("utf-8", "replace").strip()
    said = said if isinstance(said, str) else json.dumps(said)[:500]
    return error_response(status, f"The replica answered {status}" + (f": {said[:500]}" if said else
                                                                      " with no body") + ".",
                          "invalid_request_error" if status < 500 and status != 429 else "upstream_error", headers=headers)
