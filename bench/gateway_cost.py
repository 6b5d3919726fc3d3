"""A proxied request's CPU cost in instructions (callgrind): deterministic, where requests/s on a shared machine
move by 5-10% from run to run and hide a change of a few percent.

    .venv/bin/python bench/gateway_cost.py [--requests 2000] [--baseline DIR]   # needs valgrind and nginx (Debian)

The gateway (one process, ``bench/gateway_serve.py``) runs under ``valgrind --tool=callgrind`` with
instrumentation off; after 300 warm-up requests it is switched on for ``--requests`` non-streaming
``POST /v1/completions`` sent one after another on one keep-alive connection to an nginx backend, then off.
Reported: instructions per request (the gateway's process, all of it: the event loop, aiohttp, the proxy).
``--baseline DIR`` measures another checkout (``git worktree add DIR REV``) the same way, for a ratio.  Run to
run the figure moves by about 0.5%.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_bench import BODY, ROOT, free_port, nginx_conf, wait_port  # noqa: E402


def measure(tree: Path, backend: int, requests: int, tmp: Path) -> float:
    port, out = free_port(), tmp / f"callgrind-{tree.name}.out"
    proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                             sys.executable, str(tree / "bench" / "gateway_serve.py"), "--port", str(port),
                             "--backend", f"http://127.0.0.1:{backend}", "--workers", "1"],
                            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / f"valgrind-{tree.name}.log", "w"))
    try:
        wait_port(port, 600)

        def send(n: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port)
            for _ in range(n):
                conn.request("POST", "/v1/completions", body=BODY, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    raise SystemExit(f"{tree}: the gateway answered {r.status}")
            conn.close()
        send(300)
        control = ["callgrind_control", "-i"]
        subprocess.run([*control, "on", str(proc.pid)], check=True, capture_output=True)
        send(requests)
        subprocess.run([*control, "off", str(proc.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        time.sleep(1)
        total = 0
        for f in glob.glob(f"{out}*"):
            for line in open(f):
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        return total / requests
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--baseline", type=Path, help="another slurmfleet checkout, measured the same way")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sf-cost-"))
    backend = free_port()
    nginx = subprocess.Popen(["/usr/sbin/nginx", "-c", str(nginx_conf(tmp, backend, None))])
    try:
        wait_port(backend)
        rows = [("this checkout", measure(ROOT, backend, args.requests, tmp))]
        if args.baseline:
            rows.append((f"baseline {args.baseline.name}", measure(args.baseline.resolve(), backend, args.requests, tmp)))
    finally:
        nginx.terminate()
    print("| gateway | instructions per proxied request | vs this checkout |\n|---|---:|---:|")
    for name, n in rows:
        print(f"| {name} | {n:,.0f} | {n / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
