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
from .pacing import WHOLE_PIECE, PacedBody, send
from .upstream import Response, UpstreamFailed, UpstreamTimeout

if TYPE_CHECKING:
    from .pool import Lease
    from .server import Parsed

log = logging.getLogger("orchestrator.gateway.server")
USAGE = b'"usage"'
# a whole answer's choice that vLLM aborted (its engine shutting down: SIGTERM at its default --shutdown-timeout 0),
# as vLLM writes it (compact JSON; a quote in a text is escaped, so no text matches it)
ABORTED = b'"finish_reason":"abort"'
FINISH = b'"finish_reason":"'   # (vLLM's compact JSON: a choice's end, not its null before)


TRUE_WORDS = frozenset({"1", "true", "t", "yes", "y", "on"})


def lax_true(v) -> bool:
    """Whether vLLM's request models (pydantic's lax bool) read ``v`` as true: ``"false"``, ``0``, ``"no"`` are false."""
    return v is True or (type(v) in (int, float) and v == 1) or (isinstance(v, str) and v.lower() in TRUE_WORDS)


STREAM_USAGE = ("/v1/completions", "/v1/chat/completions")   # (resume's COMPLETIONS and CHAT)


def ask_usage(path: str, body: dict, dirty: bool) -> tuple[bool, bool]:
    """Have the replica tell the usage the key is charged even where the client did not ask for it: a stream's
    usage chunk (``stream_options.include_usage``, a real true: vLLM reads "false", 0, "no" as false) or, for
    ``encoding_format: "bytes_only"`` embeddings, the ``metadata`` header of ``"bytes"`` (the same vectors).
    Whether the body changed (was ``dirty`` or is now) and whether that usage is to be taken out of the client's
    answer (the client sees the usage chunk if it asked for it)."""
    if body.get("encoding_format") == "bytes_only":
        body["encoding_format"] = "bytes"
        return True, True
    opts = body.get("stream_options")
    asked = opts.get("include_usage") if isinstance(opts, dict) else None
    if body.get("stream") is True and path in STREAM_USAGE and asked is not True and (opts is None or
                                                                                     isinstance(opts, dict)):
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        if strip := not lax_true(asked):   # (vLLM's continuous usage comes only with include_usage: not asked for)
            body["stream_options"].pop("continuous_usage_stats", None)
        return True, strip
    return dirty, False


WHOLE_PARSE_BYTES = 65536   # a longer answer (embeddings, prompt_logprobs) is not parsed whole on the event loop


def usage_in_body(p: "Parsed", data: bytes) -> None:
    """The top-level ``usage`` of a whole JSON response: a short one parsed whole; in a long one (a 40 MB batch of
    embeddings took 0.2 s to parse, every stream of the process stalled meanwhile) the last ``"usage"`` that is a
    key (``"usage":{``; a prompt token's text ``"usage"`` in ``prompt_logprobs`` after it is a value, and quotes
    inside a text are escaped), and only its object is decoded."""
    if USAGE not in data:
        return
    if len(data) <= WHOLE_PARSE_BYTES:
        try:
            obj = orjson.loads(data)
        except ValueError:
            return
        return take_usage(p, obj.get("usage")) if isinstance(obj, dict) else None
    end = len(data)
    while (at := data.rfind(USAGE, 0, end)) >= 0:
        rest = data[at + 7:at + 4096].decode("utf-8", "replace").lstrip()
        if rest[:1] == ":" and rest[1:].lstrip()[:1] == "{":
            try:
                return take_usage(p, json.JSONDecoder().raw_decode(rest[1:].lstrip())[0])
            except ValueError:
                return
        end = at


def usage_in_metadata(p: "Parsed", meta: str) -> None:
    """The usage in the ``metadata`` header of vLLM's ``encoding_format: "bytes"`` embeddings (their body is the
    vectors): JSON whose ``usage`` comes last, after the layout of every vector; only that object is decoded."""
    at = meta.rfind('"usage"')
    rest = meta[at + 7:].lstrip() if at >= 0 else ""
    if rest[:1] == ":":
        try:
            take_usage(p, json.JSONDecoder().raw_decode(rest[1:].lstrip())[0])
        except ValueError:
            pass


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


