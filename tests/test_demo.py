"""The README's first command: ``slurmfleet demo`` serves the embedded fleet (configs/local.yaml) on the local
cluster, streams one answer from the real vLLM replica, and stops on Ctrl-C leaving its jobs for the next
start.  Its ports, state dir and fleet name are moved by the environment variables the README names."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, fleet_jobs, free_port, slurm

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.xdist_group("vllm")]
MODEL_DIR = Path(os.environ.get("SLURMFLEET_MODEL_DIR", "/tmp/slurmfleet-models/tiny-llama"))


def test_the_demo_streams_an_answer_from_real_vllm_and_stops_on_ctrl_c(cluster, tmp_path):
    if not (ROOT / ".venv-vllm" / "bin" / "vllm").exists() or not (MODEL_DIR / "config.json").exists():
        pytest.fail("real vLLM is not set up: run .ci/setup-vllm")
    fleet, port = "demo" + uuid.uuid4().hex[:6], free_port()
    env = {**os.environ, "SLURMFLEET_FLEET": fleet, "SLURMFLEET_PORT": str(port),
           "SLURMFLEET_ADMIN_PORT": str(free_port()), "SLURMFLEET_STATE_DIR": str(tmp_path / "state"),
           "SLURMFLEET_MODEL_DIR": str(MODEL_DIR)}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "demo"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 420
        while not any(x.startswith("streamed answer from tiny-llama:") for x in out):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out[-40:])
            try:
                out.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        text = "".join(out)
        assert f"slurmfleet is serving on http://127.0.0.1:{port}" in text
        assert "first streamed token at" in text
        # the printed curl example works as printed (the alias too)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2
        jobs = {j["job_id"] for j in fleet_jobs(fleet, "RUNNING")}
        assert len(jobs) == 3   # tiny-llama and two sim-small replicas
        proc.send_signal(signal.SIGINT)   # Ctrl-C
        assert proc.wait(60) == 0
        assert {j["job_id"] for j in fleet_jobs(fleet, "RUNNING")} == jobs   # left for the next start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        slurm("scancel", "--name", f"slurmfleet-{fleet}", check=False)
