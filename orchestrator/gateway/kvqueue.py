"""kv_aware's use of a model's request queue: which request waits, and which one takes a replica that has room.

Once the replicas are at ``max_inflight_per_replica`` (set it near the engine's ``--max-num-seqs``, so that
requests wait in the gateway instead of in the engines' first-come queues), two rules apply:

* **Hold for the cache.**  A request whose prompt is cached on a replica without room waits for that replica,
  rather than taking one with room that would prefill it again, when going elsewhere would recompute at least
  ``HOLD_SHARE`` of the prompt.  It waits at most ``HOLD_S``; then any replica with room will do.
* **Elect by cache.**  When a replica has room, of the first ``LOOK`` waiters (in the queue's own order: priority
  classes first, then the keys in turn), the one with the most prompt tokens cached on a replica with room takes
  it; ties go to the one first in order.  A waiter that has waited ``STARVE_S`` goes before any younger one (of
  several such, the oldest first), so no request waits for ever behind others that hit the cache.

With room everywhere neither rule does anything: a request goes where :meth:`KvRouting.choose` says.

Measured on the routing-quality benchmark's offline model (``bench/routing_model.py``, tenants, closed loop):
an engine's queue serves first come, so a request for a cached document waits behind one that prefills a whole
document; the gateway's election serves it first, and the replica's slots go to requests it can answer from
its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .admission import Waiter
    from .pool import Slot

HOLD_S = 4.0       # the longest a request waits for the full replica that caches its prompt (seconds)
HOLD_SHARE = 0.5   # ... when every replica with room would prefill at least this share of its prompt again
LOOK = 32          # waiters the election reads, in queue order
STARVE_S = 10.0    # a waiter this old goes before every younger one (seconds)


class KvQueue:
    def __init__(self, kv: Any, model: str):
        self.kv, self.model = kv, model

    def _view(self, body: dict, cands: Sequence["Slot"], rooms: Sequence["Slot"]) -> tuple[bool, int]:
        """(whether the request should wait for a replica without room, its most cached tokens on one with)."""
        ntok, hits = self.kv.cached(self.model, body, cands)
        if not hits:
            return False, 0
        best_room = max((hits.get(s.job_id, 0) for s in rooms), default=0)
        return ntok > 0 and max(hits.values()) - best_room >= HOLD_SHARE * ntok, best_room

    def holds(self, body: dict, cands: Sequence["Slot"], rooms: Sequence["Slot"]) -> bool:
        """A new request waits: a replica without room caches what those with room would prefill again."""
        return self._view(body, cands, rooms)[0]

    def elect(self, waiters: Iterable["Waiter"], rooms_for: Callable[[set[str]], tuple[list, list]],
              now: float) -> "Waiter | None":
        """The waiter that takes the next replica with room (None: every waiter holds, or none has a room)."""
        best, best_key, best_rank = None, None, 0
        plain = None   # the replicas of a waiter that excludes none (most do): looked up once
        for w in waiters:
            if best is not None and w.rank != best_rank:
                break   # a lower class only when no waiter of a higher one may go
            if w.exclude:
                cands, rooms = rooms_for(w.exclude)
            else:
                cands, rooms = plain = plain or rooms_for(w.exclude)
            if not rooms:
                continue
            waited = now - w.start
            hold, cached = self._view(w.body, cands, rooms) if w.body is not None else (False, 0)
            if hold and waited < HOLD_S:
                continue
            starved = waited >= STARVE_S
            key = (True, waited) if starved else (False, cached)   # the starved oldest first, then by cache
            if best_key is None or key > best_key:
                best, best_key, best_rank = w, key, w.rank
        return best
