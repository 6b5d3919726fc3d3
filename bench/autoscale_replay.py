"""Replay a ``bench/autoscale.py`` run's fleet (d) through slurmfleet's autoscaler, with each decision's reason.

    .venv/bin/python bench/autoscale_replay.py /tmp/slurmfleet-autoscale-<time>.json            # every change
    .venv/bin/python bench/autoscale_replay.py RUN.json --every 10 --from 400 --to 560          # and the reasons between

The benchmark keeps, per second, the requests (d)'s gateway had in flight and its READY replicas (``timeline``),
and every request's arrival and TTFT (``requests``), but not the autoscaler's reasons for keeping a count.  This
feeds those seconds to the product's own :class:`~orchestrator.fleet.autoscale.Autoscaler` with the run's (d)
config, the requests ended each second taken as arrival + TTFT + the rest of the stream (``--stream-s``), and
prints each decision that moves the target (and, with ``--every``, the reasons in between): what the rule made of
the cluster's own load, not a model's.  Its samples are the monitor's, a second apart, so it may move a second or
two off the daemon's run (seed 13 of 2026-12-07: the same 4 -> 3 -> 2 at 407 and 542 s as the daemon's log).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.config import AutoscaleConfig  # noqa: E402
from orchestrator.fleet.autoscale import Autoscaler, Capacity, Sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the JSON a bench/autoscale.py run wrote (--out)")
    ap.add_argument("--stream-s", type=float, default=2.75, help="a stream's length after its first token (12 "
                    "tokens at the simulator's 4/s, less the first: 2.75)")
    ap.add_argument("--every", type=float, default=0.0, help="also print the reason every N s (0: changes only)")
    ap.add_argument("--from", dest="lo", type=float, default=0.0)
    ap.add_argument("--to", dest="hi", type=float, default=float("inf"))
    args = ap.parse_args()
    run = json.loads(args.run.read_text())
    conf = dict(run["configs"]["d"]["models"][0]["autoscale"])
    conf.pop("cold_start_hold_s", None)   # (the gateway's, not the rule's)
    a = AutoscaleConfig(**conf)
    slots = run["simulator"]["max_num_seqs"]
    ends = sorted(t + (ttft or 0.0) + args.stream_s for t, ttft, ok, *_ in run["requests"]["d"] if ok)
    scaler = Autoscaler()
    scaler.adopt("d", 0, a, 0.0)
    last = None
    for e in run["timeline"]:
        t, d = e["t"], e["d"]
        served = bisect.bisect_right(ends, t) - bisect.bisect_right(ends, t - 1.0)
        scaler.observe("d", Sample(t, d["inflight"], 0, served=served), a)
        n = scaler.target("d")
        dec = scaler.step("d", a, Capacity(n, min(n, d["ready"]), engine_slots=slots), t)
        tick = args.every and (last is None or t - last >= args.every)
        if dec.direction or (tick and args.lo <= t <= args.hi):
            last = t if tick else last
            print(f"{t:7.1f}s  {n} -> {dec.target}  (held {d['held']}, ready {d['ready']}, in flight "
                  f"{d['inflight']})  {dec.reason}")


if __name__ == "__main__":
    main()
