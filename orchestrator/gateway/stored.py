"""The Responses API's stored responses through the gateway: each one lives in the memory of the replica that
made it (vLLM's store, ``VLLM_ENABLE_RESPONSES_API_STORE=1``), so a request that reads it (``GET
/v1/responses/{id}``, a background response polled), cancels it (``POST /v1/responses/{id}/cancel``) or
continues it (``previous_response_id``) must reach that replica, and only for the key that made it.

No table of ids is kept anywhere: the gateway names every response itself.  A ``POST /v1/responses`` goes to
its replica with ``request_id`` (vLLM's extension, the response's id; a client's own is replaced) set to
``resp_`` + 16 random hex digits + the first 32 hex digits of an HMAC-SHA256, keyed by that replica's job
secret, of the key's name and those digits.  A request that names a response is pinned to the READY replica
whose secret gives its HMAC for the request's key: a gateway worker, a restarted daemon and a re-adopted
replica all find it, another key's request finds nothing (vLLM's 404, as for an id that never was), and a
response whose replica has ended is gone with it (404 too).  Each attempt of a request (a retry on another
replica) gets the id of the replica it goes to: the id is as long for every replica, spliced into the body
the gateway made once.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import re
import secrets
import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from ..contract import Background
from ..errors import error_response

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .parsing import Parsed
    from .pool import ModelPool, Slot

log = logging.getLogger("orchestrator.gateway.server")

RESPONSES = "/v1/responses"
ID = re.compile(r"resp_([0-9a-f]{16})([0-9a-f]{32})")
PLACEHOLDER = "resp_" + "0" * 48   # the id's place in the body made once (the same length as every id)
BYTES = f'"{PLACEHOLDER}"'.encode()


def by_id(method: str, path: str) -> str | None:
    """The response a request names by its path (``GET /v1/responses/{id}``, ``POST .../{id}/cancel``), or None."""
    if not path.startswith("/v1/responses/"):   # (every proxied request asks)
        return None
    parts = path.split("/")   # ["", "v1", "responses", id, ...]
    if len(parts) == 4 and method == "GET" or len(parts) == 5 and parts[4] == "cancel" and method == "POST":
        return parts[3] or None
    return None


def response_id(secret: str, key: str, nonce: str) -> str:
    return f"resp_{nonce}{_mac(secret, key, nonce)}"


def _mac(secret: str, key: str, nonce: str) -> str:
    return hmac.new(secret.encode(), f"{key}\0{nonce}".encode(), hashlib.sha256).hexdigest()[:32]


def find(pools: "Iterable[ModelPool]", key: str, rid: str) -> "tuple[ModelPool, Slot] | None":
    """The first of ``pools`` with a READY replica that holds response ``rid`` of key ``key``, and that replica;
    None when none does (or ``rid`` is no id of the gateway's)."""
    m = ID.fullmatch(rid)
    if m is None:
        return None
    for pool in pools:
        for slot in pool.slots.values():
            if hmac.compare_digest(_mac(slot.replica.endpoint.secret, key, m[1]), m[2]):
                return pool, slot
    return None


def not_found(rid: str) -> web.Response:
    """vLLM's answer for an unknown id (the gateway's for one it cannot place, or another key's)."""
    return error_response(404, f"Response with id '{rid}' not found.", "invalid_request_error", "response_not_found",
                          param="response_id")


class Stamp:
    """Where a ``POST /v1/responses`` body made once takes its id, and the random part of it; the replica it went
    to last and the id it had there (the one a background response is followed by)."""

    __slots__ = ("at", "nonce", "key", "background", "last")

    def __init__(self, raw: bytes, key: str, background: bool):
        self.at, self.nonce, self.key, self.background = raw.rfind(BYTES) + 1, secrets.token_hex(8), key, background
        self.last: tuple[Slot, str] | None = None

    def body(self, raw: bytes, slot: "Slot") -> bytes:
        """``raw`` with the id this replica's response gets."""
        rid = response_id(slot.replica.endpoint.secret, self.key, self.nonce)
        self.last = (slot, rid)
        return raw[:self.at] + rid.encode() + raw[self.at + len(PLACEHOLDER):]


ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})
FOLLOW_FIRST_S, FOLLOW_MAX_S = 1.0, 10.0   # looks at a background response: after 1 s, then 1.5x as long, up to 10 s
FOLLOW_FOR_S = 24 * 3600.0   # at most this long (a replica's time limit ends it sooner)
ADOPT_WAIT_S = 300.0   # a response taken over waits this long for its replica in the table (a daemon just started)
CANCELLED = "cancelled"   # what _watch says of a response cancelled before its end
CHARGED_KEEP = 10_000   # the background responses a process charged that its usage spool can list


