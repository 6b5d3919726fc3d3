"""Generations that survive their replica: a stream cut off (reset, EOF without ``[DONE]``, timeout, an engine
error event, vLLM's ``abort`` at its shutdown) or moved off a draining replica continues on another READY replica
of the model, from exactly the tokens already produced, and the client sees one stream.

How: the gateway asks the replica for its token ids (``return_token_ids``) and usage, and keeps them; to
continue, it sends ``/v1/completions`` with ``prompt`` = prompt ids + generated ids, ``max_tokens`` = what is
left and the request's sampling options, and rewrites the continuation into the client's stream (same ``id``
and ``created``, its shape, choice index 0; token fields and the usage chunk only when asked for; the final
``usage`` counts every generated token).  A request not streamed is streamed from the replica and handed to the
client as one JSON body, so it can be continued too.  Exactly continued: greedy decoding; a sampled one as a valid
sample of the rest (not continued: :mod:`.resumeplan`).  :mod:`.stitch` renders it; :mod:`.seam` cuts whole characters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from ..errors import NO_RETRY, error_response
from .pool import Lease, NoReplica, QueueFull
from .pacing import send
from .metering import charge_prompt
from .relay import first_answer
from .resumeplan import Elsewhere
from .seam import settle
from .retry import RESETS_TRIED, Retry
from .stitch import Break, Refused, Spec, Stitch
from .tenants import BATCHES
from .upstreamerrors import ConnectFailed, UpstreamFailed, UpstreamTimeout

log = logging.getLogger("orchestrator.gateway.server")

if TYPE_CHECKING:
    from .parsing import Parsed
    from .server import Gateway
    from .upstream import Response

COMPLETIONS = "/v1/completions"


async def relay(gw: "Gateway", p: "Parsed", lease: "Lease", upstream: "Response", info: dict, t0: float
                ) -> web.StreamResponse:
    """Relay a resumable generation to the client, continuing it on other replicas while it breaks."""
    spec: Spec = p.resume
    st = Stitch(spec)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                      "x-request-id": info["request_id"], **(p.headers or {})}) if spec.stream else None
    resp, left, late = None, False, False
    try:
        work = _relay(gw, p, lease, upstream, info, t0, st, out)   # (not streamed: due whole within the request's
        resp = await (work if out is not None else _due(work, st, p.pool.limits.request_timeout_s))   # time)
        return resp
    except TimeoutError:   # as the same answer without resume: a 504, its key charged what the replica made (its
        late = True        # prompt at least: never free); one that produced nothing is tried elsewhere
        answer = error_response(504, "The replica did not answer in time.", "gateway_timeout", "upstream_timeout")
        return answer if st.prompt_ids is not None or st.ids else Retry("timeout", answer)
    except (asyncio.CancelledError, ConnectionResetError):
        left = True   # the client left: its key pays for what the replica made for it (a stream: what it was sent)
        raise
    finally:
        # the key is charged what the client got: a stream begun, or a whole answer (not a 502 it will retry)
        got = out.prepared if out is not None else left or late or isinstance(resp, web.StreamResponse) and \
            resp.status == 200
        if got and (st.prompt_tokens is not None or st.prompt_ids is not None or st.ids):
            u = st.usage()
            p.usage = (u["prompt_tokens"], u["completion_tokens"])
        elif (left or late) and p.usage[0] == 0 and p.tenant.name != BATCHES:   # (before its first token: the
            gw.later(charge_prompt(gw, p, lease.slot))   # prompt the replica prefilled, as without resume)


async def _relay(gw: "Gateway", p: "Parsed", lease: "Lease", upstream: "Response", info: dict, t0: float,
                 st: Stitch, out: web.StreamResponse | None) -> web.StreamResponse:
    rcfg = p.pool.model.resume
    model, request, stats = p.model, p.request, gw.stats
    tried = Elsewhere(p.pool, lease.slot.replica.engine, {lease.slot.job_id})
    moves = 0
    continuation = False
    nxt = None
    stayed = False   # (counted once: a stream that stays looks again now and then)
    movable = True   # False once the rest cannot be moved at all (migrations spent, nothing left to continue)

    async def move(taken: "Lease | None"):
        """Off a draining replica, only once another has taken the rest: (lease, response), or None (the stream
        stays where it is for now, which the drain waits for; the attempts spend no migration).  ``taken``: a
        lease the stream's wait in the background got (tried first), else a replica with room now."""
        nonlocal moves, stayed, movable
        before = moves
        if taken is not None and not taken.slot.routed:   # (that replica started draining meanwhile)
            _give_back(taken)
            taken = None
        while st.finish is None:   # (a generation complete but for its [DONE] has nothing to move)
            body = st.continuation_body(model)
            if moves >= rcfg.max_migrations or body is None or (st.left() is not None and st.left() <= 0):
                movable = movable and moves > before
                break
            moves += 1
            try:
                got = await _continue(gw, p, body, tried, info["upstream_id"], False, taken, st)
            except Exception:  # noqa: BLE001 - whatever it was, the stream goes on where it is
                log.exception("moving a stream off draining replica %s/%s", model, lease.slot.label)
                got = None
            taken = None
            if not isinstance(got, str):   # (a string: that replica failed at once: try another)
                if got is not None:
                    return got
                break
        if taken is not None:   # (nothing to move after all)
            _give_back(taken)
        moves = before
        if not stayed:
            stayed = True
            stats.count("migrations", model, "drain", "stayed")
        return None

    while True:
        try:
            await _pump(upstream, lease, st, continuation, out, request, rcfg.drain_grace_s,
                        p.pool.limits.stream_idle_timeout_s, stats, model, info, t0, move,
                        lambda: _wait_for_replica(p, st, tried) if movable else None)
            upstream.release_at_end()
            lease.ok = True
            lease.release()
            break
        except Break as b:
            cause, nxt = b.cause, b.nxt
        except Refused as r:
            upstream.close()
            lease.ok = None   # the replica is fine: the request was bad
            lease.release()
            return await _refused(p, r.obj, out, {"x-request-id": info["request_id"], **(p.headers or {})},
                                  p.pool.limits.stream_idle_timeout_s)
        except UpstreamFailed as exc:
            cause = "timeout" if isinstance(exc, UpstreamTimeout) else "reset"
            if out is None and cause == "timeout" and time.monotonic() - t0 >= p.pool.limits.request_timeout_s:
                upstream.close()   # (not streamed: the request's own deadline, met upstream a moment before _due's:
                lease.ok = False   # as _due's, not a move that would run past it)
                lease.release()
                st.late = True
                raise TimeoutError from None
        except BaseException as exc:   # the client went away (a 499), or a fault: the engine aborts the generation
            upstream.close()
            lease.ok = False if st.late else None   # (its whole time spent: the replica failed it, as a timeout)
            lease.release()    # (after a move this lease is ours alone to give back)
            if isinstance(exc, (ConnectionResetError, asyncio.CancelledError)) and not st.late:
                stats.count("stream_aborts", model, "client")
            raise
        upstream.close()
        p.died += cause == "engine_error"   # (engines that said they died generating it: a prompt that kills them?)
        lease.ok = None if cause == "drain" else False
        _release(lease, stats, model)
        if st.finish is not None or st.ran_out(lease.slot.replica.max_model_len):   # only its end was lost: complete
            break
        start = not continuation and st.prompt_ids is None   # nothing known: it can only start again
        if nxt is None and start and (out is None or not out.prepared):
            # and nothing sent: an ordinary retry from scratch may still serve it
            return Retry(cause, error_response(502, "Replica failed before responding.", "bad_gateway",
                                               "upstream_error"), cause != "timeout")
        start = start and info["ttft_s"] is None   # (only keep-alives sent: the request as first sent, elsewhere)
        if start:   # begun anew: on any engine, and goes on on the one it gets
            tried.engine = ""
        while nxt is None:
            body = None if start else st.continuation_body(model)
            spent = moves >= rcfg.max_migrations or p.died >= RESETS_TRIED   # (as a retry after two replicas dropped it)
            if spent or body is None and not start or st.left() is not None and st.left() <= 0:
                stats.count("migrations", model, cause, "exhausted" if body or start else "impossible")
                return await _fail(p, out, stats, cause, p.pool.limits.stream_idle_timeout_s)
            moves += 1
            try:
                nxt = await _continue(gw, p, body, tried, info["upstream_id"], st=st)
            except asyncio.CancelledError:   # the client left while its stream waited for a replica
                stats.count("stream_aborts", model, "client")
                raise
            if nxt is None:
                stats.count("migrations", model, cause, "no_replica")
                return await _fail(p, out, stats, cause, p.pool.limits.stream_idle_timeout_s)
            if isinstance(nxt, str):   # that replica failed at once too: try another while moves are left
                nxt = None
        stats.count("migrations", model, cause, "ok")
        lease, upstream = nxt
        tried.engine = tried.engine or lease.slot.replica.engine
        p.slot, nxt = lease.slot.label, None
        st.cut()
        continuation = not start
        info["migrations"] = moves
    if out is None:   # (its first token was counted as it came)
        if "cold" in info:
            stats.hist("cold_start", model).observe(time.monotonic() - t0)
        return web.json_response(st.whole(), headers={"x-request-id": info["request_id"], **(p.headers or {})})
    if not out.prepared:
        await out.prepare(request)
    last = b""
    for chunk in st.ending():   # (the finish chunk, held for the fingerprint, may be its first answer)
        if info["ttft_s"] is None:
            first_answer(stats, model, info, t0)
        last += b"data: " + orjson.dumps(chunk) + b"\n\n"
    await send(request, out, last + b"data: [DONE]\n\n", p.pool.limits.stream_idle_timeout_s, eof=True)
    return out


