"""A reload shows each job it changes to SLURM (``sbatch --test-only``) before anything applies: a job SLURM
refuses makes it refuse the reload, and the model's replicas still starting are not cancelled for a job that
would never come.  Fake SLURM on a fake clock; the same against the real cluster in ``test_daemon.py``."""

from __future__ import annotations

import yaml

from fakes import sbatch_option
from orchestrator.daemon import Daemon
from orchestrator.fleet.replica import State
from orchestrator.fleet.slurm import SlurmError
from orchestrator.fleetfile import load_config_text
from reconciler_harness import Harness
from test_hardening import stub_parts

BAD_PARTITION = "sbatch: error: invalid partition specified: nope\nallocation failure: Invalid partition name specified"
NO_NODES = "allocation failure: Requested node configuration is not available"


def fleet_text(tmp_path, **model) -> str:
    m = {"name": "m", "engine": "simulator", "replicas": 2, "container": {"enabled": False},
         "probe": {"interval_s": 1}, **model}
    return yaml.safe_dump({"fleet": "f", "state_dir": str(tmp_path / "s"), "cluster": {"partition": "gpu"},
                           "models": [{"name": "other", "engine": "simulator", "container": {"enabled": False}}, m]},
                          sort_keys=False)


async def starting_fleet(tmp_path):
    """A daemon whose model ``m`` has 2 replicas PENDING (starting: what a changed shape cancels at once)."""
    path = tmp_path / "f.yaml"
    path.write_text(fleet_text(tmp_path))
    daemon = Daemon(path, load_config_text(path.read_text(), str(path), {}))
    h = Harness()
    h.slurm.start_state = "PENDING"
    h.rec.apply_config(daemon.cfg)
    await h.tick()
    stub_parts(daemon)
    daemon.reconciler, daemon.slurm = h.rec, h.slurm
    jobs = {jid for jid, f in h.rec.replicas.items() if f.model == "m"}
    assert len(jobs) == 2 and all(h.rec.state_of(h.rec.replicas[j]) == State.QUEUED for j in jobs)
    return daemon, h, path, jobs


def refuse(text: str, when: str, transient: bool = False):
    return lambda script: SlurmError("sbatch", text, transient) if when in script else None


async def test_a_reload_to_a_partition_slurm_refuses_is_refused_at_its_line_and_cancels_nothing(tmp_path):
    daemon, h, path, jobs = await starting_fleet(tmp_path)
    h.slurm.judge = refuse(BAD_PARTITION, "--partition=nope")
    path.write_text(fleet_text(tmp_path, partition="nope"))
    submits = h.slurm.submits
    res = await daemon.reload()
    assert res["ok"] is False and len(res["errors"]) == 1, res
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.startswith("- name: m"))
    assert res["errors"][0].startswith(f"{path}:{line}:"), res   # at the model's entry
    assert "models[1]: SLURM refuses model m's job (sbatch --test-only)" in res["errors"][0]
    assert "Invalid partition name specified" in res["errors"][0]
    # only the changed model's job was shown to SLURM (model `other` keeps its shape), as sbatch would get it
    assert [sbatch_option(s, "partition") for s in h.slurm.tested] == ["nope"]
    assert "model=m;" in sbatch_option(h.slurm.tested[0], "comment")
    await h.tick(5, advance_s=2)
    assert daemon.cfg.model("m").partition is None and h.slurm.cancels == [] and h.slurm.submits == submits
    assert {jid for jid, f in h.rec.replicas.items() if f.model == "m"} == jobs


