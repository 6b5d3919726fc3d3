"""Batches on the real cluster, through ``slurmfleet serve``: a daemon killed with SIGKILL in the middle of a
batch and started again finishes it with every ``custom_id`` answered exactly once; a dedicated batch
(``--shards 2``) submitted, watched and fetched with ``slurmfleet batch``, its shards shown with SLURM's
states."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, fleet_config, sim_model, slurm, wait_for

pytestmark = pytest.mark.cluster
KEY = "sk-batch-owner"


def cli(config: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURMFLEET_API_KEY": KEY}
    return subprocess.run([sys.executable, "-m", "orchestrator", "batch", "--config", str(config), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def status(config: Path, batch_id: str) -> dict:
    out = cli(config, "status", batch_id, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def write_input(path: Path, n: int, model: str, max_tokens: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": f"question {i}"}]}}) + "\n")
    return path


def test_sigkill_mid_batch_then_restart_loses_and_duplicates_nothing(tmp_path, fleet_name, daemons):
    """400 lines of 8 tokens at 40 tokens/s on 2 replicas of 8 slots (about 80 lines/s at most, so some
    seconds of work): SIGKILL the daemon once a quarter is answered, start it again, and the output has
    every custom_id exactly once (the requests in flight at the kill are sent again; their first answers,
    never written, are not in the output)."""
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name,
                       [sim_model("m", replicas=2, simulator={"tokens_per_s": 40, "max_num_seqs": 8})],
                       gateway={"api_keys": [{"name": "owner", "key": KEY}]})
    d = daemons(cfg)
    wait_for(lambda: len(d.ready("m")) == 2, 90, "2 READY replicas")
    out = cli(cfg, "submit", str(write_input(tmp_path / "in.jsonl", 400, "m", 8)))
    assert out.returncode == 0, out.stderr
    bid = out.stdout.strip()
    wait_for(lambda: status(cfg, bid)["request_counts"]["completed"] >= 100, 120, "a quarter answered")
    d.stop(signal.SIGKILL)
    before = status_file(cfg, bid)
    assert before["status"] == "in_progress" and 100 <= before["request_counts"]["completed"] < 400
    d2 = daemons(cfg)
    wait_for(lambda: status(cfg, bid)["status"] == "completed", 180, "the batch completed after the restart")
    b = status(cfg, bid)
    assert b["request_counts"] == {"total": 400, "completed": 400, "failed": 0}
    res = cli(cfg, "results", bid, "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    ids = [r["custom_id"] for r in rows]
    lost, dup = 400 - len(set(ids)), len(ids) - len(set(ids))
    print(f"SIGKILL at {before['request_counts']['completed']}/400 answered: after the restart "
          f"{len(ids)} lines, {lost} lost, {dup} duplicated")
    assert (lost, dup) == (0, 0) and set(ids) == {f"req-{i}" for i in range(400)}
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["usage"]["completion_tokens"] == 8
               for r in rows)
    assert d2.stop(signal.SIGTERM) == 0


def status_file(config: Path, batch_id: str) -> dict:
    """The record as the dead daemon left it on disk."""
    import yaml
    state = Path(yaml.safe_load(config.read_text())["state_dir"])
    return json.loads((state / "batches" / f"{batch_id}.json").read_text())


def test_a_dedicated_batch_runs_as_a_job_array_from_the_cli(tmp_path, fleet_name, daemons):
    """``batch submit --shards 2``: the daemon splits the input into a 2-task job array of the simulator's
    run-batch stand-in (the model's YAML: GPUs, partition), ``batch status`` shows each shard's SLURM state
    and task, and ``batch results`` gives every line once, in input order."""
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name,
                       [sim_model("m", replicas=0, simulator={"tokens_per_s": 50, "max_num_seqs": 2})],
                       gateway={"api_keys": [{"name": "owner", "key": KEY}]},
                       batches={"shard_poll_s": 0.5})
    d = daemons(cfg)
    out = cli(cfg, "submit", str(write_input(tmp_path / "in.jsonl", 20, "m", 4)), "--shards", "2")
    assert out.returncode == 0, out.stderr
    bid = out.stdout.strip()
    seen: set[str] = set()

    def shards() -> bool:
        text = cli(cfg, "status", bid)
        assert text.returncode == 0, text.stderr
        for ln in text.stdout.splitlines():
            if ln.strip().startswith("shard"):
                seen.add(ln.split()[2])
        return status(cfg, bid)["status"] in ("completed", "failed")
    wait_for(shards, 120, "the dedicated batch ended")
    b = status(cfg, bid)
    assert b["status"] == "completed" and b["request_counts"] == {"total": 20, "completed": 20, "failed": 0}, b
    assert [s["lines"] for s in b["slurm"]["shards"]] == [10, 10]
    assert all(s["state"] == "done" and s["job"].startswith(b["slurm"]["job_id"] + "_") for s in b["slurm"]["shards"])
    # the shards run for a second or two, so a poll may see only UNSUBMITTED (split, the array not yet sent) or
    # SUBMITTED before the end; the status after the end must show both shards done with their array task ids
    assert seen <= {"UNSUBMITTED", "SUBMITTED", "PENDING", "RUNNING", "done"}, seen
    final = [ln.split() for ln in cli(cfg, "status", bid).stdout.splitlines() if ln.strip().startswith("shard")]
    assert len(final) == 2 and all(f[2] == "done" for f in final), final
    assert {s["job"] for s in b["slurm"]["shards"]} <= {w for f in final for w in f}, final
    res = cli(cfg, "results", bid, "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [f"req-{i}" for i in range(20)]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 4 for r in rows)
    assert not (Path(d.cfg["state_dir"]) / "batches" / f"{bid}.array").exists()   # shards and logs: gone
    assert d.stop(signal.SIGTERM) == 0


def test_a_spent_budget_holds_a_dedicated_batch_in_slurm_until_it_is_raised(tmp_path, fleet_name, daemons):
    """The owner's token budget (60) is passed by the first shard of a 6-shard array run one task at a time
    (about 3 s a shard): the tasks that have not started are held in SLURM (``JobHeldUser``) and ``batch
    status`` says why; while they wait at most the task running at the hold finishes; a reload that raises the
    budget releases them and the batch completes with every line answered once."""
    owner = {"name": "owner", "key": KEY, "budget_tokens": 60, "budget_period": "month"}
    model = sim_model("m", replicas=0, simulator={"tokens_per_s": 5, "max_num_seqs": 1})
    cfg = fleet_config(tmp_path / "f.yaml", fleet_name, [model], gateway={"api_keys": [owner]},
                       batches={"shard_poll_s": 0.5, "max_parallel_shards": 1})
    d = daemons(cfg)
    out = cli(cfg, "submit", str(write_input(tmp_path / "in.jsonl", 24, "m", 4)), "--shards", "6")
    assert out.returncode == 0, out.stderr
    bid = out.stdout.strip()

    def held_tasks() -> int:
        job = (status(cfg, bid).get("slurm") or {}).get("job_id")
        listing = slurm("squeue", "-h", "-r", "-j", job, "-t", "PENDING", "-O", "Reason:20") if job else ""
        return sum("JobHeldUser" in ln for ln in listing.splitlines())

    def done(b: dict) -> int:
        return sum(s["state"] == "done" for s in b["slurm"]["shards"])
    wait_for(lambda: (status(cfg, bid).get("slurm") or {}).get("held"), 120, "the batch held")
    b = status(cfg, bid)
    assert "budget of key owner is spent" in b["slurm"]["held"], b["slurm"]
    done_then = done(b)
    assert 1 <= done_then <= 4, b["slurm"]["shards"]
    wait_for(lambda: held_tasks() >= 5 - done_then, 10, "the tasks not started held in SLURM")
    text = cli(cfg, "status", bid).stdout
    assert "held:" in text and "budget" in text, text
    time.sleep(8)   # SLURM had time to start what it would: at most the task running at the hold finished
    b = status(cfg, bid)
    print(f"held with {done_then} of 6 shards done; 8 s later {done(b)} done, {held_tasks()} tasks held")
    assert b["status"] == "in_progress" and b["slurm"]["held"], b
    assert done(b) <= done_then + 1 and held_tasks() >= 5 - done_then, b["slurm"]["shards"]

    owner["budget_tokens"] = 1_000_000
    fleet_config(cfg, fleet_name, [model], gateway={"api_keys": [owner], "port": d.cfg["gateway"]["port"]},
                 batches={"shard_poll_s": 0.5, "max_parallel_shards": 1},
                 daemon={"admin_port": d.cfg["daemon"]["admin_port"]})
    d.send(signal.SIGHUP)
    wait_for(lambda: status(cfg, bid)["status"] in ("completed", "failed"), 180, "the batch ended after the raise")
    b = status(cfg, bid)
    assert b["status"] == "completed" and b["request_counts"] == {"total": 24, "completed": 24, "failed": 0}, b
    assert b["slurm"]["held"] is None and held_tasks() == 0
    res = cli(cfg, "results", bid, "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0, res.stderr
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()] == \
        [f"req-{i}" for i in range(24)]
    assert d.stop(signal.SIGTERM) == 0