async def _pump(upstream: "Response", lease: "Lease", st: Stitch, continuation: bool, out: web.StreamResponse | None,
                request: web.BaseRequest, grace_s: float, idle_s: float, stats, model: str, info: dict, t0: float, move,
                wait_for_replica) -> None:
    """Read one replica's SSE events into ``st`` (and to the client when it streams) until ``[DONE]``; once its
    replica has been draining for ``grace_s``, ``move()`` opens the rest elsewhere (a :class:`Break` carrying
    it), or says there is nowhere to go: the stream stays; the first time, it waits for a replica in the
    background (``wait_for_replica()``, a task, or None) while it goes on where it is, for ``replica_wait_s``
    (the time a broken stream waits), then looks again now and then."""
    buf = b""
    slot = lease.slot
    retry_at = 0.0
    waiter: asyncio.Task | None = None
    waited = False
    try:
        async for data in upstream.iter_chunks():
            buf += data
            while (i := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:i], buf[i + 2:]
                if event[:1] == b":":   # a comment (vLLM's keep-alive): the client's, for its proxies' read timeouts
                    if out is not None:   # (not a token, not a first byte)
                        if not out.prepared:
                            await out.prepare(request)
                        await send(request, out, event + b"\n\n", idle_s)
                    continue
                if not event.startswith(b"data:"):
                    continue
                if lease.prefill:
                    lease.first_byte()
                payload = event[5:].strip()
                if payload == b"[DONE]":
                    if st.finish is None:   # vLLM's end of a request it aborted before a token (at its shutdown)
                        raise Break("abort")
                    return
                try:
                    obj = orjson.loads(payload)
                except ValueError:
                    raise Break("engine_error") from None
                for chunk in st.take(obj, continuation):
                    if info["ttft_s"] is None:   # (not streamed: the client's first byte is the whole answer's)
                        first_answer(stats, model, info, t0, out is not None)
                    if out is not None:
                        if not out.prepared:
                            await out.prepare(request)
                        await send(request, out, b"data: " + orjson.dumps(chunk) + b"\n\n", idle_s)
                if st.aborted:   # its engine aborted it (shutting down): the rest moves, as after a failure
                    st.aborted = False
                    raise Break("abort")
            if not slot.routed and (now := time.monotonic()) >= slot.unrouted_at + grace_s:
                taken = None
                if waiter is not None and waiter.done():   # the wait in the background ended
                    taken, waiter = _taken(waiter), None
                if taken is not None or (waiter is None and now >= retry_at):
                    nxt = await move(taken)   # its replica is draining: move the rest, once it can go
                    if nxt is not None:
                        raise Break("drain", nxt)
                    retry_at = time.monotonic() + max(grace_s, 1.0)   # nowhere yet: look again now and then
                    if not waited:   # and, the first time, wait for one meanwhile
                        waited, waiter = True, wait_for_replica()
            elif slot.routed and waiter is not None:   # its drain was called off: no need to move
                _drop(waiter)
                waiter = None
        raise Break("eof")
    finally:
        if waiter is not None:   # a lease it got after all goes back
            _drop(waiter)


