"""Rendered job scripts: valid bash, shellcheck-clean, every YAML value quoted."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.fleetfile import load_config_text
from orchestrator.yamlsrc import ConfigError
from orchestrator.fleet.render import JobTag, Renderer, run_batch_argv, state_tag

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
    vllm_args: {api-server-count: 2, uvicorn-log-level: warning, max-model-len: 8192}
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
    assert tag == JobTag("t", "m1", 2, cfg.models[0].job_hash(), "abc", state_tag(cfg.state_dir),
                         cfg.models[0].engine_hash())
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
    # the step gets the batch shell's SF_* whatever a site forces on sbatch (--export=NONE: unbound on each node)
    assert "  --export=ALL --kill-on-bad-exit=1" in text
    assert '--nnodes 2 --node-rank "$SF_RANK" --master-addr "$SF_HEAD_ADDR"' in text
    assert "SF_ARGV+=( --headless )" in text
    # the head's own flags on rank 0 alone: vLLM refuses --api-server-count with --headless (every start failed)
    assert ("SF_ARGV+=( --headless ); else SF_ARGV+=( --api-server-count 2 --uvicorn-log-level warning ); fi"
            in text)
    engine = next(ln for ln in text.splitlines() if ln.startswith("SF_ARGV=( "))
    assert "--max-model-len 8192" in engine and "--api-server-count" not in engine and "uvicorn" not in engine
    # a stop ends each node's task with 0, and the others get its grace: srun --kill-on-bad-exit KILLed every
    # other node at the first to end with 143 (a TERM's), cutting their stops short
    assert "trap 'exit 0' TERM INT" in text and "trap 'exit 143' TERM" not in text
    assert "--wait=$((SF_STOP_GRACE_S + 10))" in text
    single = Renderer().render(fleet(SINGLE), fleet(SINGLE).models[0])
    assert "trap 'exit 143' TERM" in single and "trap 'exit 0' TERM INT" not in single
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text


SHIMS = {   # what a two-node job's nodes answer, on hosts whose /etc/hosts maps their own name to 127.0.1.1
    "scontrol": """case "$*" in
  "show hostnames "*) printf 'gpu01\\ngpu02\\n' ;;
  "show node gpu02") echo "NodeName=gpu02 Arch=x86_64 NodeAddr=gpu02 NodeHostName=gpu02" ;;
esac""",
    "getent": """case "$SHIM_NODE:$2" in
  gpu01:gpu01|gpu02:gpu02) echo "127.0.1.1       STREAM $2" ;;
  *:gpu01) echo "10.1.0.1        STREAM gpu01" ;;
  *:gpu02) echo "10.1.0.2        STREAM gpu02" ;;
esac""",
    "ip": """case "$SHIM_NODE:$4" in
  gpu01:10.1.0.2) echo "10.1.0.2 dev ib0 src 10.1.0.1 uid 0" ;;
  gpu02:10.1.0.1) echo "10.1.0.1 dev ib0 src 10.1.0.2 uid 0" ;;
  *:127.*) echo "local $4 dev lo src 127.0.0.1 uid 0" ;;
