"""A model of ``bench/autoscale.py``'s day, for comparing autoscaling rules over many seeds in seconds.

    .venv/bin/python bench/autoscale_model.py                          # 30 seeded days, (c) against (d)
    .venv/bin/python bench/autoscale_model.py --set trend_window_s=0   # and (d) with settings changed

Not a measurement: ``bench/autoscale.py`` measures one day on the real cluster, and one day's p99 turns on a
handful of requests (its 32nd slowest of about 3,150), so two rules that differ by less than that cannot be
told apart by one run.  This replays the same seeded arrival schedules (``autoscale.arrivals``) through:

* the load: every request holds a slot for ``SERVICE_S`` (3.0 s), so the requests in flight at ``t`` are the
  arrivals of the last 3 s (open loop: the fleet's size does not change the load);
* the fleets: a raised target's replica is READY ``--cold-start-s`` later (the bench's simulator cold starts
  take 0.5-2.8 s); a lowered target's replica leaves routing at once and is held ``SERVICE_S`` more (its
  drain); replica-seconds integrate every replica held;
* (c) the bench's peer exactly (a 5 s poll, an EMA of weight 0.4 kept to 2 decimals, ``ceil(avg / 6)``);
* (d) slurmfleet's own :class:`~orchestrator.fleet.autoscale.Autoscaler` (the product's code, one sample a
  second, as the daemon's ``autoscale`` task takes them) with the bench's config;
* a request is *slow* when it arrives to more requests in flight than the READY replicas' slots (it waits
  for one: in the bench, TTFT over about 0.3 s; requests while nothing is READY are cold starts, not counted).

Prints per seed and in all: replica-seconds, slow requests (the p99's raw material) and jobs submitted, per
phase too, and on how many days (d) beats (c) on each.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autoscale as day  # noqa: E402  (bench/autoscale.py: the trace, the peer's constants, (d)'s config)

from orchestrator.config import AutoscaleConfig  # noqa: E402
from orchestrator.fleet.autoscale import Autoscaler, Capacity, Sample  # noqa: E402

MAX = 4           # bench/autoscale.py --max-replicas
BURST = 22.0      # its --burst-inflight
STEP_S = 0.5


class Result:
    def __init__(self) -> None:
        self.replica_s = collections.Counter()   # per phase
        self.slow = collections.Counter()        # per phase
        self.jobs = 0


def run(arrivals: list[float], total: float, rule: str, conf: AutoscaleConfig | None, cold_start_s: float) -> Result:
    """One fleet through one day: ``rule`` "c" (the peer) or "d" (slurmfleet's autoscaler with ``conf``)."""
    def inflight(t: float) -> int:
        return bisect.bisect_right(arrivals, t) - bisect.bisect_right(arrivals, t - day.SERVICE_S)

    res = Result()
    ready_at: list[float] = []   # one per replica of the target: when it is (or was) READY
    draining: list[float] = []   # one per replica leaving: when it is released
    target, avg, nxt = 0, 0.0, 0
    scaler = Autoscaler()
    if rule == "d":
        scaler.adopt("m", 0, conf, 0.0)
    t = 0.0
    while t < total:
        phase = day.phase_at(t, total)[0]
        ready = sum(r <= t for r in ready_at)
        while nxt < len(arrivals) and arrivals[nxt] < t + STEP_S:
            if ready and inflight(arrivals[nxt]) > day.SIM["max_num_seqs"] * ready:
                res.slow[phase] += 1
            nxt += 1
        new = target
        whole = abs(t - round(t)) < 1e-9 and t > 0
        if rule == "c" and whole and round(t) % round(day.POLL_S) == 0:
            avg, new = day.ema_step(avg, inflight(t), MAX)
        elif rule == "d" and whole:
            x = inflight(t)
            waiting = max(0, x - day.SIM["max_num_seqs"] * ready) / ready if ready else None
            served = bisect.bisect_right(arrivals, t - day.SERVICE_S) - bisect.bisect_right(arrivals, t - 1 - day.SERVICE_S)
            scaler.observe("m", Sample(t, x, 0, waiting, None, served=served), conf)   # (served: the requests ended in
            # the last second, as the daemon counts them: how long a request stays, Little's law, reads from them)
            pending = tuple(("job", "") for r in ready_at if r > t)
            new = scaler.step("m", conf, Capacity(len(ready_at), ready, pending), t).target
        if new > target:
            ready_at += [t + cold_start_s] * (new - target)
            res.jobs += new - target
        for _ in range(target - new):   # the one READY last (the least loaded) leaves first
            ready_at.sort()
            ready_at.pop()
            draining.append(t + day.SERVICE_S)
        target = new
        draining = [d for d in draining if d > t]
        res.replica_s[phase] += (len(ready_at) + len(draining)) * STEP_S
        t = round(t + STEP_S, 6)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--minutes", type=float, default=16.0)
    ap.add_argument("--cold-start-s", type=float, default=2.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a (d) variant with autoscale settings changed (KEY=VALUE,KEY=VALUE; repeatable: a variant each)")
    args = ap.parse_args()
    total = args.minutes * 60
    base = day.autoscale_config(MAX, args.minutes)
    variants = {"(d)": AutoscaleConfig(**base)}
    for kvs in args.set:
        changes = dict(kv.split("=", 1) for kv in kvs.split(","))
        variants[f"(d) {kvs}"] = AutoscaleConfig(**{**base, **{k: float(v) for k, v in changes.items()}})
    rows: dict[str, list[Result]] = collections.defaultdict(list)
    for seed in range(1, args.seeds + 1):
        arr = day.arrivals(total, BURST, seed)
        rows["(c) peer"].append(run(arr, total, "c", None, args.cold_start_s))
        for name, conf in variants.items():
            rows[name].append(run(arr, total, "d", conf, args.cold_start_s))
        print(f"seed {seed:3d}: " + " | ".join(
            f"{k} {sum(r[-1].replica_s.values()):.0f} rs, {sum(r[-1].slow.values())} slow" for k, r in rows.items()))
    n = args.seeds
    phases = [p[0] for p in day.PHASES]
    print(f"\nmean over {n} days | replica-s | slow | jobs | " + " | ".join(f"{p} rs / slow" for p in phases))
    for k, rs in rows.items():
        print(f"{k} | {sum(sum(r.replica_s.values()) for r in rs) / n:.0f} | {sum(sum(r.slow.values()) for r in rs) / n:.1f}"
              f" | {sum(r.jobs for r in rs) / n:.1f} | " + " | ".join(
                  f"{sum(r.replica_s[p] for r in rs) / n:.0f} / {sum(r.slow[p] for r in rs) / n:.1f}" for p in phases))
    peer = rows["(c) peer"]
    for k, rs in rows.items():
        if k == "(c) peer":
            continue
        fewer_rs = [sum(a.replica_s.values()) < sum(b.replica_s.values()) for a, b in zip(rs, peer)]
        fewer_slow = [sum(a.slow.values()) < sum(b.slow.values()) for a, b in zip(rs, peer)]
        print(f"{k} beats (c) on replica-s on {sum(fewer_rs)}/{n} days, on slow requests on {sum(fewer_slow)}/{n}, "
              f"on both on {sum(a and b for a, b in zip(fewer_rs, fewer_slow))}/{n}")


if __name__ == "__main__":
    main()
