"""The end of a background response's event stream that its engine never sends.

vLLM streams a background response (``POST /v1/responses`` with ``background`` and ``stream``) and replays one
(``GET /v1/responses/{id}?stream=true``) from its store of the response's events, until the event
``response.completed``.  A response cancelled (``POST .../cancel``) or failed gets no such event: its stream
would stay open, silent, until the gateway's ``stream_idle_timeout_s`` cut it with an error, holding a slot of
the key's ``max_concurrent`` meanwhile.  So while such a stream is relayed the gateway looks at the response on
its replica (after 1 s, then 1.5x as long, up to 10 s apart), and ends the stream once the response has ended
and the replica has sent nothing for a moment with the relay caught up: the client gets every event the replica
sent, then the stream's end, as for a response that completed.  (vLLM sets ``failed`` only on a background
response not streamed; a background stream whose generation fails stays ``queued`` there, and its stream ends at
``stream_idle_timeout_s``.)

A cancelled response keeps no usage in vLLM, yet what it generated before the cancel is in its event log (a
stream's), which its client may have read and can still replay: :func:`generated` counts it for the charge.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import orjson

from .enginecall import call_engine
from .metering import tokenized
from .stored import FOLLOW_FIRST_S, FOLLOW_MAX_S, RESPONSES
from .upstreamerrors import UpstreamError

if TYPE_CHECKING:
    from .parsing import Parsed
    from .pool import Slot
    from .upstream import Response

log = logging.getLogger("orchestrator.gateway.server")

UNENDED = frozenset({"cancelled", "failed"})   # a response's status whose stream the engine never ends
LOG_MAX_BYTES = 64 << 20   # a cancelled response's event log read for its count, at most
QUIET_S = 0.5   # the events a replica sent before its response ended are relayed first: it is silent this long


def watched(p: "Parsed") -> str | None:
    """The response whose event stream this request gets from its replica (a background one's), or None."""
    if p.stamp is not None:
        return p.stamp.last[1] if p.stamp.background and p.body.get("stream") is True and p.stamp.last else None
    if p.stored and p.request.method == "GET":
        return p.path.split("/")[3]
    return None


async def end_when_over(gw, upstream: "Response", slot: "Slot", rid: str) -> None:
    """Look at response ``rid`` on its replica while ``upstream`` relays its events; end ``upstream`` (its body
    read to here, as if complete) once the response is cancelled or failed and the stream is quiet.  A look that
    fails is tried again later (a replica gone fails the stream itself); cancelled when the stream ends."""
    wait, status = FOLLOW_FIRST_S, None
    while status not in UNENDED:
        await asyncio.sleep(wait)
        wait = min(FOLLOW_MAX_S, wait * 1.5)
        try:
            code, data = await call_engine(gw.upstream, slot, f"{RESPONSES}/{rid}", None, 10.0)
        except Exception:   # noqa: BLE001 - busy, or gone: looked at again later
            continue
        if code == 404:   # (the replica no longer has it: restarted, its stream ends with it)
            return
        status = data.get("status") if isinstance(data, dict) else None
    while not upstream.quiet(QUIET_S):   # (a slow client: the events before the end still go out)
        await asyncio.sleep(QUIET_S / 2)
    log.info("ended the event stream of %s response %s on %s (its engine never ends it)", status, rid, slot.label)
    upstream.stop()


async def generated(gw, slot: "Slot", rid: str, model: str) -> int:
    """Output tokens in the event log of response ``rid`` (a background stream's) on its replica: its events
    replayed until the replica falls silent (a cancelled one's replay never ends), the text of their deltas
    counted by the replica's ``/tokenize`` (a token per 4 bytes when it cannot).  0 when it has none."""
    ep, body = slot.replica.endpoint, bytearray()
    try:
        resp = await gw.upstream.request(ep.host, ep.port, f"GET {RESPONSES}/{rid}?stream=true HTTP/1.1\r\n".encode()
                                         + slot.tail(), first_byte_timeout_s=10.0, total_timeout_s=60.0,
                                         stream_idle_timeout_s=QUIET_S * 2)
    except UpstreamError:
        return 0
    try:
        if resp.status == 200 and "text/event-stream" in (resp.content_type or ""):
            async for chunk in resp.iter_chunks():
                body += chunk
                if len(body) > LOG_MAX_BYTES:
                    break
    except UpstreamError:   # (silent: the log read whole)
        pass
    finally:
        resp.close()
    out = "".join(_delta(ln) for ln in bytes(body).split(b"\n") if ln.startswith(b"data: {") and b'.delta"' in ln)
    if not out:
        return 0
    count = await tokenized(gw, slot, {"model": model, "prompt": out, "add_special_tokens": False})
    return count if count is not None else -(-len(out.encode()) // 4)


def _delta(line: bytes) -> str:
    """The text an event line's delta adds (``response.output_text.delta``, a reasoning or arguments delta)."""
    try:
        d = orjson.loads(line[6:]).get("delta")
    except (ValueError, AttributeError):
        return ""
    return d if isinstance(d, str) else ""
