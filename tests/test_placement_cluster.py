"""A model's GPU type and node features on the real local cluster (its fake GPUs are typed: a100 on odd nodes,
h100 on even ones, each node's type also its feature): replicas land on the nodes that have them, a type or
feature SLURM has not is refused with SLURM's words, and a reload to one keeps the fleet."""

from __future__ import annotations

import re

import yaml

from conftest import fleet_config, fleet_jobs, sim_model, slurm, wait_for
from orchestrator.devtools.localcluster import LocalCluster

import pytest

pytestmark = pytest.mark.cluster


def test_gpu_type_and_constraint_place_replicas_and_an_unknown_one_is_refused(tmp_path, fleet_name, daemons):
    kinds = dict(zip(LocalCluster().node_names, LocalCluster().gpu_types))
    path = fleet_config(tmp_path / "f.yaml", fleet_name, [
        sim_model("big", 2, gpu_type="h100"), sim_model("feat", 1, constraint="a100"),
        sim_model("nvl", 1, constraint="nvlink")])
    d = daemons(path)
    big = wait_for(lambda: len(r := d.ready("big")) == 2 and r, 60, "big's 2 replicas READY")
    feat = wait_for(lambda: d.ready("feat"), 60, "feat READY")
    assert {kinds[r["nodes"]] for r in big} == {"h100"}, big
    assert kinds[feat[0]["nodes"]] == "a100", feat
    gres = slurm("squeue", "-h", "-j", big[0]["job_id"], "-o", "%b").strip()
    assert re.search(r"gpu:h100[:=]1$", gres), gres   # (gres:gpu:h100:1 on 22.05; 24.11 may write gres/gpu:h100=1)
    m = wait_for(lambda: (x := d.model("nvl"))["blocked"] and x, 30, "nvl blocked")
    assert "Invalid feature specification" in m["blocked"], m
    # a reload to a type SLURM has not: refused before anything of the fleet changes
    cfg = yaml.safe_load(path.read_text())
    cfg["models"][0]["gpu_type"] = "v100"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    code, res = d.request("POST", "/admin/reload")
    assert res["ok"] is False and "SLURM refuses model big's job" in res["errors"][0], res
    jobs = {j["job_id"] for j in fleet_jobs(fleet_name)}
    assert {r["job_id"] for r in big} <= jobs and len(jobs) == 3
