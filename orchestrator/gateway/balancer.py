"""Routing policies: pure functions over an immutable snapshot of candidate replicas."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import random
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One routable replica at the moment of choice."""

    key: str                 # job id
    inflight: int = 0
    waiting: float | None = None   # scraped vllm:num_requests_waiting
    kv_usage: float | None = None  # scraped vllm:kv_cache_usage_perc (0-1)


def least_outstanding(cands: Sequence[Candidate], rng: random.Random) -> Candidate:
    """Power of two choices on in-flight requests."""
    if len(cands) == 1:
        return cands[0]
    a, b = rng.sample(list(cands), 2)
    if a.inflight == b.inflight:
        return a if rng.random() < 0.5 else b
    return a if a.inflight < b.inflight else b


def round_robin(cands: Sequence[Candidate], counter: int) -> Candidate:
    ordered = sorted(cands, key=lambda c: c.key)
    return ordered[counter % len(ordered)]


def _h(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_affinity(cands: Sequence[Candidate], affinity_key: str, load_factor: float = 1.25,
                    vnodes: int = 64) -> Candidate:
    """Consistent hashing with bounded load: the key's home replica unless it carries more than
    ``load_factor`` x the average load, then the next replica clockwise that does not."""
    ring = sorted((_h(f"{c.key}#{i}"), c.key) for c in cands for i in range(vnodes))
    by_key = {c.key: c for c in cands}
    total = sum(c.inflight for c in cands) + 1
    bound = max(1.0, load_factor * total / len(cands))
    start = bisect.bisect(ring, (_h(affinity_key), ""))
    seen: set[str] = set()
    for i in range(len(ring)):
        key = ring[(start + i) % len(ring)][1]
        if key in seen:
            continue
        seen.add(key)
        if by_key[key].inflight + 1 <= bound:
            return by_key[key]
    return min(cands, key=lambda c: c.inflight)


def load_aware(cands: Sequence[Candidate], rng: random.Random) -> Candidate:
    """Fewest requests waiting in the engine, then lowest KV-cache use, then fewest in flight.
    Replicas with no scrape yet count as idle engines."""
    def score(c: Candidate) -> tuple[float, float, int, float]:
        return (c.waiting or 0.0, round(c.kv_usage or 0.0, 2), c.inflight, rng.random())
    return min(cands, key=score)


def affinity_key(body: dict, headers: dict[str, str], prefix_chars: int = 256) -> str:
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
