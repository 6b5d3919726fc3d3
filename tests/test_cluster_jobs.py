"""Rendered jobs on the real local SLURM cluster: records, secrets, multi-node ranks, GPUs, quoting."""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import ROOT, fleet_config, slurm, wait_for
from orchestrator.fleetfile import load_config
from orchestrator.fleet.render import Renderer
from orchestrator.fleet.slurm import CliSlurm

pytestmark = pytest.mark.cluster


def http(url: str, key: str | None = None, body: dict | None = None, timeout: float = 10) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, headers=headers, data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def job_state(job_id: str) -> str:
    return slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").strip()


def record(state_dir: Path, job_id: str) -> dict | None:
    p = state_dir / "endpoints" / f"{job_id}.json"
    return json.loads(p.read_text()) if p.exists() else None


def submit(cfg, model, slot=0) -> str:
    (Path(cfg.state_dir) / "logs").mkdir(parents=True, exist_ok=True)  # slurmd opens --output before the script runs
    client = CliSlurm(cfg.job_name, os.environ["SLURM_CONF"])
    return asyncio.run(client.submit(Renderer().render(cfg, model, slot, nonce=uuid.uuid4().hex[:8])))


def test_local_yaml_job_publishes_record_needs_secret_and_cleans_up(cluster, tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("SLURMFLEET_STATE_DIR", str(state))
    monkeypatch.setenv("SLURMFLEET_FLEET", "t" + uuid.uuid4().hex[:8])  # not the demo's fleet, if one runs
    cfg = load_config(ROOT / "configs" / "local.yaml")
    model = cfg.model("sim-small")
    job_id = submit(cfg, model)
    try:
        wait_for(lambda: job_state(job_id) == "RUNNING", 30, "RUNNING")
        rec = wait_for(lambda: record(state, job_id), 30, "endpoint record")
        assert rec["job_id"] == job_id and rec["model"] == "sim-small" and rec["restart_count"] == 0
        assert oct((state / "endpoints" / f"{job_id}.json").stat().st_mode & 0o777) == "0o600"
        base = f"http://{rec['host']}:{rec['port']}"
        assert http(base + "/v1/models")[0] == 401
        assert http(base + "/v1/models", key="wrong")[0] == 401
        for path in ("/metrics", "/health", "/tokenize"):   # every path, as vLLM with the job's middleware
            assert http(base + path)[0] == 401, path
        assert http(base + "/metrics", key=rec["secret"])[0] == 200
        code, body = http(base + "/v1/models", key=rec["secret"])
        assert code == 200 and json.loads(body)["data"][0]["id"] == "sim-small"
        code, body = http(base + "/v1/completions", key=rec["secret"], body={"model": "sim-small", "prompt": "x",
                                                                            "max_tokens": 3})
        assert code == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
        log = wait_for(lambda: list((state / "logs").glob(f"*-{job_id}.log")), 10, "job log")[0].read_text()
        # one GPU, whichever of the node's four SLURM handed out (another test's job may hold GPU 0)
        assert f"job={job_id}" in log and re.search(r" CUDA_VISIBLE_DEVICES=[0-3]\n", log)
    finally:
        slurm("scancel", job_id)
    wait_for(lambda: job_state(job_id) == "CANCELLED", 30, "CANCELLED")
    wait_for(lambda: record(state, job_id) is None, 15, "record removed")


def test_two_node_job_runs_every_rank_with_head_address(cluster, tmp_path, shim_path, monkeypatch):
    dump = tmp_path / "argv"
    monkeypatch.setenv("SF_ARGV_DUMP_DIR", str(dump))
    path = fleet_config(tmp_path / "fleet.yaml", "t" + uuid.uuid4().hex[:6], [
        {"name": "pp2", "engine": "vllm", "model_path": "/models/pp2", "nodes": 2, "gpus_per_node": 1,
         "tensor_parallel_size": 1, "pipeline_parallel_size": 2, "cpus_per_task": 1,
         "container": {"enabled": False}, "vllm_args": {"api-server-count": 2}}])
    cfg = load_config(path)
    job_id = submit(cfg, cfg.models[0])
    state = Path(cfg.state_dir)
    try:
        rec = wait_for(lambda: record(state, job_id), 60, "endpoint record of the 2-node job")
        argv = {rank: (dump / f"{job_id}.{rank}.argv").read_bytes().split(b"\0")[:-1] for rank in (0, 1)}
        for rank, args in argv.items():
            a = [x.decode() for x in args]
            assert a[:2] == ["serve", "/models/pp2"]
            assert a[a.index("--nnodes") + 1] == "2" and a[a.index("--node-rank") + 1] == str(rank)
            assert a[a.index("--master-addr") + 1] == rec["host"] == "127.0.0.1"
            assert a[a.index("--pipeline-parallel-size") + 1] == "2"
            assert ("--headless" in a) is (rank == 1)
            assert ("--api-server-count" in a) is (rank == 0)   # (vLLM refuses it with --headless)
        nodes = slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip()
        assert nodes.startswith("node") and "[" in nodes  # two distinct slurmd nodes
        code, body = http(f"http://{rec['host']}:{rec['port']}/v1/completions", key=rec["secret"],
                          body={"model": "pp2", "prompt": "x", "max_tokens": 2})
        assert code == 200, body
        # the worker rank dies: the whole job ends (no half-alive replica)
        env1 = (dump / f"{job_id}.1.env").read_text()
        assert "SLURM_NODEID=1" in env1
        worker = [ln for ln in slurm("ps", "-eo", "pid,args").splitlines()
                  if "orchestrator.devtools.simulator" in ln and "--headless" in ln and "/models/pp2" in ln]
        assert len(worker) == 1, worker
        os.kill(int(worker[0].split()[0]), 9)
        wait_for(lambda: job_state(job_id) in ("FAILED", "COMPLETED", "CANCELLED"), 60, "job to end")
        wait_for(lambda: record(state, job_id) is None, 15, "record removed")
    finally:
        slurm("scancel", job_id, check=False)


def test_gpus_per_node_two_sees_two_devices(cluster, tmp_path, shim_path, monkeypatch):
    dump = tmp_path / "argv"
    monkeypatch.setenv("SF_ARGV_DUMP_DIR", str(dump))
    path = fleet_config(tmp_path / "fleet.yaml", "t" + uuid.uuid4().hex[:6], [
        {"name": "tp2", "engine": "vllm", "model_path": "/m", "gpus_per_node": 2, "tensor_parallel_size": 2,
         "cpus_per_task": 1, "container": {"enabled": False}}])
    cfg = load_config(path)
    job_id = submit(cfg, cfg.models[0])
    try:
        wait_for(lambda: record(Path(cfg.state_dir), job_id), 60, "record")
        env = dict(ln.split("=", 1) for ln in (dump / f"{job_id}.0.env").read_text().splitlines() if "=" in ln)
        devices = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(devices) == 2 and len(set(devices)) == 2
    finally:
        slurm("scancel", job_id, check=False)


def test_hostile_strings_reach_the_engine_literally(cluster, tmp_path, shim_path, monkeypatch):
    dump = tmp_path / "argv"
    monkeypatch.setenv("SF_ARGV_DUMP_DIR", str(dump))
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex[:8]}")
    hostile = [f"$(touch {marker})", f"; touch {marker}", f"`touch {marker}`", "it's \"q\" \\ $HOME *"]
    image = tmp_path / "vllm.sif"
    image.write_text("fake image")
    monkeypatch.setenv("SF_APPTAINER_REQUIRE_NV", "1")
    monkeypatch.setenv("SF_APPTAINER_LOG", str(tmp_path / "apptainer.log"))
    path = fleet_config(tmp_path / "fleet.yaml", "t" + uuid.uuid4().hex[:6], [
        {"name": "evil", "engine": "vllm", "model_path": hostile[0], "gpus_per_node": 1, "cpus_per_task": 1,
         "container": {"image": str(image), "binds": [f"{tmp_path}:/data:ro"]},
         "env": {"EVIL_ENV": hostile[1]},
         "vllm_args": {"chat-template": hostile[2], "tokenizer": hostile[3]}}])
    cfg = load_config(path)
    job_id = submit(cfg, cfg.models[0])
    try:
        wait_for(lambda: record(Path(cfg.state_dir), job_id), 60, "record")
        a = [x.decode() for x in (dump / f"{job_id}.0.argv").read_bytes().split(b"\0")[:-1]]
        assert a[1] == hostile[0]
        assert a[a.index("--chat-template") + 1] == hostile[2]
        assert a[a.index("--tokenizer") + 1] == hostile[3]
        env = (dump / f"{job_id}.0.env").read_text()
        assert f"EVIL_ENV={hostile[1]}" in env.splitlines()
        call = (tmp_path / "apptainer.log").read_text().split("\0")
        assert call[:2] == ["exec", "--nv"] and str(image) in call and f"{tmp_path}:/data:ro" in call
        assert not marker.exists()
    finally:
        slurm("scancel", job_id, check=False)


