"""``sbatch --test-only`` against the real local cluster (22.05 here, 24.11 in CI's other release): what the
reload's and ``slurmfleet validate --slurm``'s check reads from SLURM, and a running daemon keeping its fleet
when a reload names a partition SLURM does not have."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, fleet_config, fleet_jobs, sim_model, slurm, wait_for
from orchestrator.fleet.preflight import NODES_NOW
from orchestrator.fleet.replica import PARTITION_CLOSED
from orchestrator.fleet.render import Renderer
from orchestrator.fleet.slurm import CliSlurm, SlurmError
from orchestrator.fleetfile import load_config

pytestmark = pytest.mark.cluster


def test_test_only_takes_a_job_refuses_a_bad_partition_and_an_impossible_node(tmp_path, cluster):
    def answer(**model) -> SlurmError | None:
        cfg = load_config(fleet_config(tmp_path / "f.yaml", "pre", [sim_model("m", **model)]))
        cli = CliSlurm(cfg.job_name, cfg.cluster.slurm_conf)
        try:
            asyncio.run(cli.will_run(Renderer().render(cfg, cfg.models[0], 0, "preflight")))
        except SlurmError as exc:
            return exc
        return None

    assert answer() is None
    bad = answer(partition="nosuch")
    assert bad is not None and not bad.transient and "Invalid partition name specified" in str(bad)
    big = answer(gpus_per_node=16)   # (nodes of 4 GPUs)
    assert big is not None and not big.transient and NODES_NOW.search(str(big)), big
    assert not fleet_jobs("pre"), "--test-only submitted a job"


def test_validate_slurm_reports_the_refused_model_at_its_line(tmp_path, cluster):
    def validate(*models) -> subprocess.CompletedProcess:
        path = fleet_config(tmp_path / "f.yaml", "pre", list(models))
        return subprocess.run([sys.executable, "-m", "orchestrator", "validate", "--slurm", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    ok = validate(sim_model("a"), sim_model("b", partition="short"))
    assert ok.returncode == 0 and "warning" not in ok.stderr, ok.stdout + ok.stderr
    bad = validate(sim_model("a"), sim_model("b", partition="nosuch"))
    path = tmp_path / "f.yaml"
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.strip() == "- name: b")
    assert bad.returncode == 2 and bad.stdout.startswith(f"{path}:{line}:"), bad.stdout + bad.stderr
    assert "models[1]: SLURM refuses model b's job (sbatch --test-only)" in bad.stdout
    assert "Invalid partition name specified" in bad.stdout and "model a" not in bad.stdout
    # no current job to compare with: SLURM's answer may be the nodes' state, so a warning, not a problem
    big = validate(sim_model("a", gpus_per_node=16))
    assert big.returncode == 0 and "warning: model a: SLURM cannot place it on the nodes up now" in big.stderr, \
        big.stdout + big.stderr
    assert big.stderr.count("SLURM cannot place it") == 1, big.stderr   # (printed, and logged as well)
    assert "SLURM did not judge its job" in big.stderr


def test_a_running_daemon_refuses_a_reload_to_a_partition_slurm_has_not(tmp_path, fleet_name, daemons):
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 1)])
    d = daemons(path)
    job = wait_for(lambda: d.ready("m"), 60, "READY")[0]["job_id"]
    cfg = yaml.safe_load(path.read_text())
    cfg["models"][0]["partition"] = "nosuch"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    code, res = d.request("POST", "/admin/reload")
    assert res["ok"] is False and "SLURM refuses model m's job" in res["errors"][0], res
    assert "Invalid partition name specified" in res["errors"][0]
    ticks = d.status()["ticks"]
    wait_for(lambda: d.status()["ticks"] >= ticks + 4, 30, "4 more ticks")
    assert [r["job_id"] for r in d.ready("m")] == [job] and [j["job_id"] for j in fleet_jobs(fleet_name)] == [job]
    assert "submitted job" not in d.logs().split("reload rejected")[-1]   # (nothing submitted since)


@pytest.fixture
def drained(cluster):
    """A partition of its own (node4), set DRAIN as for a maintenance: SLURM refuses new jobs in it (the other
    partitions, which other tests use, stay up)."""
    import os
    name = f"maint{os.getpid()}"
    slurm("scontrol", "create", f"partitionname={name}", "nodes=node4", "state=drain")
    yield name
    slurm("scancel", "-p", name, check=False)
    wait_for(lambda: not slurm("squeue", "-h", "-p", name).strip(), 60, f"{name}'s jobs gone")
    slurm("scontrol", "delete", f"partitionname={name}")


def test_a_model_whose_partition_is_drained_waits_and_starts_when_it_opens_without_a_reload(
        tmp_path, fleet_name, drained, daemons):
    """sbatch's "Required partition not available (inactive or drain)" blocked the model until a reload: a
    maintenance of a few hours left it at zero after its end.  Now the model tries again every backoff.max_s
    and is up once the partition is; a reload's check to it warns instead of refusing."""
    bad = answer_of(tmp_path, partition=drained)
    assert bad is not None and PARTITION_CLOSED.search(str(bad)), bad
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [sim_model("m", 1, partition=drained)])
    d = daemons(path)
    m = wait_for(lambda: (x := d.model("m"))["last_error"] and x, 30, "the refused sbatch")
    assert m["blocked"] is None and m["backoff_cause"] == "partition_closed", m
    assert "partition not available" in m["last_error"] and not fleet_jobs(fleet_name)
    cfg = yaml.safe_load(path.read_text())   # a model added on it: SLURM's check warns, the reload applies
    cfg["models"].append(sim_model("m2", 1, partition=drained))
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    code, res = d.request("POST", "/admin/reload")
    assert res["ok"] is True and any("its partition takes no new jobs now" in w for w in res["warnings"]), res
    slurm("scontrol", "update", f"partitionname={drained}", "state=up")
    wait_for(lambda: d.ready("m") and d.ready("m2"), 60, "both READY once the partition is up")
    assert [j["nodes"] for j in fleet_jobs(fleet_name)] == ["node4"] * 2


def answer_of(tmp_path, **model) -> SlurmError | None:
    """``sbatch --test-only``'s answer to a model's job."""
    cfg = load_config(fleet_config(tmp_path / "f.yaml", "pre", [sim_model("m", **model)]))
    try:
        asyncio.run(CliSlurm(cfg.job_name, cfg.cluster.slurm_conf).will_run(
            Renderer().render(cfg, cfg.models[0], 0, "preflight")))
    except SlurmError as exc:
        return exc
    return None
