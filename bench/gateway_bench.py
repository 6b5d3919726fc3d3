"""Gateway benchmark: direct vs slurmfleet vs vllm-router vs nginx, same backends, same load generator.

    .venv/bin/python bench/gateway_bench.py            # needs wrk, nginx (Debian) and vllm-router (PyPI)

Backends: nginx answering a fixed completion (non-streaming; fast enough not to be the limit) and
the slurmfleet simulator streaming 200 chunks per request as fast as it can (streaming).
Load: wrk (1 thread) with a POST body; streamed chunks counted by an aiohttp client.
slurmfleet runs twice: one process, and ``gateway.workers`` processes (default 2) sharing the port.
``--baseline DIR`` adds both rows for another checkout of slurmfleet (e.g. ``git worktree add DIR v1``), run
in the same rounds: a before/after comparison that machine drift hits alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BODY = '{"model": "m", "prompt": "hello", "max_tokens": 1}'
RESPONSE = ('{"id":"cmpl-1","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
            '"text":"tok0 ","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":1,'
            '"completion_tokens":1,"total_tokens":2}}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} never opened")


def nginx_conf(tmp: Path, listen: int, upstream: int | None) -> Path:
    body = ("""
    location /v1/ { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection "";
                     proxy_buffering off; }
    location / { proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection ""; }
    """ if upstream else f"""
    location /v1/completions {{ default_type application/json; return 200 '{RESPONSE}'; }}
    location /v1/models {{ default_type application/json; return 200 '{{"object":"list","data":[{{"id":"m","object":"model"}}]}}'; }}
    location / {{ return 200 ''; }}
    """)
    ups = f"upstream up {{ server 127.0.0.1:{upstream}; keepalive 128; }}" if upstream else ""
    conf = tmp / f"nginx-{listen}.conf"
    conf.write_text(f"""
worker_processes 1; daemon off; pid {tmp}/nginx-{listen}.pid; error_log {tmp}/nginx-{listen}.err warn;
events {{ worker_connections 4096; }}
http {{ access_log off; keepalive_requests 1000000; {ups}
  client_body_temp_path {tmp}/cb-{listen}; proxy_temp_path {tmp}/pt-{listen};
  server {{ listen 127.0.0.1:{listen}; {body} }} }}