def test_an_arrays_tasks_not_started_are_held_and_released_with_tasks_running_and_ended(cluster, tmp_path):
    """What a dedicated batch does when its owner's budget is spent (CliSlurm.hold / release): scontrol
    answers an array's tasks range by range and fails for those that ended; the pending ones are held
    (JobHeldUser, as root too), a running one runs on, and the release lets the rest run.  A job SLURM has
    forgotten is nothing to do.  (Each task runs until the test makes its file.)"""
    name = f"holdtest-{uuid.uuid4().hex[:6]}"
    client = CliSlurm(name, os.environ["SLURM_CONF"])
    script = (f"#!/bin/bash\n#SBATCH --job-name={name}\n#SBATCH --partition=gpu\n#SBATCH --array=0-2%1\n"
              f"#SBATCH --output={tmp_path}/t-%a.log\n"
              f"while [ ! -e {tmp_path}/go-$SLURM_ARRAY_TASK_ID ]; do sleep 0.2; done\n")

    def tasks() -> dict[str, tuple[str, str | None]]:
        return {r.job_id: (r.state, r.reason) for r in asyncio.run(client.list_array_tasks(name))}

    job = asyncio.run(client.submit(script))
    try:
        wait_for(lambda: tasks().get(f"{job}_0", ("",))[0] == "RUNNING", 30, "task 0 running")
        asyncio.run(client.hold(job))
        assert {t: s for t, s in tasks().items() if t != f"{job}_0"} == {
            f"{job}_1": ("PENDING", "JobHeldUser"), f"{job}_2": ("PENDING", "JobHeldUser")}
        assert tasks()[f"{job}_0"][0] == "RUNNING"
        (tmp_path / "go-0").touch()
        wait_for(lambda: tasks()[f"{job}_0"][0] == "COMPLETED", 30, "task 0 done")
        asyncio.run(client.hold(job))          # again, with a task ended: no error
        assert tasks()[f"{job}_1"] == ("PENDING", "JobHeldUser")
        asyncio.run(client.release(job))
        asyncio.run(client.release(job))       # twice: no error either
        asyncio.run(client.hold("999999999"))  # a job SLURM does not know (any more)
        for i in (1, 2):
            (tmp_path / f"go-{i}").touch()
        wait_for(lambda: all(s == "COMPLETED" for s, _ in tasks().values()), 60, "every task done")
    finally:
        slurm("scancel", job, check=False)