async def _due(work, st: Stitch, limit_s: float):
    """``work``'s result within ``limit_s``, else TimeoutError once it is cancelled (``st.late`` set first: its
    clean-up counts a timeout, not a client gone); a client that leaves meanwhile cancels it too."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit_s)
    except BaseException:   # (the client left: its work stops with it, as a client gone)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if not done:
        st.late = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise TimeoutError
    return task.result()


def _wait_for_replica(p: "Parsed", st: Stitch, tried: set[str]) -> asyncio.Task:
    """A draining replica's stream that found nowhere to go waits for a replica with room in the background,
    ahead of the queued requests (a generation under way goes first), for ``replica_wait_s``."""
    body = st.continuation_body(p.model) or {}
    task = asyncio.ensure_future(p.pool.acquire(body, p.request.headers, tried, p.pool.model.resume.replica_wait_s, -1,
                                                p.tenant.name))
    task.add_done_callback(lambda _: _forget(p, body))
    return task


def _forget(p: "Parsed", body: dict) -> None:
    """A continuation's body has been routed: kv_aware's tokenized prompt of it (which keeps it alive) goes."""
    if (kv := p.pool.owner.kv) is not None:
        kv.forget(p.pool.model.name, body)


def _taken(waiter: asyncio.Task | None) -> "Lease | None":
    """The lease a background wait got (None: none yet, or it ended without one)."""
    if waiter is None or not waiter.done() or waiter.cancelled():
        return None
    exc = waiter.exception()
    if exc is not None and not isinstance(exc, (NoReplica, QueueFull)):
        log.error("waiting for a replica to move a stream to failed", exc_info=exc)
    return None if exc is not None else waiter.result()


def _give_back(got: "asyncio.Task | Lease") -> None:
    """A lease not used (or a background wait's, if it got one) back to its replica, as nothing happened."""
    lease = _taken(got) if isinstance(got, asyncio.Future) else got
    if lease is not None:
        lease.ok = None
        lease.release()


def _drop(waiter: asyncio.Task) -> None:
    """Stop a background wait: a lease it got goes back now (free for the next in line), or when it ends."""
    if waiter.done():
        _give_back(waiter)
    else:
        waiter.cancel()
        waiter.add_done_callback(_give_back)


def _release(lease: "Lease", stats, model: str) -> None:
    """Give the lease back; an outcome that ejected its replica is counted and logged, as the proxy does."""
    if lease.release():
        stats.count("ejections", model)
        log.warning("ejected replica %s/%s after repeated failures", model, lease.slot.label)


async def _continue(gw: "Gateway", p: "Parsed", body: dict | None, tried: set[str], rid: str = "", wait: bool = True,
                    lease: "Lease | None" = None, st: Stitch | None = None):
    """A lease (``lease``, or one taken now) and a streaming response for the continuation on another replica
    (``body`` None: the request as first sent); None when no replica is available (within ``replica_wait_s`` when
    ``wait``), a string when the one tried failed at once or cannot take it (the caller tries another).  The
    continuation of ``st`` starts before a last event's half character (:mod:`.seam`)."""
    pool, route = p.pool, p.body if body is None else body
    try:
        lease = lease or pool.try_acquire(route, p.request.headers, tried)
        if lease is None and wait:   # a generation under way goes first
            lease = await pool.acquire(route, p.request.headers, tried, pool.model.resume.replica_wait_s,
                                       -1, p.tenant.name)
    except (NoReplica, QueueFull):
        return None
    finally:
        if body is not None:
            _forget(p, body)
    if lease is None:
        return None
    tried.add(lease.slot.job_id)
    ep = lease.slot.replica.endpoint
    if st is not None and body is not None and st.merged > 1:
        try:
            await settle(gw, lease, st, p.model, rid)
        except BaseException:   # (the client left meanwhile)
            lease.release()
            raise
        body = st.continuation_body(p.model)   # (from this replica's answer: a body made for another's may be off)
    if body is not None and body.get("max_tokens") is None:   # to the end of the context (vLLM clamps a number
        if not lease.slot.replica.max_model_len:   # up to its max_model_len; more is a 400, none would stop at 16)
            lease.ok = None
            lease.release()
            return "max_model_len not known"
        body = {**body, "max_tokens": lease.slot.replica.max_model_len}
    raw = p.raw if body is None else orjson.dumps(body)
    head = (p.head if body is None else f"POST {COMPLETIONS} HTTP/1.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nx-request-id: {rid}\r\n".encode()) + lease.slot.tail()
    gwc = p.pool.limits
    try:
        resp = await gw.upstream.request(ep.host, ep.port, head, raw, first_byte_timeout_s=gwc.first_byte_timeout_s,
                                         total_timeout_s=gwc.request_timeout_s,
                                         stream_idle_timeout_s=gwc.stream_idle_timeout_s)
    except (ConnectFailed, UpstreamFailed) as exc:
        lease.ok = False
        _release(lease, gw.stats, p.model)
        return type(exc).__name__
    except BaseException:   # cancelled (the client left) while connecting
        lease.release()
        raise
    if resp.status != 200 or "text/event-stream" not in (resp.content_type or ""):
        resp.close()
        lease.ok = False if resp.status >= 500 else None
        _release(lease, gw.stats, p.model)
        return f"status {resp.status}"
    return lease, resp


async def _refused(p: "Parsed", obj: dict, out: web.StreamResponse | None, headers: dict, idle_s: float
                   ) -> web.StreamResponse:
    """The engine's own error for the request, as the engine sends it: its status when nothing was sent yet
    (with the request id and the key's rate-limit headers, as any answer), the status counted all the same.  (A
    stream's last writes are timed as its others: a client that stopped reading is let go after ``idle_s``.)"""
    status = p.code = obj["error"]["code"]
    if out is None or not out.prepared:
        return web.json_response(obj, status=status, headers=headers)
    await send(p.request, out, b"data: " + orjson.dumps(obj) + b"\n\ndata: [DONE]\n\n", idle_s, eof=True)
    return out


async def _fail(p: "Parsed", out: web.StreamResponse | None, stats, cause: str, idle_s: float) -> web.StreamResponse:
    """The generation cannot go on: the clean error of a stream cut short (or a 502 when nothing was sent)."""
    stats.count("stream_aborts", p.model, "upstream")
    p.code = 502
    if out is None or not out.prepared:   # (one two replicas dropped: not sent again by the SDK, dropped_twice)
        return error_response(502, f"The replica failed mid-generation ({cause}) and it could not be continued.",
                              "bad_gateway", "upstream_error", NO_RETRY if p.died >= RESETS_TRIED else None)
    err = {"error": {"message": f"The replica failed mid-stream ({cause}) and it could not be continued.",
                     "type": "upstream_error", "param": None, "code": "502"}}   # (then [DONE], as vLLM ends one)
    await send(p.request, out, f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode(), idle_s, eof=True)
    return out