esac""",
}


@pytest.mark.parametrize("rank,node,want", [("0", "gpu01", "10.1.0.1 ib0"), ("1", "gpu02", "10.1.0.2 ib0")])
def test_each_rank_advertises_its_address_on_the_jobs_network_even_where_its_name_is_loopback(tmp_path, rank, node,
                                                                                                 want):
    """The head resolved its own name (127.0.1.1 in Debian's /etc/hosts) and exported nothing: vLLM guessed its
    message queues' address, and torch's gloo bound loopback.  Each rank takes both from its route to another
    node of the job."""
    text = Renderer().node_script(fleet(MULTI).models[0])
    block = text[text.index('if [ "$SF_RANK" = 0 ]; then\n  SF_PEER='):text.index("SF_ARGV+=( --middleware")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in SHIMS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    script = "set -u\n" + block + 'echo "${VLLM_HOST_IP:-none} ${GLOO_SOCKET_IFNAME:-none} $APPTAINERENV_VLLM_HOST_IP"\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, env={
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "SF_RANK": rank, "SHIM_NODE": node, "SF_HEAD_ADDR": "gpu01",
        "SLURM_JOB_NODELIST": "gpu[01-02]"}).stdout.splitlines()
    ip, dev = want.split()
    assert out[-1] == f"{ip} {dev} {ip}"


@pytest.mark.parametrize("node,nodeid,want", [("gpu01", "1", "0"), ("gpu02", "0", "1"), ("gpu09", "1", "1")])
def test_a_nodes_rank_is_its_place_in_the_jobs_node_list_whose_first_is_the_head(tmp_path, node, nodeid, want):
    """SLURM_NODEID follows the order of slurm.conf's node lines; the batch script's head is the first node of the
    job's (sorted) node list. Where the two differ (gpu[05-08] defined before gpu[01-04], a job on gpu04 and gpu05)
    rank 0 ran on a node that was not --master-addr's and its record named another node than the head's: never
    READY. The rank is the node's place in that list now (SLURM_NODEID only if the list does not name it)."""
    text = Renderer().node_script(fleet(MULTI).models[0])
    block = text[text.index("SF_NODE="):text.index("SF_GRACE_S=")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n" + SHIMS["scontrol"] + "\n")
    (bin_dir / "scontrol").chmod(0o755)
    out = subprocess.run(["bash", "-c", "set -uo pipefail\n" + block + 'echo "$SF_RANK"\n'], capture_output=True,
                         text=True, check=True, env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURMD_NODENAME": node,
                                                     "SLURM_NODEID": nodeid, "SLURM_JOB_NODELIST": "gpu[01-02]"})
    assert out.stdout.split() == [want], out


def test_a_batch_task_passes_vllm_run_batch_none_of_the_flags_of_vllm_serves_server():
    """``vllm run-batch`` has no HTTP server and refuses its flags: ``--api-server-count`` (and ``--grpc``, a
    ``--no-`` spelling of a server's on/off flag) failed every task of a model that set one."""
    server = {"api-server-count": 4, "grpc": True, "no-enable-offline-docs": True, "uvicorn-log-level": "warning"}
    m = fleet(SINGLE.replace("max-model-len: 4096", ", ".join(f"{k}: {str(v).lower()}" for k, v in server.items())
                             + ", max-model-len: 4096")).models[0]
    argv = run_batch_argv(m)
    assert not [a for a in argv if a.lstrip("-") in server], argv
    assert argv[argv.index("--max-model-len") + 1] == "4096" and "--enable-prefix-caching" in argv


def test_stagger_shortens_later_slots():
    cfg = fleet(SINGLE.replace("memory: 64G", "memory: 64G\n    drain: {stagger_s: 1800}"))
    r = Renderer()
    assert "#SBATCH --time=0-04:00:00" in r.render(cfg, cfg.models[0], slot=0)
    assert "#SBATCH --time=0-03:30:00" in r.render(cfg, cfg.models[0], slot=1)


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_single_words_to_bash(value, tmp_path):
    """Each hostile value, rendered, evaluates in bash to exactly the original string (no expansion)."""
    path = "./" + value if value.startswith("-") else value   # (a leading '-' is refused: an option's, in vllm_args too)
    cfg = fleet(f"""\
  - name: m1
    model_path: {json.dumps(path)}
    container: {{enabled: false}}
    env: {{EVIL: {json.dumps(value)}}}
    vllm_args: {{chat-template: {json.dumps(path)}}}
""")
    node = Renderer().node_script(cfg.models[0])
    launch = 'sf_engine "${SF_EXEC[@]}" "${SF_ARGV[@]}" &'
    assert launch in node
    probe = tmp_path / "probe.sh"   # (the model's env is the engine's: printed by the engine's process)
    probe.write_text(node.replace(launch, '(sf_engine bash -c \'printf "%s\\0" "$@" "$EVIL"\' probe "${SF_ARGV[@]}"); exit 0'))
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "SF_PORT": "1", "SF_RECORD": str(tmp_path / "r"),
           "SF_SECRET": "s", "SF_HEAD_ADDR": "127.0.0.1", "SF_MASTER_PORT": "2", "SLURM_JOB_ID": "1",
           "SF_PYLIB": str(tmp_path / "pylib")}
    out = subprocess.run(["bash", str(probe)], capture_output=True, cwd=tmp_path, env=env)
    args = out.stdout.decode().split("\0")[:-1]
    assert args[2] == path, args
    assert args[args.index("--chat-template") + 1] == path
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


