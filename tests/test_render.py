"""Rendered job scripts: valid bash, shellcheck-clean, every YAML value quoted."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from orchestrator.fleetfile import load_config_text
from orchestrator.fleet.render import JobTag, Renderer

HOSTILE = ["$(touch /tmp/pwned)", "; rm -rf ~", "`id`", "it's \"quoted\"", "a\nb", "$HOME", "*", "\\", "--x=1 --y"]


def fleet(models: str, extra: str = "") -> object:
    return load_config_text(f"""\
fleet: t
state_dir: /tmp/sf-render
cluster:
  partition: gpu
  account: acct
  sbatch_options: {{mail-type: FAIL, exclusive: true}}
{extra}models:
{models}""", "t.yaml", {})


SINGLE = """\
  - name: m1
    model_path: /models/m1
    container: {image: /img/vllm.sif, binds: ['/data:/data:ro']}
    env: {HF_HOME: /cache}
    memory: 64G
    vllm_args: {max-model-len: 4096, enable-prefix-caching: true, disabled-flag: false}
"""
MULTI = """\
  - name: big
    model_path: /models/big
    nodes: 2
    gpus_per_node: 8
    tensor_parallel_size: 8
    pipeline_parallel_size: 2
    container: {image: /img/vllm.sif}
"""


KV = SINGLE.replace("memory: 64G", "memory: 64G\n    routing: kv_aware")


@pytest.mark.parametrize("models", [SINGLE, MULTI, KV], ids=["single", "multi", "kv_aware"])
def test_script_passes_bash_n_and_shellcheck(models, tmp_path):
    cfg = fleet(models)
    r = Renderer()
    m = cfg.models[0]
    script = tmp_path / "job.sh"
    script.write_text(r.render(cfg, m, slot=1, nonce="n1", exclude=("node3",)))
    node = tmp_path / "node.sh"
    node.write_text("#!/bin/bash\n" + r.node_script(m) + "\n")
    for f in (script, node):
        subprocess.run(["bash", "-n", str(f)], check=True)
        if shutil.which("shellcheck") is None:
            pytest.fail("shellcheck is not installed (apt-get install shellcheck)")
        res = subprocess.run(["shellcheck", "-s", "bash", str(f)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_sbatch_header_and_engine_line():
    cfg = fleet(SINGLE)
    text = Renderer().render(cfg, cfg.models[0], slot=2, nonce="abc", exclude=("node3", "node4"))
    for line in ["#SBATCH --job-name=slurmfleet-t", "#SBATCH --gres=gpu:1", "#SBATCH --mem=64G",
                 "#SBATCH --partition=gpu", "#SBATCH --account=acct", "#SBATCH --exclude=node3,node4",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --mail-type=FAIL", "#SBATCH --exclusive",
                 "#SBATCH --no-requeue", "#SBATCH --time=0-04:00:00"]:
        assert line in text.splitlines(), line
    tag = JobTag.decode(next(ln for ln in text.splitlines() if ln.startswith("#SBATCH --comment="))[18:])
    assert tag == JobTag("t", "m1", 2, cfg.models[0].job_hash(), "abc")
    # the container's environment is exported, never in the command line that ps shows every user
    assert 'apptainer exec --nv --bind /data:/data:ro --bind "$SF_PYLIB:$SF_PYLIB:ro" /img/vllm.sif )' in text
    assert "\nexport APPTAINERENV_HF_HOME=/cache\n" in text and "--env" not in text
    assert '\nexport APPTAINERENV_PYTHONPATH="$SF_PYLIB${APPTAINERENV_PYTHONPATH:+:$APPTAINERENV_PYTHONPATH}"\n' in text
    assert "--middleware slurmfleet_engine_auth.RequireSecret" in text and "class RequireSecret" in text
    assert "--max-model-len 4096 --enable-prefix-caching )" in text and "disabled-flag" not in text
    assert "CUDA_VISIBLE_DEVICES=" not in text.replace("CUDA_VISIBLE_DEVICES=${", "")  # never set, only printed


def test_multi_node_uses_one_srun_step_and_vllm_flags():
    cfg = fleet(MULTI)
    text = Renderer().render(cfg, cfg.models[0])
    assert text.count("srun ") == 1
    # (srun no longer takes sbatch's --cpus-per-task since SLURM 22.05: each node's step had one CPU)
    assert f"--ntasks-per-node=1 --cpus-per-task={cfg.models[0].cpus_per_task} " in text
    assert "--kill-on-bad-exit=1" in text and "#SBATCH --nodes=2" in text and "#SBATCH --gres=gpu:8" in text
    assert '--nnodes 2 --node-rank "$SF_RANK" --master-addr "$SF_HEAD_ADDR"' in text
    assert "SF_ARGV+=( --headless )" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text


def test_stagger_shortens_later_slots():
    cfg = fleet(SINGLE.replace("memory: 64G", "memory: 64G\n    drain: {stagger_s: 1800}"))
    r = Renderer()
    assert "#SBATCH --time=0-04:00:00" in r.render(cfg, cfg.models[0], slot=0)
    assert "#SBATCH --time=0-03:30:00" in r.render(cfg, cfg.models[0], slot=1)


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_single_words_to_bash(value, tmp_path):
    """Each hostile value, rendered, evaluates in bash to exactly the original string (no expansion)."""
    import json

    path = "./" + value if value.startswith("-") else value   # (a leading '-' is refused: an option's)
    cfg = fleet(f"""\
  - name: m1
    model_path: {json.dumps(path)}
    container: {{enabled: false}}
    env: {{EVIL: {json.dumps(value)}}}
    vllm_args: {{chat-template: {json.dumps(value)}}}