class Following:
    """The background responses this gateway process follows, not charged yet (its report lists them: the fleet
    hands them to another process when this one is gone, :mod:`orchestrator.fleet.background`), and those it took
    over (a table lists one until the fleet sees it taken: it is started once)."""

    __slots__ = ("now", "taken", "charged", "declined")

    def __init__(self) -> None:
        self.now: dict[str, Background] = {}
        self.taken: set[str] = set()
        # handed to this process as it stops (not followed): listed in its reports to its end, so the fleet hands
        # them out again once it is gone (a report without one on the table that handed it says "charged")
        self.declined: dict[str, Background] = {}
        # the last ones it charged: its usage spool lists them, should its daemon die (the next one must not)
        self.charged: collections.deque[str] = collections.deque(maxlen=CHARGED_KEEP)

    def settle(self, rid: str) -> None:
        """Charged (or found never stored): no longer reported."""
        if self.now.pop(rid, None) is not None:
            self.charged.append(rid)

    def report(self) -> tuple[Background, ...]:
        return (*self.now.values(), *self.declined.values()) if self.declined else tuple(self.now.values())


def start(gw, p: "Parsed") -> None:
    """A background response answered: followed to its end, and listed in the process's reports until charged."""
    slot, rid = p.stamp.last
    guess = -(-len(orjson.dumps(p.body.get("input", ""))) // 4)
    b = gw.following.now[rid] = Background(rid, p.tenant.name, p.model, slot.replica.job_id, guess)
    gw.later(follow(gw, p, b, slot))
    gw.on_follow()   # (a worker reports it at once: were it killed now, the fleet would hand it to another)


def take(gw, table) -> None:
    """Follow the background responses ``table`` hands this process (their process is gone), each once: not one
    it charged already (its report lacks it: the fleet takes it as charged)."""
    mine = {b.rid: b for b in table.adopt.get(gw.process, ())}
    gw.following.taken &= mine.keys()   # (one the table no longer lists is settled: it never comes back)
    if gw.shutting_down:   # left to the process or daemon after it: reported until this one is gone
        for rid, b in mine.items():
            if rid not in gw.following.taken and rid not in gw.following.now and rid not in gw.following.charged:
                gw.following.declined[rid] = b
        return
    took = False
    for rid, b in mine.items():
        if rid not in gw.following.taken and rid not in gw.following.now:
            gw.following.taken.add(rid)
            if rid in gw.following.charged:   # (handed out again: a late spool of the process it was taken from)
                log.warning("background response %s handed to this process again: charged already, not again", rid)
                continue
            gw.following.now[rid] = b
            gw.later(adopted(gw, b))
            took = True
            log.info("took over background response %s of key %s on job %s", rid, b.key, b.job_id)
    if took:
        gw.on_follow()


def _tokens(use: dict, name: str) -> int:
    v = use.get(name)
    return v if type(v) is int and v > 0 else 0


async def _watch(gw, slot: "Slot", rid: str) -> dict | bool | None:
    """Look at response ``rid`` on its replica until it ends: the usage it ends with; :data:`CANCELLED` when it
    was cancelled (vLLM keeps no usage then); None when it ended otherwise without one, its replica is gone or it
    ran past :data:`FOLLOW_FOR_S`; False when the replica does not know it (never stored: its POST was refused,
    or the engine keeps no store)."""
    from .enginecall import call_engine
    deadline, wait = time.monotonic() + FOLLOW_FOR_S, FOLLOW_FIRST_S
    while time.monotonic() < deadline:
        await asyncio.sleep(wait)
        wait = min(FOLLOW_MAX_S, wait * 1.5)
        try:
            status, data = await call_engine(gw.upstream, slot, f"{RESPONSES}/{rid}", None, 10.0)
        except Exception as exc:   # noqa: BLE001 - the replica gone: the response with it
            log.info("background response %s on %s not followed further: %s", rid, slot.label, exc)
            return None
        if status == 404:
            return False
        if status != 200 or not isinstance(data, dict):
            return None
        if data.get("status") in ENDED:
            use = data.get("usage")
            return use if isinstance(use, dict) else CANCELLED if data["status"] == "cancelled" else None
    return None


async def follow(gw, p: "Parsed", b: Background, slot: "Slot") -> None:
    """A background response followed to its end on its replica (the answer to its POST is ``queued``, with no
    usage; its stream, if it asked for one, may be left by its client while vLLM goes on): its key is charged
    the usage it ends with, as a response answered at once is, and it counts in the key's requests in flight
    (``max_concurrent``) until then.  One that ends without usage (cancelled: vLLM keeps no output), whose
    replica is gone, or still going after :data:`FOLLOW_FOR_S`, is charged its prompt.  One this process stops
    following before its end (it stops, or dies) stays in its last report: another process, or the next daemon's,
    takes it over (:func:`adopted`).  Its replica counts it in flight meanwhile (a lease: the engine generates it,
    so a scale-down takes another replica first, and a drain waits for it)."""
    from .metering import charge_prompt
    from .pool import Lease
    from .streamend import generated
    p.tenant.inflight += 1
    lease = Lease(slot, p.pool)
    try:
        use = await _watch(gw, slot, b.rid)
        # a cancelled stream's output is in its event log (its client read it, and may replay it): counted there
        out = await generated(gw, slot, b.rid, p.model) if use == CANCELLED and p.body.get("stream") is True else 0
        if use is None or use == CANCELLED:   # (a Responses input is counted by one /tokenize, or estimated
            await charge_prompt(gw, p, slot)   # without one: cancelled in it, nothing is charged, another process
            p.tenant.charge_prompt(p.model, 0, out)   # charges it)
        elif use is not False:
            p.tenant.charge_prompt(p.model, _tokens(use, "input_tokens"), _tokens(use, "output_tokens"))
        gw.following.settle(b.rid)   # (with its charge, in one step: the next report has both)
    finally:
        p.tenant.inflight -= 1
        lease.release()


async def adopted(gw, b: Background) -> None:
    """:func:`follow` for a background response taken over from a process that is gone: its replica found by job
    id (waited for up to :data:`ADOPT_WAIT_S`: a daemon just started routes on no replica yet), its key by name
    (one a reload removed is still charged), its prompt charged by :attr:`Background.prompt_guess`."""
    from .pool import Lease
    tenant = gw.tenants.named(b.key)
    tenant.inflight += 1
    lease = None
    try:
        slot, until = None, time.monotonic() + ADOPT_WAIT_S
        while (found := _slot(gw, b.job_id)) is None and time.monotonic() < until:
            await asyncio.sleep(1.0)
        if found is not None:
            lease = Lease(found[1], found[0])   # (in flight on its replica, as :func:`follow`'s)
            slot = found[1]
        use = await _watch(gw, slot, b.rid) if slot is not None else None
        if isinstance(use, dict):
            tenant.charge_prompt(b.model, _tokens(use, "input_tokens"), _tokens(use, "output_tokens"))
        elif use is None or use == CANCELLED:   # (a cancelled one's output: its event log's, if it was a stream)
            from .streamend import generated
            out = await generated(gw, slot, b.rid, b.model) if use == CANCELLED else 0
            tenant.charge_prompt(b.model, b.prompt_guess, out)
            log.info("background response %s of key %s charged its prompt (about %d tokens): %s", b.rid, b.key,
                     b.prompt_guess, "its replica is gone" if slot is None else "it ended without usage")
        gw.following.settle(b.rid)
    finally:
        tenant.inflight -= 1
        if lease is not None:
            lease.release()


def _slot(gw, job_id: str) -> "tuple[ModelPool, Slot] | None":
    for pool in gw.pools.pools.values():
        if (slot := pool.slots.get(job_id)) is not None:
            return pool, slot
    return None


class Only(set):
    """The replicas a pinned request may not go to: every one but ``job`` (and ``job`` once it failed there)."""

    def __init__(self, job: str):
        super().__init__()
        self.job = job

    def __contains__(self, job_id) -> bool:
        return job_id != self.job or set.__contains__(self, job_id)

    def __bool__(self) -> bool:   # (the pool looks only when a request excludes any)
        return True
