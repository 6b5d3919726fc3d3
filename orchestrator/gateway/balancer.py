"""Routing policies, in one registry that the config's validation reads.

A policy is a class registered under its config name with :func:`policy`; each model's pool makes
one instance (``POLICIES[name](rng)``) and calls ``choose(candidates, body, headers)`` with two or
more routable replicas.  A candidate is anything with ``job_id``, ``inflight`` and ``load`` (an
:class:`~orchestrator.contract.EngineLoad`): the pool's slots, or plain test objects.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar


class Candidate(Protocol):
    job_id: str
    inflight: int
    load: Any


C = TypeVar("C", bound=Candidate)


class Policy(Protocol):
    def __init__(self, rng: random.Random) -> None: ...
    def choose(self, cands: Sequence[C], body: dict, headers: Mapping[str, str]) -> C: ...


POLICIES: dict[str, type[Policy]] = {}
# a policy sees only choices of two or more replicas, unless its class sets ``sees_every_request`` (it counts)
DEFAULT_POLICY = "least_outstanding"


def policy(name: str) -> Callable[[type], type]:
    """Register a policy class under the name the YAML's ``routing`` uses."""
    def register(cls: type) -> type:
        POLICIES[name] = cls
        cls.name = name
        cls.sees_every_request = getattr(cls, "sees_every_request", False)
        return cls
    return register


@policy("least_outstanding")
class LeastOutstanding:
    """Power of two choices on the gateway's in-flight requests."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, cands, body, headers):
        a, b = self.rng.sample(cands, 2) if len(cands) > 2 else cands
        if a.inflight == b.inflight:
            return a if self.rng.random() < 0.5 else b
        return a if a.inflight < b.inflight else b


@policy("round_robin")
class RoundRobin:
    """Each replica in turn, in job-id order."""

    def __init__(self, rng: random.Random):
        self.counter = 0

    def choose(self, cands, body, headers):
        self.counter += 1
        return sorted(cands, key=lambda c: c.job_id)[self.counter % len(cands)]


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@policy("prefix_affinity")
class PrefixAffinity:
    """Consistent hashing of a session header, ``user`` or the prompt's start, with bounded load: the
    key's home replica unless it carries more than ``load_factor`` x the average, then the next replica
    clockwise that does not."""

    load_factor, vnodes = 1.25, 64

    def __init__(self, rng: random.Random):
        self._ring_for: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []

    def choose(self, cands, body, headers):
        keys = tuple(sorted(c.job_id for c in cands))
        if keys != self._ring_for:
            self._ring_for = keys
            self._ring = sorted((_h(f"{k}#{i}"), k) for k in keys for i in range(self.vnodes))
        by_key = {c.job_id: c for c in cands}
        total = sum(c.inflight for c in cands) + 1
        bound = max(1.0, self.load_factor * total / len(cands))
        ring = self._ring
        start = bisect.bisect(ring, (_h(affinity_key(body, headers)), ""))
        seen: set[str] = set()
        for i in range(len(ring)):
            key = ring[(start + i) % len(ring)][1]
            if key in seen:
                continue
            seen.add(key)
            if by_key[key].inflight + 1 <= bound:
                return by_key[key]
        return min(cands, key=lambda c: c.inflight)


@policy("load_aware")
class LoadAware:
    """Fewest requests waiting in the engine, then lowest KV-cache use, then fewest in flight (replicas
    not scraped yet count as idle engines)."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def choose(self, cands, body, headers):
        rnd = self.rng.random
        return min(cands, key=lambda c: (c.load.waiting or 0.0, round(c.load.kv_usage or 0.0, 2), c.inflight, rnd()))


@policy("kv_aware")
class KvAware:
    """The replica where the prompt's blocks are cached, against its load, from the engines' KV-cache events
    (the scoring is :meth:`orchestrator.gateway.kvroute.KvRouting.choose`; the pool binds it)."""

    sees_every_request = True   # one replica too: what was predicted cached is counted for every request

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.kv: Any = None
        self.model = ""

    def bind(self, kv: Any, model: str) -> None:
        self.kv, self.model = kv, model

    def choose(self, cands, body, headers):
        if self.kv is None:
            return min(cands, key=lambda c: (c.inflight, self.rng.random()))
        return self.kv.choose(self.model, cands, body, self.rng)

    def charge(self) -> int:
        """The prefill (uncached prompt tokens) the last choice put on its replica, until its first byte."""
        return self.kv.take_charge(self.model) if self.kv is not None else 0


def affinity_key(body: dict, headers: Mapping[str, str], prefix_chars: int = 256) -> str:
    """What prefix_affinity hashes: a session header, else ``user``, else the start of the prompt."""
    for h in ("x-session-id", "x-slurmfleet-session"):
        if headers.get(h):
            return "s:" + headers[h]
    if isinstance(body.get("user"), str) and body["user"]:
        return "u:" + body["user"]
    if isinstance(body.get("messages"), list):
        parts = []
        for msg in body["messages"]:
            if isinstance(msg, dict):
                content = msg.get("content")
                parts.append(content if isinstance(content, str) else repr(content))
        return "p:" + "\n".join(parts)[:prefix_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return "p:" + str(prompt or "")[:prefix_chars]