def first_answer(stats, model: str, info: dict, t0: float) -> None:
    """The client's first byte: time to first token (and the cold start's, when the request was held)."""
    ttft = time.monotonic() - t0
    info["ttft_s"] = round(ttft, 4)
    stats.hist("ttft", model).observe(ttft)
    if "cold" in info:
        stats.hist("cold_start", model).observe(ttft)


def take_usage(p: "Parsed", usage) -> None:
    """Count a replica's ``usage`` object for the request's key: OpenAI's ``prompt/completion_tokens``, or the
    Responses and Anthropic Messages APIs' ``input/output_tokens``; a number it leaves out stays as it was (a
    Messages stream tells the input tokens first, the output tokens later)."""
    if isinstance(usage, dict):
        pt = usage.get("prompt_tokens", usage.get("input_tokens"))
        ct = usage.get("completion_tokens", usage.get("output_tokens"))
        p.usage = (pt if type(pt) is int else p.usage[0], ct if type(ct) is int else p.usage[1])


def _event_usage(obj: dict):
    """The usage an SSE event's object carries: its own (chat, completions, a Messages ``message_delta``), a
    Responses ``response.completed``'s response's, or a Messages ``message_start``'s message's."""
    usage = obj.get("usage")
    for inner in ("response", "message"):
        if not usage and isinstance(obj.get(inner), dict):
            usage = obj[inner].get("usage")
    return usage


LAST_COUNT = (None, "response.completed", "response.incomplete", "response.failed", "message_delta")
"""The ``type`` of an event whose usage is the request's last count: an OpenAI usage chunk (no type, no choices),
a Responses stream's end (completed, incomplete or failed), a Messages ``message_delta``."""


def meter_events(p: "Parsed", events: bytes) -> bytes:
    """Whole SSE events: take the usage chunk's numbers; drop that chunk when only the gateway wanted it."""
    kept = []
    for ev in events.split(b"\n\n"):
        at = ev.find(b"data:") if USAGE in ev else -1   # (after an `event:` line, in the Responses and Messages APIs)
        if at >= 0 and (at == 0 or ev[at - 1:at] == b"\n"):
            try:
                obj = orjson.loads(ev[at + 5:])
            except ValueError:
                obj = None
            usage = _event_usage(obj) if isinstance(obj, dict) else None
            if usage and obj.get("choices"):   # continuous usage: one prompt's and choice's so far, a floor
                ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
                p.usage = (p.usage[0], max(p.usage[1], ct)) if type(ct) is int else p.usage
            elif usage:
                take_usage(p, usage)
                if not obj.get("choices") and obj.get("type") in LAST_COUNT:
                    p.metered, p.fingerprint = True, obj.get("system_fingerprint") or ""
                if p.strip_usage and obj.get("usage") and not obj.get("choices"):
                    continue
        kept.append(ev)
    return b"\n\n".join(kept)


def finish_held(p: "Parsed", events: bytes) -> tuple[bytes, bytes]:
    """A stream's whole events to send now, and those to hold back: vLLM puts its ``system_fingerprint`` on a
    stream's last chunk when the stream did not ask for usage, else on the usage chunk; the gateway asked for it
    and drops that chunk, so the last chunk waits for it (it comes at once) and gets its fingerprint."""
    if p.fingerprint is not None:   # the usage chunk came (with no fingerprint: vLLM's --fingerprint-mode off)
        return b"\n\n".join(stamp(ev, p.fingerprint) if p.fingerprint and FINISH in ev else ev
                            for ev in events.split(b"\n\n")), b""
    at = events.find(FINISH)
    if at < 0:
        return events, b""
    start = events.rfind(b"\n\n", 0, at) + 2   # where the finish event begins (1: the first one)
    return (events[:start], events[start:]) if start > 1 else (b"", events)


def stamp(event: bytes, fingerprint: str) -> bytes:
    at = event.find(b"data:")
    try:
        obj = orjson.loads(event[at + 5:])
    except ValueError:
        return event
    return event[:at] + b"data: " + orjson.dumps({**obj, "system_fingerprint": fingerprint}) if isinstance(
        obj, dict) else event


TOKENIZE_CHAT = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                 "chat_template_kwargs", "documents", "add_special_tokens", "mm_processor_kwargs")