""")
    node = Renderer().node_script(cfg.models[0])
    launch = '"${SF_EXEC[@]}" "${SF_ARGV[@]}" &'
    assert launch in node
    probe = tmp_path / "probe.sh"
    probe.write_text(node.replace(launch, 'printf "%s\\0" "${SF_ARGV[@]}" "$EVIL"; exit 0'))
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "SF_PORT": "1", "SF_RECORD": str(tmp_path / "r"),
           "SF_SECRET": "s", "SF_HEAD_ADDR": "127.0.0.1", "SF_MASTER_PORT": "2", "SLURM_JOB_ID": "1",
           "SF_PYLIB": str(tmp_path / "pylib")}
    out = subprocess.run(["bash", str(probe)], capture_output=True, cwd=tmp_path, env=env)
    args = out.stdout.decode().split("\0")[:-1]
    assert args[2] == path, args
    assert args[args.index("--chat-template") + 1] == value
    assert args[-1] == value
    assert not (tmp_path / "pwned").exists()


def test_a_kv_aware_engine_publishes_in_a_private_folder_behind_the_jobs_relay():
    """vLLM's event sockets are ipc:// in a node-local 0700 folder (bound into the container), the relay (written
    next to the job, run with the image's python3) serves them on the record's ports."""
    cfg = fleet(KV)
    r = Renderer()
    job, node = r.render(cfg, cfg.models[0]), r.node_script(cfg.models[0])
    assert 'SF_KV_DIR="$(mktemp -d /tmp/sfkv.XXXXXXXX)"' in node and '--bind "$SF_KV_DIR:$SF_KV_DIR"' in node
    assert '\\"endpoint\\":\\"ipc://${SF_KV_DIR}/events\\",\\"replay_endpoint\\":\\"ipc://${SF_KV_DIR}/replay\\"' in node
    assert ('slurmfleet-kv-relay "${SF_EXEC[@]}" python3 "$SF_PYLIB/slurmfleet_kv_relay.py" "ipc://$SF_KV_DIR/events" '
            '"tcp://*:$SF_KV_PORT" "ipc://$SF_KV_DIR/replay" "tcp://*:$SF_KV_REPLAY_PORT"') in node
    assert '--bind "$SF_PYLIB:$SF_PYLIB:ro"' in node and 'rm -rf "$SF_KV_DIR"' in node
    assert '"kv_curve":%d' in node and 'cat > "$SF_PYLIB/slurmfleet_kv_relay.py"' in job and "def curve_keys" in job
    plain = fleet(SINGLE)
    assert "slurmfleet_kv_relay" not in r.render(plain, plain.models[0]) + r.node_script(plain.models[0])