""")
    return conf


def wrk(port: int, conns: int, seconds: int, tmp: Path) -> dict:
    script = tmp / "post.lua"
    script.write_text(f'wrk.method = "POST"\nwrk.body = \'{BODY}\'\nwrk.headers["Content-Type"] = "application/json"\n')
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script),
                          f"http://127.0.0.1:{port}/v1/completions"], capture_output=True, text=True, check=True).stdout

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)", out, re.M)
        v, unit = float(m.group(1)), m.group(2)
        return v / 1000 if unit == "us" else (v * 1000 if unit == "s" else v)

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50": ms("50"), "p99": ms("99"), "errors": int(errors.group(1)) if errors else 0}


async def stream_chunks(port: int, seconds: float, concurrency: int = 8) -> float:
    body = {"model": "m", "prompt": "x", "max_tokens": 200, "stream": True}
    count = 0
    deadline = time.monotonic() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal count
        while time.monotonic() < deadline:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                              headers={"Authorization": "Bearer bench-secret"}) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        count += 1
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return count / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="gateway.workers for the second slurmfleet row")
    ap.add_argument("--baseline", type=Path, help="another slurmfleet checkout to measure in the same rounds")
    args = ap.parse_args()
    for tool in ("wrk", "nginx"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            sys.exit(f"{tool} missing: apt-get install wrk nginx-light")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    tmp = Path(tempfile.mkdtemp(prefix="sf-bench-"))
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str], port: int, tree: Path = ROOT) -> None:
        procs.append(subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{port}.log", "w"),
                                      env={**os.environ, "PYTHONPATH": str(tree)}))
        wait_port(port)

    ports = {name: free_port() for name in ("backend", "sim", "slurmfleet", "slurmfleet_s", "workers", "workers_s",
                                            "router", "router_s", "nginx", "nginx_s", "base", "base_s",
                                            "base_workers", "base_workers_s")}
    trees = [("", ROOT)] + ([("base_", args.baseline.resolve())] if args.baseline else [])
    try:
        spawn([nginx, "-c", str(nginx_conf(tmp, ports["backend"], None))], ports["backend"])
        spawn([sys.executable, "-m", "orchestrator.devtools.simulator", "--port", str(ports["sim"]), "--served-model-name", "m",
               "--ttft-s", "0", "--tokens-per-s", "1000000", "--max-num-seqs", "1000"], ports["sim"])
        for prefix, tree in trees:
            for name, target, workers in (("slurmfleet", "backend", 1), ("slurmfleet_s", "sim", 1),
                                          ("workers", "backend", args.workers), ("workers_s", "sim", args.workers)):
                name = (prefix + name).replace("base_slurmfleet", "base")
                spawn([sys.executable, str(tree / "bench" / "gateway_serve.py"), "--port", str(ports[name]),
                       "--backend", f"http://127.0.0.1:{ports[target]}", "--workers", str(workers)], ports[name], tree)
        for name, target in (("router", "backend"), ("router_s", "sim")):
            spawn([sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(ports[name]),
                   "--worker-urls", f"http://127.0.0.1:{ports[target]}", "--policy", "round_robin",
                   "--log-level", "error", "--disable-retries", "--disable-circuit-breaker",
                   "--prometheus-port", str(free_port())], ports[name])
        for name, target in (("nginx", "backend"), ("nginx_s", "sim")):
            spawn([nginx, "-c", str(nginx_conf(tmp, ports[name], ports[target]))], ports[name])
        time.sleep(2)
        paths = (("direct", "backend"), ("slurmfleet, 1 process", "slurmfleet"),
                 (f"slurmfleet, gateway.workers={args.workers}", "workers"))
        if args.baseline:
            paths += ((f"baseline {args.baseline.name}, 1 process", "base"),
                      (f"baseline {args.baseline.name}, gateway.workers={args.workers}", "base_workers"))
        paths += (("vllm-router", "router"), ("nginx", "nginx"))
        skeys = {"backend": "sim", "slurmfleet": "slurmfleet_s", "workers": "workers_s", "router": "router_s",
                 "nginx": "nginx_s", "base": "base_s", "base_workers": "base_workers_s"}
        for _, key in paths:
            wrk(ports[key], 4, 2, tmp)  # warm up
        # rounds interleave the paths, so drift of the machine hits them all alike; each figure is the median
        runs: dict[str, list] = {label: [] for label, _ in paths}
        for r in range(args.rounds):
            for label, key in paths:
                one = wrk(ports[key], 1, args.seconds, tmp)
                many = wrk(ports[key], 64, args.seconds, tmp)
                chunks = asyncio.run(stream_chunks(ports[skeys[key]], args.seconds))
                runs[label].append((one, many, chunks))
                print(f"round {r + 1}: {label}: {many['rps']:.0f} req/s @64, p50 @1 {one['p50']:.3f} ms, "
                      f"{chunks:.0f} chunks/s", file=sys.stderr)

        def med(label: str, which: int, field: str | None = None) -> float:
            vals = [run[which] if field is None else run[which][field] for run in runs[label]]
            return statistics.median(vals)
        rows = {label: ({f: med(label, 0, f) for f in ("p50", "p99", "errors")},
                        {f: med(label, 1, f) for f in ("rps", "p50", "p99", "errors")}, med(label, 2))
                for label, _ in paths}
        print(f"median of {args.rounds} interleaved rounds, {args.seconds} s each\n")
        d1, d64, _ = rows["direct"]
        print("| path | req/s @64 | added p50 @1 (ms) | added p99 @1 (ms) | added p50 @64 (ms) | added p99 @64 (ms) "
              "| streamed chunks/s | non-2xx |")
        print("|---|---|---|---|---|---|---|---|")
        for label, (one, many, chunks) in rows.items():
            add = lambda a, b: "-" if label == "direct" else f"{a - b:+.3f}"  # noqa: E731
            print(f"| {label} | {many['rps']:.0f} | {add(one['p50'], d1['p50'])} | {add(one['p99'], d1['p99'])} | "
                  f"{add(many['p50'], d64['p50'])} | {add(many['p99'], d64['p99'])} | {chunks:.0f} | "
                  f"{one['errors'] + many['errors']:.0f} |")
        print(f"\ndirect: p50 @1 {d1['p50']:.3f} ms, p99 @1 {d1['p99']:.3f} ms, p50 @64 {d64['p50']:.3f} ms")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
