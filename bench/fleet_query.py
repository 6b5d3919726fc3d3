"""Cost of one fleet listing with many unrelated jobs in the queue (run on the local cluster).

    .venv/bin/python bench/fleet_query.py --unrelated 5000

Submits N held jobs under another job name, then times slurmfleet's one filtered
``squeue`` call against the unfiltered ``squeue --json`` that 22.05 forces on
JSON users, and cancels the held jobs afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from orchestrator.fleet.slurm import CliSlurm


def submit_held(n: int) -> None:
    script = "#!/bin/bash\nsleep 1\n"

    def one(_: int) -> None:
        subprocess.run(["sbatch", "--hold", "-J", "bench-unrelated", "-o", "/dev/null"], input=script.encode(),
                       check=True, capture_output=True)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def timed(fn, repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), max(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unrelated", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    client = CliSlurm("slurmfleet-benchfleet", os.environ.get("SLURM_CONF"))

    def fleet_query() -> None:
        asyncio.run(client.list_jobs())

    def json_query() -> int:
        return len(subprocess.run(["squeue", "--json"], capture_output=True, check=True).stdout)

    rows = []
    base = timed(fleet_query, args.repeat)
    t0 = time.time()
    submit_held(args.unrelated)
    print(f"submitted {args.unrelated} held jobs in {time.time() - t0:.0f}s")
    try:
        loaded = timed(fleet_query, args.repeat)
        filtered_bytes = len(subprocess.run(["squeue", "-h", "-t", "all", "--me", "--name=slurmfleet-benchfleet",
                                             "-O", "JobID:|,State:|"], capture_output=True).stdout)
        js = timed(json_query, 5)
        json_bytes = json_query()
    finally:
        subprocess.run(["scancel", "--name=bench-unrelated"], check=False)
    rows.append(("slurmfleet list_jobs, empty queue", base, None))
    rows.append((f"slurmfleet list_jobs, {args.unrelated} unrelated jobs", loaded, filtered_bytes))
    rows.append((f"squeue --json (unfiltered), {args.unrelated} jobs", js, json_bytes))
    print(f"{'query':55s} {'median ms':>10s} {'max ms':>8s} {'bytes':>10s}")
    for name, (med, mx), size in rows:
        print(f"{name:55s} {med * 1000:10.1f} {mx * 1000:8.1f} {size if size is not None else '-':>10}")


if __name__ == "__main__":
    main()
