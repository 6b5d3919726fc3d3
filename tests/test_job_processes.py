"""A replica job's processes end with it, and its node script travels as a file, not an environment string.

The engine and the GPU exporter run in their own process groups; whatever ends the job (scancel, the
engine killed, the node script or the batch script SIGKILLed) none of the job's processes is left a few
seconds after squeue stops showing it RUNNING.  Processes of a job: those whose environment holds
``SLURM_JOB_ID=<id>``, plus every member of the engine's and the exporter's process groups.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq

from conftest import fleet_config, sim_model, slurm, wait_for
from orchestrator.fleet.render import Renderer
from orchestrator.fleetfile import load_config, load_config_text
from orchestrator.kvrelay import client_options, server_key
from test_cluster_jobs import job_state, record, submit

GONE_TIMEOUT_S = 20  # from squeue no longer saying RUNNING to no process left (a loaded 2-core machine)
# 141,000 characters of arguments, in values under the fleet file's 64 KiB limit on one value
PADS = [f"--sf-pad-{i}=" + "x" * 47_000 for i in range(3)]


# -- the job's processes, from /proc --------------------------------------------------------------------

def _stat(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().split(b"\0")
    except OSError:
        return None
    return {"pid": pid, "state": f[0], "ppid": int(f[1]), "pgid": int(f[2]), "sid": int(f[3]),
            "argv": [a.decode(errors="replace") for a in cmd if a]}


def job_processes(job_id: str, groups: set[int] = frozenset()) -> list[dict]:
    """Live processes with SLURM_JOB_ID=<job_id> in their environment, or in one of ``groups``."""
    entry = f"SLURM_JOB_ID={job_id}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is None or st["state"] == "Z":
            continue
        if st["pgid"] in groups:
            out.append(st)
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if entry in env:
            out.append(st)
    return out


def _describe(procs: list[dict]) -> list[str]:
    return [f"{p['pid']} pgid={p['pgid']} {' '.join(p['argv'])[:90]}" for p in procs]


def find(procs: list[dict], pred) -> dict | None:
    return next((p for p in procs if p["argv"] and pred(p["argv"])), None)


def roles(job_id: str, state: Path) -> dict[str, dict]:
    """The job's batch script, node script, engine (the simulator), GPU exporter, KV-event relay (its loop and
    the relay itself) and watchdog."""
    procs = job_processes(job_id)
    node_file = str(state / "jobs" / f"{job_id}.0.node.sh")
    found = {
        "batch": find(procs, lambda a: a[0].endswith("bash") and a[-1].endswith("/slurm_script")),
        "node": find(procs, lambda a: a[0].endswith("bash") and a[1:] == [node_file]),
        "engine": find(procs, lambda a: "orchestrator.devtools.simulator" in a),
        "exporter": find(procs, lambda a: "orchestrator.observability.gpu_exporter" in a),
        "watchdog": find(procs, lambda a: "slurmfleet-watchdog" in a),
        "relay": find(procs, lambda a: "slurmfleet-kv-relay" in a),   # the loop that keeps it running
        "relay_proc": find(procs, lambda a: "slurmfleet-kv-relay" not in a
                           and any(x.endswith("/slurmfleet_kv_relay.py") for x in a)),
    }
    return found if all(found.values()) else {}


def job_config(tmp_path: Path, **sim):
    model = sim_model("procs", gpus_per_node=1, gpu_metrics={"enabled": True, "interval_s": 0.5}, routing="kv_aware",
                      simulator={"ttft_s": 0.01, "tokens_per_s": 2, **sim})
    return load_config(fleet_config(tmp_path / "fleet.yaml", "t" + uuid.uuid4().hex[:6], [model]))


class Stream(threading.Thread):
    """A slow streamed completion in flight, so a TERMed engine has work to finish (it would take ~100 s)."""

    def __init__(self, rec: dict, model: str):
        super().__init__(daemon=True)
        self.rec, self.model = rec, model
        self.started = threading.Event()

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection(self.rec["host"], self.rec["port"], timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({
                "model": self.model, "prompt": "x", "max_tokens": 200, "stream": True}),
                {"Authorization": f"Bearer {self.rec['secret']}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            while resp.readline():
                self.started.set()
        except (OSError, http.client.HTTPException):
            pass


def test_node_script_file_keeps_long_arguments_out_of_the_batch_part(tmp_path):
    """140,000 characters of vllm_args render; they live in the node script the batch script writes out
    (a heredoc into <state_dir>/jobs/<jobid>.<restart>.node.sh), nowhere in its own commands or environment."""
    chunk = 140_000 // 3 + 1
    values = [c * chunk for c in "abc"]
    cfg = load_config_text(
        "fleet: t\nstate_dir: /tmp/sf-long\nmodels:\n  - name: m\n    model_path: /m\n"
        "    container: {enabled: false}\n"
        f"    vllm_args: {{long-arg: {json.dumps(values)}}}\n", "t.yaml", {})
    renderer = Renderer()
    text = renderer.render(cfg, cfg.models[0])
    lines = text.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith('cat > "$SF_NODE_FILE.tmp.$$" <<'))
    delimiter = lines[start].split("<<'", 1)[1].split("'", 1)[0]
    end = next(i for i in range(start + 1, len(lines)) if lines[i].rstrip("\n") == delimiter)
    content = "".join(lines[start + 1:end])
    batch = "".join(lines[:start + 1] + lines[end:])
    assert content == "#!/bin/bash\n" + renderer.node_script(cfg.models[0]) + "\n"
    assert all(v in content for v in values) and sum(len(v) for v in values) >= 140_000
    assert len(batch) < 16384, len(batch)   # (its own commands and comments: no argument of 140,000 characters)
    assert not any(c * 100 in batch for c in "abc")
    assert "SF_NODE_SCRIPT" not in text
    assert 'SF_NODE_FILE="$SF_JOBS/$SF_RUN.node.sh"' in batch and "SF_JOBS=/tmp/sf-long/jobs" in batch
    assert '\nbash "$SF_NODE_FILE" &\n' in batch
    subprocess.run(["bash", "-n"], input=text.encode(), check=True)


def test_exporter_exits_with_its_parent(tmp_path):
    out = tmp_path / "gpu.json"
    parent = subprocess.Popen(["sleep", "60"])
    exporter = subprocess.Popen([sys.executable, "-m", "orchestrator.observability.gpu_exporter", "--out", str(out),
                                 "--interval-s", "30", "--parent-pid", str(parent.pid)], stderr=subprocess.PIPE)
    try:
        wait_for(out.exists, 20, "first reading")
        assert exporter.poll() is None
        parent.kill()
        parent.wait()
        assert exporter.wait(10) == 0
        assert not out.exists()
    finally:
        parent.kill()
        exporter.kill()
    once = subprocess.run([sys.executable, "-m", "orchestrator.observability.gpu_exporter", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 0 and "gpus" in json.loads(once.stdout)


@pytest.mark.cluster
@pytest.mark.parametrize("ending", ["scancel", "kill-engine", "kill-node-script", "kill-batch-script"])
def test_no_process_outlives_the_job(cluster, tmp_path, ending):
    cfg = job_config(tmp_path)
    state = Path(cfg.state_dir)
    job_id = submit(cfg, cfg.models[0])
    try:
        rec = wait_for(lambda: record(state, job_id), 60, "endpoint record")
        r = wait_for(lambda: roles(job_id, state), 20, "the job's processes")
        for role in ("engine", "exporter", "relay", "watchdog"):  # each its own session and process group
            assert r[role]["pgid"] == r[role]["pid"] == r[role]["sid"], (role, r[role])
        assert r["relay_proc"]["pgid"] == r["relay"]["pid"]
        assert r["node"]["pgid"] == r["batch"]["pgid"] != r["engine"]["pgid"]
        kv_dir = Path(r["relay"]["argv"][-4][len("ipc://"):]).parent   # the engine's event sockets: 0700
        assert kv_dir.name.startswith("sfkv.") and kv_dir.stat().st_mode & 0o777 == 0o700
        exporter_argv = r["exporter"]["argv"]
        assert exporter_argv[exporter_argv.index("--parent-pid") + 1] == str(r["node"]["pid"])
        node_file = state / "jobs" / f"{job_id}.0.node.sh"
        assert node_file.stat().st_mode & 0o777 == 0o600 and (state / "jobs").stat().st_mode & 0o777 == 0o700
        groups = {r["engine"]["pgid"], r["exporter"]["pgid"], r["relay"]["pgid"], r["watchdog"]["pgid"]}
        stream = Stream(rec, "procs")
        stream.start()
        assert stream.started.wait(20), "no streamed token"

        t0 = time.monotonic()
        if ending == "scancel":
            slurm("scancel", job_id)
        else:
            victim = {"kill-engine": "engine", "kill-node-script": "node", "kill-batch-script": "batch"}[ending]
            os.kill(r[victim]["pid"], signal.SIGKILL)
        wait_for(lambda: job_state(job_id) not in ("RUNNING", ""), 20, "squeue to stop saying RUNNING")
        t1 = time.monotonic()
        wait_for(lambda: not job_processes(job_id, groups), GONE_TIMEOUT_S,
                 f"no process of job {job_id} left", interval=0.2)
        t2 = time.monotonic()
        print(f"{ending}: not RUNNING after {t1 - t0:.1f}s, no process left {t2 - t1:.1f}s later")
        wait_for(lambda: record(state, job_id) is None, 10, "record removed")
        if ending != "kill-batch-script":  # the batch script removes it on exit (a SIGKILL runs no trap)
            wait_for(lambda: not node_file.exists(), 10, "node script file removed")
        assert not list((state / "gpu").glob(f"{job_id}.*"))
        wait_for(lambda: not kv_dir.exists(), 10, "the engine's event sockets removed")
    finally:
        slurm("scancel", job_id, check=False)
        leftover = job_processes(job_id)
        for p in leftover:  # never leave strays for the next test, whatever failed
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.cluster
def test_long_arguments_job_starts_and_publishes(cluster, tmp_path):
    """A node script over the kernel's 128 KiB limit on one environment string still starts (the job used
    to die with 'Argument list too long'); the engine gets every argument."""
    cfg = job_config(tmp_path, tokens_per_s=500, extra_args=PADS)
    state = Path(cfg.state_dir)
    job_id = submit(cfg, cfg.models[0])
    try:
        rec = wait_for(lambda: record(state, job_id), 60, "endpoint record")
        assert rec["job_id"] == job_id
        r = wait_for(lambda: roles(job_id, state), 20, "the job's processes")
        assert all(p in r["engine"]["argv"] for p in PADS)
        assert len((state / "jobs" / f"{job_id}.0.node.sh").read_text()) > 141_000
    finally:
        slurm("scancel", job_id, check=False)
    wait_for(lambda: job_state(job_id) not in ("RUNNING", "COMPLETING"), 30, "job to end")
    wait_for(lambda: not job_processes(job_id), GONE_TIMEOUT_S, f"no process of job {job_id} left")


@pytest.mark.cluster
def test_a_killed_relay_starts_again_and_serves_the_events(cluster, tmp_path):
    """The job's KV-event relay, SIGKILLed (out of memory, say), is started again by its loop, in its process
    group, and a subscriber with the job's key gets the engine's events through the new one: kv_aware does
    not fall back to its approximate index for the rest of the job's life."""
    cfg = job_config(tmp_path, tokens_per_s=500)
    state = Path(cfg.state_dir)
    job_id = submit(cfg, cfg.models[0])
    ctx = zmq.Context()
    try:
        rec = wait_for(lambda: record(state, job_id), 60, "endpoint record")
        r = wait_for(lambda: roles(job_id, state), 20, "the job's processes")
        first = r["relay_proc"]["pid"]
        os.kill(first, signal.SIGKILL)
        again = wait_for(lambda: (roles(job_id, state).get("relay_proc") or {}).get("pid") not in (None, first)
                         and roles(job_id, state), 20, "the relay started again")
        assert again["relay_proc"]["pgid"] == again["relay"]["pid"] == r["relay"]["pid"]
        assert job_state(job_id) == "RUNNING"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        client_options(sub, server_key(rec["secret"]))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{rec['host']}:{rec['kv_port']}")
        frames = None
        for i in range(20):   # (a new subscription takes a moment to reach the relay: ask until one arrives)
            conn = http.client.HTTPConnection(rec["host"], rec["port"], timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({
                "model": "procs", "prompt": f"question {i} " + "about the document " * 40, "max_tokens": 2}),
                {"Authorization": f"Bearer {rec['secret']}", "Content-Type": "application/json"})
            assert conn.getresponse().status == 200
            conn.close()
            if sub.poll(1000):
                frames = sub.recv_multipart()
                break
        assert frames is not None, "no event through the restarted relay"
        assert frames[0] == rec["kv_topic"].encode() and len(frames) == 3
    finally:
        ctx.destroy(0)
        slurm("scancel", job_id, check=False)
    wait_for(lambda: job_state(job_id) not in ("RUNNING", "COMPLETING"), 30, "job to end")
    wait_for(lambda: not job_processes(job_id), GONE_TIMEOUT_S, f"no process of job {job_id} left")
