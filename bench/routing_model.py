"""A model of ``bench/routing_quality.py``'s tenants cell in simulated time, for comparing dispatch rules in seconds.

    .venv/bin/python bench/routing_model.py     # seeds 13 and 14, open loop and closed loop: about 3 minutes

Not a measurement: the benchmark runs real processes; this replays its shape without them.  Four replicas, each
the simulator's own prefix cache (:class:`orchestrator.devtools.simcache.PrefixCache`, LRU, 1,126 blocks of 16
tokens: a fifth of the 40 documents' tokens), its scheduler reduced to its rules (``--max-num-seqs`` 4 slots, a
request holds its slot from admission, prefill one at a time at 0.3 ms per uncached token, then 0.02 s and 11
tokens at 40/s); 40 tenants with documents of 1,500-3,000 tokens, Zipf 0.8, and questions of 20-70 tokens.
Open loop: Poisson at 14.5 requests/s for 60 s, TTFT p90 after 15 s.  Closed loop: 48 users for 100 s,
completions/s after 30 s.  The rules:

* ``kv``: kv_aware's cost as :meth:`KvRouting.choose` computes it (prefill ahead + 2 x uncached tokens, bounded
  load, what was sent in the last 5 s counts as cached), no cap: requests wait in the engines' queues;
* ``kv+queue``: the same at a cap of 5 in flight per replica, with :mod:`orchestrator.gateway.kvqueue`'s rules
  (hold for the full replica that caches at least half the prompt, for ``HOLD_S`` at most; a replica with room
  goes to the waiter with the most cached there; its constants imported, the starvation guard left out);
* ``sticky``: the benchmark's calibration client (tenants pinned by popularity to the least loaded replica).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.devtools.simcache import PrefixCache  # noqa: E402
from orchestrator.gateway.kvqueue import HOLD_S, HOLD_SHARE, LOOK  # noqa: E402  (the product's own rules)
from orchestrator.gateway.kvroute import LOAD_FACTOR, RECENT_S, UNCACHED_WEIGHT  # noqa: E402

BLOCK, BLOCKS, SLOTS, CAP = 16, 1126, 4, 5
PREFILL_S, TTFT_S, DECODE_S = 3e-4, 0.02, 11 / 40


class Replica:
    def __init__(self) -> None:
        self.cache = PrefixCache(BLOCK, BLOCKS)
        self.queue: deque[dict] = deque()   # the engine's first-come queue
        self.running = self.inflight = self.pending = 0
        self.prefill_free = 0.0
        self.recent: dict[int, float] = {}   # tenant -> when last sent here


class Day:
    def __init__(self, rule: str, seed: int, rate: float = 0.0, users: int = 0, duration_s: float = 60.0):
        rng = random.Random(seed)
        self.docs = [[t * 10_000 + k for k in range(rng.randint(1500, 3000) + 20)] for t in range(40)]
        w = [1 / (k + 1) ** 0.8 for k in range(40)]
        self.weights = [x / sum(w) for x in w]
        self.rule, self.rate, self.users, self.duration = rule, rate, users, duration_s
        self.rng, self.tie = random.Random(seed + 1), random.Random(seed + 2)
        self.reps = [Replica() for _ in range(4)]
        self.events: list = []
        self.n = 0
        self.t = 0.0
        self.waiting: list[dict] = []   # the gateway's queue (kv+queue)
        self.done: list[float] = []
        self.ttft: list[tuple[float, float]] = []
        self.sticky = self._sticky()

    def _sticky(self) -> dict[int, int]:
        load, out = [0.0] * 4, {}
        for d in sorted(range(40), key=lambda d: -self.weights[d]):
            i = load.index(min(load))
            out[d], load[i] = i, load[i] + self.weights[d]
        return out

    def at(self, t: float, fn, *a) -> None:
        self.n += 1
        heapq.heappush(self.events, (t, self.n, fn, a))

    # -- the router -------------------------------------------------------------------------------------------
    def cached(self, i: int, req: dict) -> int:
        rep = self.reps[i]
        hit = rep.cache.hit_tokens(req["prompt"])
        if rep.recent.get(req["doc"], -math.inf) > self.t - RECENT_S:
            hit = max(hit, len(self.docs[req["doc"]]) // BLOCK * BLOCK)
        return hit

    def cost_choice(self, req: dict, cands: list[int], hits: list[int]) -> int:
        n = len(req["prompt"])
        bound = LOAD_FACTOR * sum(r.inflight for r in self.reps) / len(self.reps) + 2
        return min(cands, key=lambda i: (self.reps[i].inflight > bound, self.reps[i].pending + UNCACHED_WEIGHT * (n - hits[i]),
                                         self.reps[i].inflight, self.tie.random()))

    def arrive(self, user) -> None:
        doc = self.rng.choices(range(40), self.weights)[0]
        prompt = self.docs[doc] + [self.rng.randrange(10**6, 2 * 10**6) for _ in range(self.rng.randint(20, 70))]
        req = {"doc": doc, "prompt": prompt, "sent": self.t, "user": user}
        if self.rule == "kv+queue":
            self.waiting.append(req)
            self.dispatch_waiting()
            return
        hits = [self.cached(i, req) for i in range(4)]
        i = self.sticky[doc] if self.rule == "sticky" else self.cost_choice(req, list(range(4)), hits)
        self.send(req, i, hits[i])

    def dispatch_waiting(self) -> None:
        """kvqueue's election: while a replica has room, the waiter with the most cached on one that has it."""
        while self.waiting:
            rooms = [i for i, r in enumerate(self.reps) if r.inflight < CAP]
            if not rooms:
                return
            best = None
            for k, req in enumerate(self.waiting[:LOOK]):
                hits = [self.cached(i, req) for i in range(4)]
                in_rooms = max(hits[i] for i in rooms)
                if max(hits) - in_rooms >= HOLD_SHARE * len(req["prompt"]) and self.t - req["sent"] < HOLD_S:
                    continue
                if best is None or in_rooms > best[0]:
                    best = (in_rooms, k, hits)
            if best is None:
                return
            _, k, hits = best
            req = self.waiting.pop(k)
            i = self.cost_choice(req, rooms, hits)
            self.send(req, i, hits[i])

    def send(self, req: dict, i: int, hit: int) -> None:
        rep = self.reps[i]
        req["rep"], req["charge"] = i, len(req["prompt"]) - hit
        rep.recent[req["doc"]] = self.t
        rep.pending += req["charge"]
        rep.inflight += 1
        rep.queue.append(req)
        self.admit(rep)

    # -- the engine -------------------------------------------------------------------------------------------
    def admit(self, rep: Replica) -> None:
        while rep.queue and rep.running < SLOTS:
            req = rep.queue[0]
            adm = rep.cache.admit(str(id(req)), req["prompt"], 12)
            rep.cache.take_events()
            if adm is None:
                return
            rep.queue.popleft()
            rep.running += 1
            req["adm"] = adm
            start = max(self.t, rep.prefill_free)
            rep.prefill_free = start + PREFILL_S * (adm.prompt_tokens - adm.hit_tokens)
            self.at(rep.prefill_free + TTFT_S, self.first_token, req)

    def first_token(self, req: dict) -> None:
        self.reps[req["rep"]].pending -= req["charge"]
        self.ttft.append((req["sent"], self.t - req["sent"]))
        self.at(self.t + DECODE_S, self.finish, req)

    def finish(self, req: dict) -> None:
        rep = self.reps[req["rep"]]
        rep.cache.release(req["adm"].seq_id)
        rep.cache.take_events()
        rep.running -= 1
        rep.inflight -= 1
        self.done.append(self.t)
        self.admit(rep)
        if req["user"] is not None and self.t < self.duration:
            self.arrive(req["user"])
        if self.rule == "kv+queue":
            self.dispatch_waiting()

    def poisson(self) -> None:
        self.arrive(None)
        nxt = self.t + self.rng.expovariate(self.rate)
        if nxt < self.duration:
            self.at(nxt, self.poisson)

    def tick(self) -> None:   # holds expire with time, as the gateway's waiters re-check
        if self.rule == "kv+queue":
            self.dispatch_waiting()
        if self.t < self.duration + 30:
            self.at(self.t + 0.25, self.tick)

    def run(self) -> Day:
        if self.rate:
            self.at(0.0, self.poisson)
        for u in range(self.users):
            self.at(0.0, self.arrive, u)
        self.at(0.0, self.tick)
        while self.events:
            self.t, _, fn, a = heapq.heappop(self.events)
            if self.t > self.duration + 30:
                break
            fn(*a)
        return self


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="13,14")
    args = ap.parse_args()
    print("| seed | rule | open loop p90 (s) | closed loop (req/s) | hit rate (closed loop) |\n|---|---|---:|---:|---:|")
    for seed in (int(s) for s in args.seeds.split(",")):
        for rule in ("sticky", "kv", "kv+queue"):
            o = Day(rule, seed, rate=14.5, duration_s=60.0).run()
            ts = sorted(x for s, x in o.ttft if s >= 15.0)
            c = Day(rule, seed, users=48, duration_s=100.0).run()
            q = sum(r.cache.queries for r in c.reps)
            h = sum(r.cache.hits for r in c.reps)
            print(f"| {seed} | {rule} | {ts[int(0.9 * len(ts))]:.2f} | "
                  f"{sum(1 for d in c.done if 30.0 <= d <= 100.0) / 70.0:.2f} | {100 * h / q:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