FAKE_ENGINE = """#!{python}
import json, os, socket, sys, time
argv = sys.argv
if "run-batch" in argv:   # a shard: one answer a line
    with open(argv[argv.index("-i") + 1]) as i, open(argv[argv.index("-o") + 1], "w") as o:
        o.writelines(i)
else:                     # serve: bind the port, wait for the record the job publishes once it is bound
    s = socket.socket()
    s.bind(("127.0.0.1", int(argv[argv.index("--port") + 1])))
    s.listen()
    record = os.environ["SF_RECORD"]
    for _ in range(200):
        if os.path.exists(record):
            break
        time.sleep(0.05)
    argv = argv + [open(record).read() if os.path.exists(record) else ""]
with open({seen!r}, "w") as f:
    json.dump({{"argv": argv, "env": dict(os.environ)}}, f)
"""
OWN_PATH = """\
  - name: m1
    model_path: /models/m1
    container: {{enabled: false}}
    gpu_metrics: {{enabled: false}}
    env: {{PATH: {bin}, EVIL: "$(touch pwned) it's"}}
"""


def fake_engine(tmp_path) -> tuple[object, object]:
    """A `vllm` found only on the model's own PATH (``tmp/bin``), noting its argv and environment."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "engine.json"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_ENGINE.format(python=sys.executable, seen=str(seen)))
    (bin_dir / "vllm").chmod(0o755)
    return bin_dir, seen


def test_the_models_env_is_the_engines_alone_and_the_jobs_own_tools_still_resolve(tmp_path):
    """``env: {PATH: ...}`` without a container was exported into the node script itself: its setsid (then
    mkdir, date, mv, ps) were not found and the engine never started.  The whole node script runs: the engine
    (found on the model's PATH) gets the model's env and the job's PYTHONPATH, the script publishes its record."""
    bin_dir, seen = fake_engine(tmp_path)
    cfg = fleet(OWN_PATH.format(bin=bin_dir))
    node = tmp_path / "node.sh"
    node.write_text("#!/bin/bash\n" + Renderer().node_script(cfg.models[0]) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = tmp_path / "endpoints" / "1.json"
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "SF_PORT": str(port), "SF_RECORD": str(record),
           "SF_SECRET": "s", "SF_HEAD_ADDR": "127.0.0.1", "SF_MASTER_PORT": "2", "SLURM_JOB_ID": "1",
           "SF_PYLIB": str(tmp_path / "pylib"), "SF_STOP_GRACE_S": "2"}
    out = subprocess.run(["bash", str(node)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert "not found" not in out.stderr and "No such file" not in out.stderr, out.stderr
    assert "slurmfleet: published 127.0.0.1:%d" % port in out.stdout, (out.stdout, out.stderr)
    engine = json.loads(seen.read_text())
    assert engine["argv"][1:3] == ["serve", "/models/m1"] and "--middleware" in engine["argv"]
    published = json.loads(engine["argv"][-1])   # written with the script's own printf, date and mv
    assert published["port"] == port and published["start_time"] > 0 and published["secret"] == "s"
    assert engine["env"]["PATH"] == str(bin_dir) and engine["env"]["EVIL"] == "$(touch pwned) it's"
    assert engine["env"]["PYTHONPATH"] == str(tmp_path / "pylib") and engine["env"]["VLLM_API_KEY"] == "s"
    assert not (tmp_path / "pwned").exists()
    text = node.read_text()   # the container's path is unchanged: the env reaches it as APPTAINERENV_
    assert text.index("export PATH=") > text.index("sf_engine() {") and "\nexport EVIL" not in text
    boxed = fleet(SINGLE.replace("env: {HF_HOME: /cache}", "env: {HF_HOME: /cache, PATH: /opt/bin}"))
    boxed_node = Renderer().node_script(boxed.models[0])
    assert "\nexport APPTAINERENV_PATH=/opt/bin\n" in boxed_node and "export PATH" not in boxed_node


def test_a_batch_tasks_env_is_the_engines_alone_and_its_own_tools_still_resolve(tmp_path):
    """The same in a dedicated batch's array task: its wc, mv and seq ran with the model's PATH."""
    bin_dir, seen = fake_engine(tmp_path)
    cfg = fleet(OWN_PATH.format(bin=bin_dir))
    work = tmp_path / "w"
    work.mkdir()
    (work / "shard-0000.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    script = tmp_path / "array.sh"
    script.write_text(Renderer().array_script(cfg, cfg.models[0], "batch_1", "j", work, "0"))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                         env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "0",
                              "SLURM_JOB_ID": "7"})
    assert out.returncode == 0 and "not found" not in out.stderr, out.stderr
    assert (work / "out" / "shard-0000.jsonl").read_text() == '{"a": 1}\n{"b": 2}\n'
    engine = json.loads(seen.read_text())
    assert engine["env"]["PATH"] == str(bin_dir) and engine["env"]["EVIL"] == "$(touch pwned) it's"
    assert not (tmp_path / "pwned").exists()


def test_each_node_of_a_multi_node_engine_advertises_its_address_toward_the_head(tmp_path):
    """vLLM's inter-node message queues bind and advertise its own guess of the node's address (a UDP connect
    toward 8.8.8.8: 0.0.0.0 on a node with no default route, and startup hangs), not --master-addr: each node
    sets VLLM_HOST_IP to the source address of its route to the head (unless the model's env sets it)."""
    bin_dir, seen = fake_engine(tmp_path)
    models = OWN_PATH.format(bin=bin_dir) + "    nodes: 2\n    gpus_per_node: 1\n    pipeline_parallel_size: 2\n"
    cfg = fleet(models)
    node = tmp_path / "node.sh"
    node.write_text("#!/bin/bash\n" + Renderer().node_script(cfg.models[0]) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SF_PORT": str(port),
           "SF_RECORD": str(tmp_path / "endpoints" / "1.json"), "SF_SECRET": "s", "SF_HEAD_ADDR": "localhost",
           "SF_MASTER_PORT": "2", "SLURM_JOB_ID": "1", "SF_PYLIB": str(tmp_path / "pylib"), "SF_STOP_GRACE_S": "2"}
    # this host's own address as the head's: the route to it leaves from it
    own = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    heads = [("localhost", None)] + [(a, a) for a in [ln.split()[3].split("/")[0] for ln in own.splitlines()][:1]]
    for head, advertised in heads:   # (a loopback route, the head's name in /etc/hosts: left to vLLM's own guess)
        seen.unlink(missing_ok=True)
        out = subprocess.run(["bash", str(node)], capture_output=True, text=True, cwd=tmp_path,
                             env={**env, "SF_HEAD_ADDR": head}, timeout=60)
        engine = json.loads(seen.read_text())
        assert "--nnodes" in engine["argv"] and engine["env"].get("VLLM_HOST_IP") == advertised, (out.stdout, out.stderr)
    own = fleet(models.replace("EVIL:", "VLLM_HOST_IP: 10.0.0.9, EVIL:"))
    text = Renderer().node_script(own.models[0])
    assert "export VLLM_HOST_IP=10.0.0.9" in text and 'export VLLM_HOST_IP="' not in text
    assert 'export GLOO_SOCKET_IFNAME="$SF_HOST_DEV"' in text   # (its own interface: still the route's)
    both = fleet(models.replace("EVIL:", "VLLM_HOST_IP: 10.0.0.9, GLOO_SOCKET_IFNAME: ib1, EVIL:"))
    assert "ip -4 route get" not in Renderer().node_script(both.models[0])
    boxed = Renderer().node_script(fleet(MULTI).models[0])   # (apptainer --cleanenv would drop the plain one)
    assert 'export VLLM_HOST_IP="$SF_HOST_IP" APPTAINERENV_VLLM_HOST_IP="$SF_HOST_IP"' in boxed


def test_a_port_another_job_on_the_node_locked_is_skipped_though_nothing_listens_yet(tmp_path):
    """vLLM binds its HTTP port before loading the model and listens only after: a port chosen by another
    replica on the node looked free to the listen test meanwhile, so both jobs took it and one failed after its
    whole model load.  A job locks each port it takes (flock, held for its life) and skips locked ones."""
    import fcntl
    cfg = fleet(KV)
    text = Renderer().render(cfg, cfg.models[0])
    func = text[text.index("SF_PORT_LOCKS="):text.index("sf_free_port SF_PORT\n")]
    locks = tmp_path / "locks"
    script = func.replace("/tmp/slurmfleet-ports-$(id -u)", str(locks)) + (
        'SF_PORT_LOW=20000 SF_PORT_HIGH=20003\nsf_free_port A\nuntil sf_free_port B; [ "$B" != "$A" ]; do :; done\n'
        'echo "$A $B"; flock -n "$SF_PORT_LOCKS/$A" true || echo "$A locked"\n')
    locks.mkdir()
    with open(locks / "20000", "a") as held:   # another job's, whose engine has not listened yet
        fcntl.flock(held, fcntl.LOCK_EX)
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    a, b = out.stdout.split()[:2]
    assert {a, b} == {"20001", "20002"} and f"{a} locked" in out.stdout, (out.stdout, out.stderr)


def test_a_multi_node_job_not_handed_over_stops_its_steps_before_slurms_kill_at_the_time_limit(tmp_path):
    """SLURM's TERM at the limit reaches srun, which KILLs every node's script (no grace for the engines, no
    clean-up): after the time-limit warning, the job TERMs its own steps SF_STOP_GRACE_S + 15 s before the end
    squeue gives (a fake squeue and scancel here); a single-node job needs none of it (its script gets TERM)."""
    import time as _time
    cfg = fleet(MULTI)
    text = Renderer().render(cfg, cfg.models[0])
    func = text[text.index("sf_stop_before_end() {"):text.index("SF_STOPPER=\n")]
    end = int(_time.time()) + 17
    (tmp_path / "squeue").write_text(f'#!/bin/sh\n[ "$SLURM_TIME_FORMAT" = %s ] && echo {end}\n')
    (tmp_path / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scancel.log\n')
    for tool in ("squeue", "scancel"):
        (tmp_path / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SF_STOP_GRACE_S": "1"}
    t0 = _time.monotonic()
    out = subprocess.run(["bash", "-c", func + "sf_stop_before_end\n"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert (tmp_path / "scancel.log").read_text() == "--signal=TERM 42\n", out.stderr
    assert _time.monotonic() - t0 < 20 and f"time limit at {end}" in out.stderr
    single = Renderer().render(fleet(SINGLE), fleet(SINGLE).models[0])
    assert "sf_stop_before_end" not in single and "SF_STOPPER" not in single


def test_a_lock_folder_that_is_a_link_or_someone_elses_is_not_used(tmp_path):
    """The port locks' folder was /tmp/slurmfleet-ports, made 1777 by whoever came first: another user who made
    it (or a link there) could plant symlinks named after ports, and the job's `>>` created the files they pointed
    at (an endpoint record's .drain, which the daemon reads as an operator's drain).  The folder is now the user's
    own, 0700; one that is a link, or that another user made first, is not used (the listen test alone)."""
    cfg = fleet(KV)
    text = Renderer().render(cfg, cfg.models[0])
    func = text[text.index("SF_PORT_LOCKS="):text.index("sf_free_port SF_PORT\n")]
    assert '"/tmp/slurmfleet-ports-$(id -u)"' in func
    target = tmp_path / "state"
    target.mkdir()
    link = tmp_path / "locks"
    link.symlink_to(target)
    script = func.replace("/tmp/slurmfleet-ports-$(id -u)", str(link)) + (
        'SF_PORT_LOW=20000 SF_PORT_HIGH=20003\nsf_free_port A\necho "port $A locks=[$SF_PORT_LOCKS]"\n')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "locks=[]" in out.stdout, (out.stdout, out.stderr)
    assert list(target.iterdir()) == []   # nothing created through the link
    own = tmp_path / "own"
    out = subprocess.run(["bash", "-c", func.replace("/tmp/slurmfleet-ports-$(id -u)", str(own)) + (
        'SF_PORT_LOW=20000 SF_PORT_HIGH=20003\nsf_free_port A\necho "port $A"\n')], capture_output=True, text=True,
        timeout=30)
    assert out.returncode == 0 and oct(own.stat().st_mode & 0o777) == "0o700", (out.stdout, out.stderr)
    assert [p.name for p in own.iterdir()] == [out.stdout.split()[1]]   # its own folder: the port locked there
    if os.geteuid() == 0:   # a folder another user made first (root can give one away)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o777)
        os.chown(theirs, 65534, 65534)
        out = subprocess.run(["bash", "-c", func.replace("/tmp/slurmfleet-ports-$(id -u)", str(theirs)) + (
            'SF_PORT_LOW=20000 SF_PORT_HIGH=20003\nsf_free_port A\necho "port $A locks=[$SF_PORT_LOCKS]"\n')],
            capture_output=True, text=True, timeout=30)
        assert "locks=[]" in out.stdout and list(theirs.iterdir()) == [], (out.stdout, out.stderr)


def test_ports_whose_lock_cannot_be_taken_end_in_the_listen_test_alone_not_a_spin(tmp_path):
    """Lock files are never removed, and one another user's job left (0600) cannot be opened: a node where every
    port's lock was unusable made sf_free_port loop for ever at full CPU.  After 1000 such ports it takes one
    the listen test alone finds free.  (Directories stand for the unusable files: root opens any file.)"""
    cfg = fleet(KV)
    text = Renderer().render(cfg, cfg.models[0])
    func = text[text.index("SF_PORT_LOCKS="):text.index("sf_free_port SF_PORT\n")]
    locks = tmp_path / "locks"
    for p in range(20000, 20003):
        (locks / str(p)).mkdir(parents=True)
    script = func.replace("/tmp/slurmfleet-ports-$(id -u)", str(locks)) + (
        'SF_PORT_LOW=20000 SF_PORT_HIGH=20003\nsf_free_port A\necho "port $A"\n')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split()[:1] == ["port"] and 20000 <= int(out.stdout.split()[1]) < 20003, \
        (out.stdout, out.stderr)


@pytest.mark.parametrize("ephemeral, want", [
    ("32768 60999", (20000, 32768)),    # Linux's default: below it
    ("15000 60999", (61000, 65536)),    # starts low: above it (it took 20000-32767 inside the range)
    ("1024 65535", (20000, 32768)),     # no room outside: the listen test and the locks alone
    ("60000 61000", (20000, 52768)),    # (RANDOM goes to 32767: a range no wider than that)
])
def test_engine_ports_come_from_outside_the_kernels_ephemeral_range(ephemeral, want):
    cfg = fleet(KV)
    text = Renderer().render(cfg, cfg.models[0])
    func = text[text.index("sf_port_range() {"):text.index("{ read -r SF_EPHEMERAL_LOW")]
    out = subprocess.run(["bash", "-c", func + f'sf_port_range {ephemeral}; echo "$SF_PORT_LOW $SF_PORT_HIGH"'],
                         capture_output=True, text=True, timeout=30)
    assert tuple(int(x) for x in out.stdout.split()) == want, out.stderr


def test_a_run_outlived_by_its_requeue_leaves_the_next_runs_record_and_files(tmp_path):
    """A node lost, the job requeued elsewhere: when the old node comes back its run is killed, and its clean-up
    deleted the new run's endpoint record, node script and Python folder (all named after the job alone).  Each
    run has its own node script and folder, and removes the record only if it holds its own secret."""
    cfg = fleet(KV)
    text = Renderer().render(cfg, cfg.models[0])
    assert 'SF_RUN="${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"' in text and 'SF_PYLIB="$SF_JOBS/$SF_RUN.pylib"' in text
    cleanup = text[text.index("sf_cleanup() {"):text.index("trap sf_cleanup EXIT")]
    record = tmp_path / "7.json"
    # every program it runs logs its arguments: the secret must be in none (any user of the node reads them in
    # /proc: a grep of the record for it showed it there)
    shims, argv_log = tmp_path / "bin", tmp_path / "argv.log"
    shims.mkdir()
    for prog in ("grep", "rm", "cat", "sed", "awk", "test"):
        real = shutil.which(prog)
        if real:
            (shims / prog).write_text(f'#!/bin/bash\necho "{prog} $*" >> {argv_log}\nexec {real} "$@"\n')
            (shims / prog).chmod(0o755)
    secret_value = "0123abcd" * 6
    for secret, kept in (("theirs", True), (secret_value, False)):
        record.write_text(json.dumps({"job_id": "7", "secret": secret}, separators=(",", ":")) + "\n")
        env = {"SF_RECORD": str(record), "SF_SECRET": secret_value, "SF_DRAIN_MARK": str(tmp_path / "7.draining"),
               "SF_NODE_FILE": str(tmp_path / "7.0.node.sh"), "SF_PYLIB": str(tmp_path / "7.0.pylib"),
               "PATH": f"{shims}:/usr/bin:/bin"}
        out = subprocess.run(["bash", "-c", cleanup + "sf_cleanup"], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and record.exists() is kept, (secret, out.stderr)
    assert "rm -f" in argv_log.read_text() and secret_value not in argv_log.read_text()
    node = Renderer().node_script(cfg.models[0])
    assert cleanup[cleanup.index("if [[ -r"):].splitlines()[0].strip() in node


@pytest.mark.parametrize("bind, waits_on", [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1 ::1"), ("10.1.2.3", "10.1.2.3")])
def test_the_job_waits_for_its_engine_where_it_listens(bind, waits_on):
    """With an engine bound to one address the wait for its port on 127.0.0.1 never succeeded: no record, and the
    job was killed at its startup timeout as a crash."""
    cfg = fleet(SINGLE.replace("    vllm_args:", f"    bind_host: '{bind}'\n    vllm_args:", 1))
    node = Renderer().node_script(cfg.models[0])
    assert f"SF_LISTEN=( {waits_on} )" in node.replace("'", "") and f"--host {bind}" in node.replace("'", "")


SIM = "  - name: s\n    engine: simulator\n    gpus_per_node: 0\n    container: {enabled: false}\n"
NO_BOX = SINGLE.replace("container: {image: /img/vllm.sif, binds: ['/data:/data:ro']}", "container: {enabled: false}")


@pytest.mark.parametrize("base, change, rolls", [
    (SINGLE, "drain: {timeout_s: 5, handover_lead_s: 60}", False),   # the daemon's waits
    (SINGLE, "simulator: {ttft_s: 2}", False),                       # the simulator's knobs on vLLM
    (SIM, "vllm_args: {max-model-len: 512}", False),                 # vLLM's flags on the simulator
    (SIM, "gpu_metrics: {interval_s: 1, container_path: /x.py}", False),   # no GPU: no exporter
    (SINGLE, "gpu_metrics: {enabled: false, interval_s: 1}", True),
    (SINGLE.replace("    memory", "    gpu_metrics: {enabled: false}\n    memory"), "gpu_metrics: {enabled: false, interval_s: 1}", False),
    (NO_BOX, "gpu_metrics: {container_path: /x.py}", False),         # the exporter runs from the daemon's python
    (NO_BOX, "gpu_metrics: {interval_s: 1}", True),
    (NO_BOX.replace("{enabled: false}", "{enabled: false, image: /a.sif}"), "container: {enabled: false, image: /b.sif}", False),
    (SINGLE, "container: {image: /img/other.sif}", True),
    (SINGLE, "drain: {signal_lead_s: 60}", True),
    (SINGLE, "drain: {stagger_s: 300}", True),                       # slot 1's time limit
    (SIM, "simulator: {ttft_s: 2}", True),
    (SINGLE, "vllm_args: {max-model-len: 512}", True),
    (SINGLE, "gpu_type: h100", True),
    (SINGLE, "constraint: h100&ib", True),
    (SINGLE, "reservation: maint", True),
    (SINGLE, "lora_adapters: {sql: /loras/sql}", True),
])
def test_a_change_rolls_the_replicas_exactly_when_it_changes_their_job(base, change, rolls):
    """A model's job hash (a change rolls its replicas) moves exactly when the job script does: a setting
    only the daemon reads, or one the job has no use for, no longer restarts every replica of the model."""
    key = change.split(":")[0]
    edited = "\n".join(ln for ln in base.splitlines() if not ln.strip().startswith(key + ":")) + f"\n    {change}\n"
    r, (a, b) = Renderer(), (fleet(base), fleet(edited))
    scripts = [r.render(c, c.models[0], slot=1, nonce="n").split("\n", 3)[3] for c in (a, b)]   # (from after the tag)
    assert "--comment" not in scripts[0]
    assert (scripts[0] != scripts[1]) is rolls
    assert (a.models[0].job_hash() != b.models[0].job_hash()) is rolls


def test_a_models_gpu_type_constraint_and_reservation_reach_its_job_in_place_of_the_clusters():
    cfg = load_config_text("""\
fleet: t
state_dir: /tmp/sf-render
cluster: {partition: gpu, constraint: fast, reservation: maint}
models:
  - {name: a, model_path: /m, container: {image: /i.sif}, gpu_type: h100, gpus_per_node: 2,
     tensor_parallel_size: 2, constraint: "h100&ib"}
  - {name: b, model_path: /m, container: {image: /i.sif}, reservation: other}
  - {name: c, engine: simulator, container: {enabled: false}, gpu_type: a100}
""", "t.yaml", {})
    r = Renderer()
    a, b = (r.render(cfg, m, slot=0, nonce="n").splitlines() for m in cfg.models[:2])
    assert {"#SBATCH --gres=gpu:h100:2", "#SBATCH --constraint=h100&ib", "#SBATCH --reservation=maint"} <= set(a)
    assert {"#SBATCH --gres=gpu:1", "#SBATCH --constraint=fast", "#SBATCH --reservation=other"} <= set(b)
    array = r.array_script(cfg, cfg.models[0], "batch_x", "j", Path("/tmp/w"), "0-1").splitlines()
    assert {"#SBATCH --gres=gpu:h100:2", "#SBATCH --constraint=h100&ib", "#SBATCH --reservation=maint"} <= set(array)
    assert "#SBATCH --gres=gpu:a100:1" in r.render(cfg, cfg.models[2], slot=0, nonce="n").splitlines()
    with pytest.raises(ConfigError) as e:   # no GPU, no GPU type
        load_config_text("fleet: t\nstate_dir: /tmp/x\nmodels:\n  - {name: a, engine: simulator, container: "
                         "{enabled: false}, gpus_per_node: 0, gpu_type: h100}\n", "t.yaml", {})
    assert "gpu_type needs gpus_per_node of 1 or more" in str(e.value) and "t.yaml:4" in str(e.value)
    with pytest.raises(ConfigError) as e:   # one word of gres.conf's, nothing sbatch would read as more
        load_config_text("fleet: t\nstate_dir: /tmp/x\nmodels:\n  - {name: a, engine: simulator, container: "
                         "{enabled: false}, gpu_type: 'h100:2'}\n", "t.yaml", {})
    assert "gpu_type" in str(e.value)


def test_settings_added_since_jobs_were_tagged_are_not_hashed_while_unset():
    """A daemon upgrade that brings a new model setting rolls no replica: unset, it is not in the job hash."""
    from orchestrator import jobshape
    m = fleet(SINGLE).models[0]
    dump = {k: v for k, v in m.model_dump().items() if k not in jobshape.UNSET_UNHASHED}
    assert m.job_hash().split("+")[0] == jobshape.model_part(dump, kv_events=False)
    assert m.job_hash(legacy=True).split("+")[0] == jobshape.model_part(dump, kv_events=False, legacy=True)


def test_a_job_tagged_in_the_previous_hash_form_counts_as_current_while_its_settings_are():
    """Jobs an earlier release tagged (the settings the job does not read hashed too) are adopted as current
    when every setting is as they were, with the site part or from before it; a changed one rolls them."""
    m = fleet(SINGLE).models[0]
    legacy = m.job_hash(legacy=True)
    assert legacy != m.job_hash() and legacy.split("+")[1] == m.job_hash().split("+")[1]
    assert m.adopted_hash(legacy) == m.adopted_hash(legacy.split("+")[0]) == m.adopted_hash(m.job_hash()) == m.job_hash()
    changed = fleet(SINGLE.replace("64G", "32G")).models[0].job_hash(legacy=True)
    assert m.adopted_hash(changed) == changed


def test_the_watchdog_signals_no_process_that_took_a_pid_it_watched(tmp_path):
    """The node script's watchdog outlives the script, the engine, the exporter and the relay.  It took their pids
    alone: once the script was gone it KILLed each pid and its group, and while the script's pid answered kill -0
    it TERMed it when its parent looked wrong; a pid the kernel had given to another process since (a busy node
    recycles them within minutes; CI saw a test cluster's munged and slurmctld killed without a word) got the
    signal.  Each pid now comes with its process's start time, and one whose process is another is left alone."""
    import re
    import signal
    import time

    cfg = fleet(KV)
    text = Renderer().node_script(cfg.models[0])
    body = text[text.index("' slurmfleet-kv-relay"):]   # (the relay's own bash -c comes first)
    body = re.search(r"setsid bash -c \"\$\(declare -f sf_started\)\"'\n(.*?)' slurmfleet-watchdog", body, re.S).group(1)
    started = re.search(r"^sf_started\(\) \{.*\}$", text, re.M).group(0)
    body = started + "\n" + body   # (the watchdog's shell gets the script's own function)

    def start_of(pid: int) -> str:
        return subprocess.run(["bash", "-c", started + '\nsf_started "$1"', "x", str(pid)], capture_output=True,
                              text=True, check=True).stdout.strip()

    def sleeper() -> subprocess.Popen:
        return subprocess.Popen(["sleep", "60"], start_new_session=True)
    script, engine, stranger, other_self = sleeper(), sleeper(), sleeper(), sleeper()
    try:
        assert start_of(engine.pid).isdigit()
        # the script's pid with its start time; the engine's with its own; the stranger's pid with another process's
        # start time: a pid recycled since the watchdog began
        dog = subprocess.Popen(["bash", "-c", body, "slurmfleet-watchdog", f"{script.pid}:{start_of(script.pid)}",
                                "1", "", "", f"{engine.pid}:{start_of(engine.pid)}",
                                f"{stranger.pid}:{int(start_of(stranger.pid)) - 1}"])
        # (the script's parent is not the one given: it is TERMed, as an orphaned script is; then it is gone)
        assert script.wait(10) == -signal.SIGTERM
        assert dog.wait(10) == 0 and engine.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None   # not its process: left alone
        # a script pid another process has taken: not watched, not TERMed (the engine's group is KILLed at once)
        engine2 = sleeper()
        dog = subprocess.Popen(["bash", "-c", body, "slurmfleet-watchdog", f"{other_self.pid}:1", "1", "", "",
                                f"{engine2.pid}:{start_of(engine2.pid)}"])
        assert dog.wait(10) == 0 and engine2.wait(10) == -signal.SIGKILL
        time.sleep(0.6)
        assert other_self.poll() is None
    finally:
        for p in (script, engine, stranger, other_self):
            p.kill()
            p.wait()