async def test_more_gpus_than_a_node_has_is_refused_where_the_current_job_fits(tmp_path):
    """"Requested node configuration is not available" is ambiguous under --test-only (nodes drained give it
    too): the current job is asked as well, and SLURM taking it says the new shape is the trouble."""
    daemon, h, path, jobs = await starting_fleet(tmp_path)
    h.slurm.judge = refuse(NO_NODES, "--gres=gpu:16")
    path.write_text(fleet_text(tmp_path, gpus_per_node=16))
    res = await daemon.reload()
    assert res["ok"] is False and "where its current job fits" in res["errors"][0], res
    assert [sbatch_option(s, "gres") for s in h.slurm.tested] == ["gpu:16", "gpu:1"]
    await h.tick(3, advance_s=2)
    assert h.slurm.cancels == [] and {j for j, f in h.rec.replicas.items() if f.model == "m"} == jobs


async def test_nodes_down_or_a_controller_away_let_the_reload_apply_with_a_warning(tmp_path):
    """SLURM refusing the current job too (every node drained) or not answering refuses nothing: the reload
    applies, its reply and log say the check did not happen."""
    daemon, h, path, jobs = await starting_fleet(tmp_path)
    h.slurm.judge = refuse(NO_NODES, "#SBATCH")   # (every job, the current one too)
    path.write_text(fleet_text(tmp_path, gpus_per_node=2))
    res = await daemon.reload()
    assert res["ok"] is True and res["changes"] == ["model m changed (gpus_per_node): rolling its replicas"], res
    assert res["warnings"] == [f"model m: SLURM cannot place it on the nodes up now: {NO_NODES}; applied without "
                               "SLURM's check"]
    assert daemon.cfg.model("m").gpus_per_node == 2
    h.slurm.judge = refuse("Unable to contact slurm controller (connect failure)", "#SBATCH", transient=True)
    path.write_text(fleet_text(tmp_path, gpus_per_node=3))
    res = await daemon.reload()
    assert res["ok"] is True and "SLURM could not be asked: Unable to contact slurm controller" \
        in res["warnings"][0], res
    # a reload that changes no job shape asks SLURM nothing
    asked = len(h.slurm.tested)
    path.write_text(fleet_text(tmp_path, gpus_per_node=3, replicas=1))
    assert (await daemon.reload()) == {"ok": True, "config": str(path),
                                       "changes": ["model m updated (2 -> 1 replicas)"]}
    assert len(h.slurm.tested) == asked


async def test_a_model_a_reload_adds_is_shown_to_slurm_too(tmp_path):
    daemon, h, path, _ = await starting_fleet(tmp_path)
    doc = yaml.safe_load(fleet_text(tmp_path))
    doc["models"].append({"name": "new", "engine": "simulator", "container": {"enabled": False},
                          "partition": "nope"})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    h.slurm.judge = refuse(BAD_PARTITION, "--partition=nope")
    res = await daemon.reload()
    assert res["ok"] is False and "models[2]: SLURM refuses model new's job" in res["errors"][0], res
    assert daemon.cfg.model("new") is None
    h.slurm.judge = refuse(NO_NODES, "#SBATCH")   # a new model has no current job to compare with: a warning
    res = await daemon.reload()
    assert res["ok"] is True and res["warnings"][0].startswith("model new: SLURM cannot place it"), res


async def test_a_job_count_limit_is_the_clusters_state_not_the_new_shapes(tmp_path):
    """"job submit limit" is also the user's job count (at MaxSubmitJobs every reload that changed a shape was
    refused until jobs ended): refused only where the current job is taken, else a warning."""
    daemon, h, path, jobs = await starting_fleet(tmp_path)
    limit = "Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"
    h.slurm.judge = refuse(limit, "#SBATCH")   # (every job: the count)
    path.write_text(fleet_text(tmp_path, gpus_per_node=2))
    res = await daemon.reload()
    assert res["ok"] is True and res["warnings"][0].startswith("model m: SLURM takes no more jobs of this user or QOS now"), res
    h.slurm.judge = refuse(limit, "--gres=gpu:3")   # (the new shape alone: too large for the QOS)
    path.write_text(fleet_text(tmp_path, gpus_per_node=3))
    res = await daemon.reload()
    assert res["ok"] is False and "where its current job fits" in res["errors"][0], res