def charge_sent(gw, p: "Parsed", sent: int, slot) -> None:
    """A stream that ended before the replica's count (its client left, its replica failed): its key pays at least
    a token per event it was sent, and its prompt as ``slot``'s replica counts it, once that is known."""
    k = [p.body.get("stream_interval"), p.pool.model.vllm_args.get("stream-interval")]   # (the request's or the
    k = max([1] + [int(x) for x in k if type(x) in (int, str) and str(x).isdigit()])     # engine's: tokens an event)
    p.usage = (p.usage[0], max(p.usage[1], sent * k))
    if p.usage[0] == 0:
        gw.later(charge_prompt(gw, p, slot))


async def charge_prompt(gw, p: "Parsed", slot) -> None:
    """The prompt tokens of a request its client left before the usage came, counted by the replica's own
    ``/tokenize`` (vLLM's, on by default: a chat's messages, the first 16 texts of a prompt or input) or from the
    token ids it was given, and charged to the request's key after the request ended (what was counted, if the
    gateway stops meanwhile).  What cannot be counted so (a Responses input of items, texts past the 16th, a
    replica that does not answer) is charged a token per 4 bytes of its JSON: a prompt is never free for a
    client that leaves early."""
    b = p.body
    if isinstance(b.get("messages"), list):   # (part, its /tokenize query or None): a chat is its own query
        chat = {"model": p.model, **{k: b[k] for k in TOKENIZE_CHAT if k in b}}
        items: list = [(chat, chat)]
    else:
        whole = b.get("prompt", b.get("input"))   # (a completion's prompt; an embedding's or a response's input)
        parts = [whole] if isinstance(whole, str) or _ids(whole) else whole if isinstance(whole, list) else []
        items = [(x, {"model": p.model, "prompt": x} if isinstance(x, str) and i < 16 else None)
                 for i, x in enumerate(parts)]
    total, guess = 0, 0   # (guess: bytes of what is estimated, divided once)
    try:
        for part, query in items:
            count = len(part) if _ids(part) else await _tokenize(gw, p, slot, query) if query is not None else None
            if count is None:
                guess += len(orjson.dumps(part))
            else:
                total += count
    finally:
        if total + guess > 0:
            p.tenant.charge_prompt(p.model, total + -(-guess // 4))


def _ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


async def _tokenize(gw, p: "Parsed", slot, query: dict) -> int | None:
    raw = orjson.dumps(query)
    ep = slot.replica.endpoint
    head = (f"POST /tokenize HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
            ).encode() + slot.tail()
    resp = None
    try:
        resp = await gw.upstream.request(ep.host, ep.port, head, raw, first_byte_timeout_s=10.0, total_timeout_s=10.0)
        data = await resp.read()
        count = orjson.loads(data).get("count") if resp.status == 200 else None
        resp.release()
    except BaseException as exc:  # noqa: BLE001 - a replica gone or an engine without it: estimated
        if resp is not None:
            resp.close()   # (cancelled at shutdown too: its connection is not left to the sweeper, gone by then)
        if not isinstance(exc, Exception):
            raise
        log.info("could not count the prompt of a request its client left (%s/%s): %s", p.model, slot.label, exc)
        return None
    return count if type(count) is int and count >= 0 else None


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
    if not sse and upstream.content_length is not None:
        # a complete JSON document: read it whole (SSE is never buffered)
        try:
            data = await upstream.read()
        except UpstreamFailed as exc:  # nothing reached the client yet: another replica may answer
            log.warning("replica %s/%s failed mid-response: %s", model, label, exc)
            if isinstance(exc, UpstreamTimeout):   # the request's whole time spent (the engine may be just busy):
                lease.ok = None                    # not another try, as an answer whose headers never came
                return failure(exc)
            lease.ok = False
            return Retry("reset", failure(exc), True)
        if upstream.status == 200 and ABORTED in data:   # cut short, a 200 all the same: nothing reached the
            lease.ok = False                                # client yet, another replica may answer it whole
            log.warning("replica %s/%s aborted a request (shutting down)", model, label)
            return Retry("abort", error_response(502, "The replica aborted the request (it was shutting down).",
                                                 "bad_gateway", "upstream_error"), True)
        lease.first_byte()
        stats.hist("ttft", model).observe(time.monotonic() - t0)
        if "cold" in info:
            stats.hist("cold_start", model).observe(time.monotonic() - t0)
        if upstream.status == 200:
            usage_in_body(p, data)
        if len(data) <= WHOLE_PIECE:
            return web.Response(status=upstream.status, body=data, headers=out_headers)
        return web.Response(status=upstream.status, body=PacedBody(data, gw.cfg.gateway.stream_idle_timeout_s),
                            headers=out_headers)
    resp = web.StreamResponse(status=upstream.status, headers=out_headers)
    if sse:
        resp.headers["Cache-Control"] = "no-cache"
    first = True
    carry = b""
    sent = 0   # events the client was sent (a client that leaves is charged one token each)
    held, hold = b"", sse and p.strip_usage and (p.body.get("n") or 1) == 1   # (finish_held: n > 1 ends apart)
    idle_s = gw.cfg.gateway.stream_idle_timeout_s
    try:
        async for chunk in upstream.iter_chunks():
            if first:
                first = False
                await resp.prepare(request)
            n = 1
            if sse:   # whole events only, so the usage chunk can be read (and dropped)
                if carry:
                    chunk, carry = carry + chunk, b""
                cut = chunk.rfind(b"\n\n") + 2   # (1: no event ends in it yet, however short it is)
                if cut < len(chunk) or cut == 1:
                    chunk, carry = (chunk[:cut], chunk[cut:]) if cut > 1 else (b"", chunk)
                if USAGE in chunk:
                    chunk = meter_events(p, chunk)
                if hold:
                    chunk, held = finish_held(p, held + chunk)
                if not chunk:
                    continue
                n = chunk.count(b"\n\n") - comments(chunk)   # events (JSON escapes a newline: only their ends are
                sent += n                                       # raw), keep-alives not
            if n and info["ttft_s"] is None:   # the first answer, not a keep-alive: the prefill is done
                lease.first_byte()
                first_answer(stats, model, info, t0)
            await send(request, resp, chunk, idle_s)
        if held or carry:
            await send(request, resp, held + carry, idle_s)
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
        if sse:
            # what it was sent is charged, as a client that leaves pays (the replica's count never came); its prompt
            # counted by another replica of the model when there is one (this one failed)
            charge_sent(gw, p, sent, next((s for s in p.pool.slots.values() if s is not lease.slot and s.routed),
                                          lease.slot))
            # an event cut in two is dropped (its half and the error on one line: no JSON an SDK can read); a
            # Messages stream's error is its own `event: error` (the anthropic SDK ignores an unnamed one)
            await resp.write(held + stream_error(info.get("path") == "/v1/messages"))
            await resp.write_eof()
        elif request.transport is not None:
            # a non-SSE body cut short: break the connection so the client never sees a truncated success
            request.transport.close()
        return resp
    if sse and not p.metered and upstream.status == 200 and request.path in STREAM_USAGE:   # the count asked for
        charge_sent(gw, p, sent, lease.slot)   # did not come: the engine ended it with its own error event
    try:
        if first:
            await resp.prepare(request)
        await send(request, resp, b"", idle_s, eof=True)
    except ConnectionResetError:  # the client left as the answer ended: nothing to abort, nothing to log
        pass
    return resp


def stream_error(messages: bool) -> bytes:
    """The event that ends a stream whose replica failed mid-way: OpenAI's error object (the openai SDK raises
    ``APIError``), or for the Messages API Anthropic's ``error`` event."""
    msg = "The replica failed mid-stream."
    if messages:
        return b"event: error\ndata: " + json.dumps({"type": "error", "error": {
            "type": "api_error", "message": msg}}).encode() + b"\n\n"
    return b"data: " + json.dumps({"error": {"message": msg, "type": "upstream_error", "param": None,
                                             "code": "502"}}).encode() + b"\n\n"


def relay_refusal(p: "Parsed", upstream: Response, text: bytes) -> web.Response:
    """A replica's refusal (429, 5xx) for the client: its OpenAI error as it is (or the gateway's), with its
    Retry-After (a 429 without one gets 1 s) and the key's x-ratelimit headers."""
    status = upstream.status
    headers = dict(p.headers or {})
    after = upstream.headers.get("retry-after") or ("1" if status == 429 else None)   # (SDKs back off by their
    if after:                                                                          # own rule without one)
        headers["Retry-After"] = after
    try:
        body = orjson.loads(text)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return web.json_response(body, status=status, headers=headers)
    except ValueError:
        pass
    return error_response(status, f"Upstream returned {status}.", "upstream_error", headers=headers)
