"""Dedicated mode (issue 12, item 3): a batch as its own SLURM job array of `vllm run-batch` tasks.

Fast: the split and the in-order merge, the retry rules, the rendered script (shellcheck, the --array and
apptainer lines, hostile values), the executor against a fake SLURM (retry, hold, give up, adopt, block).
On the local cluster: 3 simulator shards with one task killed once and the daemon "restarted" meanwhile;
a cancel; and 2 shards through the real `vllm run-batch` (.venv-vllm, the tiny model) behind the apptainer
shim, one task killed once.  The whole module is in xdist group "vllm" (tests/conftest.py), so the real-vLLM
test never runs beside the real-vLLM fleet module.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, SHIMS, sim_model, slurm
from orchestrator.batches import new_batch
from orchestrator.config import FleetConfig
from orchestrator.devtools.simvocab import SimVocab
from orchestrator.fleet.batcharray import ArrayBatch, ArrayBlocked
from orchestrator.fleet.batchrules import retry_slots, to_hold_or_release, verdict
from orchestrator.fleet.render import run_batch_argv
from orchestrator.fleet.batchout import done_lines
from orchestrator.fleet.batchshards import LineCounter, logged_progress, merge, openai_line, split_input
from orchestrator.fleet.slurm import CliSlurm, JobInfo, SlurmError

pytestmark = [pytest.mark.xdist_group("vllm")]
VLLM_BIN = ROOT / ".venv-vllm" / "bin"
MODEL_DIR = Path(os.environ.get("SLURMFLEET_MODEL_DIR", "/tmp/slurmfleet-models/tiny-llama"))
HOSTILE = ["$(touch /tmp/pwned)", "; rm -rf ~", "`id`", "it's \"quoted\"", "a\nb", "$HOME", "*", "--x=1 --y"]


def request(n: int, model: str = "m1", max_tokens: int = 6) -> bytes:
    return json.dumps({"custom_id": f"req-{n}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                                "messages": [{"role": "user", "content": f"question {n}"}]}}).encode()


def numbered(count: int, model: str = "m1", max_tokens: int = 6):
    """(line number, line) as the file store gives them: from 1, a gap where a blank line was."""
    return [(n + 1 + (n >= 4), request(n, model, max_tokens)) for n in range(count)]


def vllm_answer(raw: bytes, status: int = 200) -> dict:
    """A `vllm run-batch` output line (its format, 0.32) for a request line."""
    cid = json.loads(raw)["custom_id"]
    if status != 200:
        err = {"error": {"message": f"bad {cid}", "type": "BadRequestError", "param": None, "code": status}}
        return {"id": "vllm-x", "custom_id": cid, "response": {"status_code": status, "request_id": "r", "body": None},
                "error": err}
    body = {"object": "chat.completion", "choices": [{"message": {"content": f"answer {cid}"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    return {"id": "vllm-x", "custom_id": cid, "response": {"status_code": 200, "request_id": "r", "body": body},
            "error": None}


def answer_shard(work: Path, i: int, reverse: bool = False, bad: set[str] = frozenset()) -> None:
    """What a task that succeeded leaves: one answer per line of its shard (in any order)."""
    lines = (work / f"shard-{i:04d}.jsonl").read_bytes().splitlines()
    out = [vllm_answer(raw, 400 if json.loads(raw)["custom_id"] in bad else 200) for raw in lines]
    (work / "out").mkdir(exist_ok=True)
    (work / "out" / f"shard-{i:04d}.jsonl").write_text("".join(json.dumps(o) + "\n" for o in
                                                               (out[::-1] if reverse else out)))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# -- the shard files --------------------------------------------------------------------------------------
def test_split_is_contiguous_balanced_and_keeps_line_numbers(tmp_path):
    counts = split_input(iter(numbered(10)), 10, 3, tmp_path)
    assert counts == [3, 3, 4]
    idx = [[json.loads(x) for x in (tmp_path / f"shard-{i:04d}.idx").read_text().splitlines()] for i in range(3)]
    assert idx[0] == [[1, "req-0"], [2, "req-1"], [3, "req-2"]]
    assert idx[1] == [[4, "req-3"], [6, "req-4"], [7, "req-5"]]     # line 5 was blank
    assert [c for shard in idx for _, c in shard] == [f"req-{n}" for n in range(10)]
    assert (tmp_path / "shard-0002.jsonl").read_bytes() == b"".join(request(n) + b"\n" for n in range(6, 10))


def test_split_streams_a_large_input_in_bounded_memory(tmp_path):
    """Measured in a process of its own: tracemalloc counts every thread's allocations, and a thread another
    test of this worker left behind counted toward the split's peak (2 MB once in a full run)."""
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import json, sys, tracemalloc
        from pathlib import Path
        from orchestrator.fleet.batchshards import split_input
        line = {request(0)!r}

        def lines():
            for n in range(60_000):   # 13 MB of input
                yield n + 1, line
        tracemalloc.start()
        counts = split_input(lines(), 60_000, 4, Path(sys.argv[1]))
        print(json.dumps([counts, tracemalloc.get_traced_memory()[1]]))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         check=True, timeout=120)
    counts, peak = json.loads(out.stdout)
    assert counts == [15_000] * 4
    assert peak < 1_000_000, peak


def test_merge_writes_input_order_in_the_shared_runners_format(tmp_path):
    bid = "batch_abc123"
    counts = split_input(iter(numbered(9)), 9, 3, tmp_path)
    answer_shard(tmp_path, 0, reverse=True)             # answers out of order: merged back in input order
    answer_shard(tmp_path, 1, bad={"req-4"})            # one request refused by vLLM: the error file
    given_up = {2: "shard 2: its task ended without the shard's output 3 times (last: FAILED NonZeroExitCode)"}
    out, err = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    assert merge(tmp_path, 3, bid, given_up, out, err) == (5, 4, 15, 10)
    ok, bad = read_jsonl(out), read_jsonl(err)
    assert [o["custom_id"] for o in ok] == ["req-0", "req-1", "req-2", "req-3", "req-5"]
    assert [o["id"] for o in ok] == [f"batch_req_abc123-{n}" for n in (1, 2, 3, 4, 7)]
    assert ok[0]["response"] == {"status_code": 200, "request_id": f"{bid}-1",
                                 "body": vllm_answer(request(0))["response"]["body"]} and ok[0]["error"] is None
    assert [o["custom_id"] for o in bad] == ["req-4", "req-6", "req-7", "req-8"]
    assert bad[0]["error"] is None and bad[0]["response"]["status_code"] == 400   # (OpenAI's: an HTTP answer)
    assert bad[0]["response"]["body"]["error"]["message"] == "bad req-4"
    assert bad[1]["error"]["code"] == "shard_failed" and "3 times" in bad[1]["error"]["message"]
    # the shared runner's resume reads these files: every input line answered exactly once
    seen = bytearray(2)
    assert done_lines(out, seen)[0] + done_lines(err, seen)[0] == sum(counts)
    assert [n for n in range(16) if seen[n >> 3] & (1 << (n & 7))] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    # a shard neither done nor given up (the batch was cancelled) has no line at all
    assert merge(tmp_path, 3, bid, {}, out, err) == (5, 1, 15, 10)
    # ... unless the batch expired: each of its lines has a batch_expired error line (the counts add up)
    assert merge(tmp_path, 3, bid, {}, out, err, expired=True) == (5, 4, 15, 10)
    assert [(o["custom_id"], o["error"] and o["error"]["code"], o["response"] and o["response"]["status_code"])
            for o in read_jsonl(err)] == [("req-4", None, 400)] + [(f"req-{n}", "batch_expired", None) for n in (6, 7, 8)]


@pytest.mark.parametrize("error,status,message,etype", [
    ({"error": {"message": "too long", "type": "BadRequestError", "param": "max_tokens", "code": 400}}, 400,
     "too long", "BadRequestError"),
    ("URL /v1/completions was used. Supported endpoints: ...", 400,
     "URL /v1/completions was used. Supported endpoints: ...", "BadRequestError"),
    ("engine died", 500, "engine died", "InternalServerError"),   # (it said BadRequestError: a client's fault)
])
def test_vllm_error_lines_become_openai_errors(error, status, message, etype):
    """vLLM's error line (its ``error`` set, the response without a body) as OpenAI writes one: the error in the
    response's body, ``error`` null (OpenAI's is only for a line that got no HTTP answer)."""
    obj = {"id": "vllm-1", "custom_id": "c", "response": {"status_code": status, "request_id": "r", "body": None},
           "error": error}
    entry, ok = openai_line(obj, "batch_ff", 12)
    assert not ok and entry["id"] == "batch_req_ff-12" and entry["error"] is None
    assert entry["response"]["body"]["error"]["message"] == message
    assert entry["response"]["body"]["error"]["type"] == etype


def test_progress_counts_a_growing_part_and_reads_vllms_progress_line(tmp_path):
    part, counter = tmp_path / "p", LineCounter()
    assert counter.count(part) == 0
    part.write_bytes(b"a\nb\nhalf")
    assert counter.count(part) == 2
    with open(part, "ab") as f:
        f.write(b" line\nc\n")
    assert counter.count(part) == 4
    part.write_bytes(b"x\n")          # a retry starts the shard over: a new, shorter file
    assert counter.count(part) == 1
    log = tmp_path / "l"
    log.write_bytes(b"INFO ...\nRunning batch:   0% Completed | 0/6 [00:00<?, ?req/s]\n" + b"noise\n" * 5000 +
                    b"Running batch:  50% Completed | 3/6 [00:01<00:01, 2.9req/s]\n")
    assert logged_progress(log) == 3 and logged_progress(tmp_path / "none") == 0


def test_a_growing_part_counts_the_answers_the_merge_will_count_failed(tmp_path):
    part, counter = tmp_path / "p", LineCounter(answers=True)
    ok, bad = json.dumps(vllm_answer(request(1))), json.dumps(vllm_answer(request(2), status=400))
    part.write_text(ok + "\n" + bad + "\n" + ok[:20])   # the third answer half written
    assert (counter.count(part), counter.ok) == (2, 1)
    with open(part, "a") as f:
        f.write(ok[20:] + "\nnot json\n")
    assert (counter.count(part), counter.ok) == (4, 2)   # an unreadable line: the merge's "no answer", failed
    part.write_text(ok + "\n")   # a retry starts over
    assert (counter.count(part), counter.ok) == (1, 1)


# -- the rules --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("complete,state,retries,want", [
    (True, "RUNNING", 0, "done"),          # the output is whole (the task is still exiting)
    (True, "FAILED", 2, "done"),           # whole output, whatever SLURM says of the exit
    (False, "PENDING", 0, "wait"),
    (False, "RUNNING", 5, "wait"),
    (False, "COMPLETING", 0, "wait"),
    (False, "COMPLETED", 0, "retry"),      # exit 0 without the whole output is a failure
    (False, "CANCELLED", 1, "retry"),
    (False, "TIMEOUT", 1, "retry"),
    (False, "NODE_FAIL", 0, "retry"),
    (False, None, 0, "retry"),             # gone from squeue without its output
    (False, "SPECIAL_EXIT", 0, "retry"),   # requeued held after a RequeueExitHold code: never runs on its own
    (False, "FAILED", 2, "give_up"),
    (False, None, 3, "give_up"),
])
def test_retry_decision(complete, state, retries, want):
    assert verdict(complete, state, retries, 2) == want


@pytest.mark.parametrize("states,base_pending,k,want", [
    (["RUNNING", "FAILED", "PENDING"], True, 2, 0),     # the array still waits for %K: a retry would exceed K
    (["RUNNING", "FAILED", "RUNNING"], False, 2, 0),    # K running
    (["COMPLETED", "FAILED", "RUNNING"], False, 2, 1),
    (["COMPLETED", "FAILED", None], False, 3, 3),
])
def test_retry_slots_keep_at_most_k_tasks(states, base_pending, k, want):
    assert retry_slots(states, base_pending, k) == want


# -- the script -------------------------------------------------------------------------------------------
def fleet(model: dict, state_dir: str = "/tmp/sf-ba", **cluster) -> FleetConfig:
    return FleetConfig.model_validate({"fleet": "t", "state_dir": state_dir, "models": [model],
                                       "cluster": {"partition": "gpu", "account": "acct", **cluster}})


VLLM_MODEL = {"name": "m1", "aliases": ["m1-alias"], "model_path": "/models/m1", "memory": "64G", "qos": "batch",
              "container": {"image": "/img/vllm.sif", "binds": ["/data:/data:ro"]}, "env": {"HF_HOME": "/cache"},
              "vllm_args": {"max-model-len": 4096, "enable-prefix-caching": True, "off": False,
                            "uvicorn-log-level": "warning", "middleware": "x.Y"}}


def executor(cfg: FleetConfig, work: Path, slurm_client, total: int = 9, shards: int = 3, lines=None, **kw) -> ArrayBatch:
    rec = new_batch("k", "file-1", "/v1/chat/completions", "24h", None, total, [cfg.models[0].name])
    rec["id"] = "batch_0123abcd"
    return ArrayBatch(rec, cfg, cfg.models[0], lines if lines is not None else numbered(total, cfg.models[0].name),
                      work, work.parent / "out.jsonl", work.parent / "err.jsonl", slurm_client, shards, **kw)


def test_script_has_the_array_line_the_models_container_and_passes_shellcheck(tmp_path):
    cfg = fleet(VLLM_MODEL, sbatch_options={"mail-type": "FAIL"})
    text = executor(cfg, tmp_path / "w", None).script("0-3%2")
    lines = text.splitlines()
    for want in ["#SBATCH --array=0-3%2", "#SBATCH --job-name=slurmfleet-t-batch_0123abcd", "#SBATCH --gres=gpu:1",
                 "#SBATCH --mem=64G", "#SBATCH --partition=gpu", "#SBATCH --account=acct", "#SBATCH --qos=batch",
                 "#SBATCH --time=0-04:00:00", "#SBATCH --no-requeue", "#SBATCH --mail-type=FAIL",
                 f"#SBATCH --output={tmp_path}/w/logs/shard-%a.%A.log"]:
        assert want in lines, want
    assert 'SF_EXEC=( apptainer exec --nv --bind /data:/data:ro --bind "$SF_WORK:$SF_WORK" /img/vllm.sif )' in lines
    assert "export APPTAINERENV_HF_HOME=/cache" in lines   # (not in a command line: ps shows those to all)
    assert ("SF_ARGV=( vllm run-batch --model /models/m1 --served-model-name m1 m1-alias --tensor-parallel-size 1 "
            '--pipeline-parallel-size 1 --max-model-len 4096 --enable-prefix-caching -i "$SF_IN" -o "$SF_PART" )') in lines
    assert "uvicorn" not in text and "middleware" not in text and "--off" not in text   # server-only or false
    path = tmp_path / "array.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck)")
    res = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_reach_the_engine_as_single_words(value, tmp_path):
    path = "./" + value if value.startswith("-") else value   # (a leading '-' is refused: an option's, in vllm_args too)
    cfg = fleet({"name": "m1", "model_path": path, "container": {"enabled": False}, "env": {"EVIL": value},
                 "vllm_args": {"chat-template": path}})
    work = tmp_path / "w"
    work.mkdir()
    (work / "shard-0000.jsonl").write_text("{}\n")
    text = executor(cfg, work, None).script("0")
    launch = 'sf_engine "${SF_EXEC[@]}" "${SF_ARGV[@]}" &'
    assert launch in text
    probe = tmp_path / "probe.sh"   # (the model's env is the engine's: printed by the engine's process)
    probe.write_text(text.replace(launch, '(sf_engine bash -c \'printf "%s\\0" "$@" "$EVIL" > "$HOME/args"\' probe '
                                          '"${SF_ARGV[@]}"); exit 0'))
    out = subprocess.run(["bash", str(probe)], capture_output=True, cwd=tmp_path, env={
        "HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": "7"})
    assert out.returncode == 0, out.stderr
    args = (tmp_path / "args").read_bytes().decode().split("\0")[:-1]
    assert args[:4] == ["vllm", "run-batch", "--model", path], args
    assert args[args.index("--chat-template") + 1] == path and args[-1] == value
    assert args[-5:-1] == ["-i", f"{work}/shard-0000.jsonl", "-o", f"{work}/out/shard-0000.jsonl.part"]
    assert not Path("/tmp/pwned").exists()


def test_what_run_batch_cannot_do_is_refused(tmp_path):
    cfg = fleet(VLLM_MODEL)
    rec = new_batch("k", "f", "/v1/completions", "24h", None, 3, ["m1"])
    with pytest.raises(ValueError, match="does not serve /v1/completions"):
        ArrayBatch(rec, cfg, cfg.models[0], [], tmp_path, tmp_path / "o", tmp_path / "e", None, 2)
    big = fleet({**VLLM_MODEL, "nodes": 2, "gpus_per_node": 1, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="2 nodes"):
        executor(big, tmp_path, None)
    for bad in ("/tmp/x y", "/tmp/x\n"):   # (a last newline passed a match with $)
        with pytest.raises(ValueError, match="work dir"):
            executor(cfg, Path(bad), None)


def test_the_simulators_task_runs_simbatch_with_the_models_knobs():
    m = fleet(sim_model("s", simulator={"ttft_s": 0.5, "tokens_per_s": 7, "max_num_seqs": 3})).models[0]
    argv = run_batch_argv(m, "/py")
    assert argv == ["/py", "-m", "orchestrator.devtools.simbatch", "--served-model-name", "s", "--ttft-s", "0.5",
                    "--tokens-per-s", "7.0", "--max-num-seqs", "3"]


def test_a_retried_task_keeps_a_whole_output_that_came_late(tmp_path):
    """A retry submitted because the first output was late on a shared file system must not delete it once it
    is there (it would be lost: the shard counts done); otherwise it runs the shard again."""
    work = tmp_path / "w"
    work.mkdir()
    script = tmp_path / "task.sh"
    script.write_text(executor(fleet(VLLM_MODEL), work, None).script("0"))
    (work / "shard-0000.jsonl").write_text("a\nb\n")
    (work / "out").mkdir()
    out = work / "out" / "shard-0000.jsonl"
    out.write_text("A\nB\n")
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_ID": "7"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "already whole" in r.stdout and out.read_text() == "A\nB\n"
    out.write_text("A\n")   # not whole: the engine runs (here: no apptainer, so it fails)
    r = subprocess.run(["bash", str(script)], env={**env, "PATH": "/usr/bin:/bin"}, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "already whole" not in r.stdout


# -- the executor against a fake SLURM --------------------------------------------------------------------
class FakeSlurm:
    """sbatch/squeue/scancel of job arrays, the states set by the test."""

    def __init__(self):
        self.scripts: list[str] = []
        self.rows: dict[str, JobInfo] = {}
        self.cancelled: list[str] = []
        self.holds: list[tuple[str, str]] = []
        self.next = 100
        self.refusals: list[SlurmError] = []   # the next sbatch calls' refusals, in turn

    def set(self, task: str, state: str, reason: str | None = None) -> None:
        self.rows[task] = JobInfo(task, self.rows[task].name, state, reason, None, None, None, None, "node1", 0, None, "")

    async def submit(self, script: str) -> str:
        if self.refusals:
            raise self.refusals.pop(0)
        spec = re.search(r"^#SBATCH --array=(\S+)$", script, re.M)[1].split("%")[0]
        name = re.search(r"^#SBATCH --job-name=(\S+)$", script, re.M)[1]
        first, _, last = spec.partition("-")
        job, self.next = str(self.next), self.next + 1
        for t in range(int(first), int(last or first) + 1):
            self.rows[f"{job}_{t}"] = JobInfo(f"{job}_{t}", name, "PENDING", "None", None, None, None, None, "", 0, None, "")
        self.scripts.append(script)
        return job

    async def list_array_tasks(self, name: str) -> list[JobInfo]:
        return [r for r in self.rows.values() if r.name == name]

    async def hold(self, job_id: str) -> None:
        self.holds.append(("hold", job_id))
        for t, r in list(self.rows.items()):
            if t.split("_")[0] == job_id and r.state == "PENDING":
                self.set(t, "PENDING", "JobHeldUser")

    async def release(self, job_id: str) -> None:
        self.holds.append(("release", job_id))
        for t, r in list(self.rows.items()):
            if t.split("_")[0] == job_id and r.reason == "JobHeldUser":
                self.set(t, "PENDING", None)

    async def cancel(self, job_id: str, signal: str | None = None) -> None:
        self.cancelled.append(job_id)
        for t, r in list(self.rows.items()):
            if job_id in (t, t.split("_")[0]) and r.state in ("PENDING", "RUNNING", "SPECIAL_EXIT"):
                self.set(t, "CANCELLED")

    def live(self) -> list[str]:
        """The tasks waiting or running."""
        return sorted(t for t, r in self.rows.items() if r.state in ("PENDING", "RUNNING"))


def shard(ex: ArrayBatch, i: int) -> dict:
    """Shard i's progress ({} before the split)."""
    shards = ex.progress()["shards"]
    return shards[i] if i < len(shards) else {}


async def until(pred, what: str, timeout: float = 5.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_executor_retries_only_the_failed_shard_holds_retries_for_k_adopts_and_gives_up(tmp_path):
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, max_parallel=2, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the array's sbatch")
    assert "#SBATCH --array=0-2%2" in fake.scripts[0].splitlines()
    fake.set("100_0", "RUNNING")
    fake.set("100_1", "RUNNING")
    fake.set("100_2", "PENDING", "JobArrayTaskLimit")
    await until(lambda: ex.progress()["shards"][2]["reason"] == "JobArrayTaskLimit", "the pending reason")
    answer_shard(work, 0)
    fake.set("100_0", "COMPLETED")
    fake.set("100_1", "FAILED", "NonZeroExitCode")
    await until(lambda: ex.progress()["shards_done"] == 1, "shard 0 done")
    await asyncio.sleep(0.1)
    assert len(fake.scripts) == 1            # shard 2 still waits for the array's %2: no retry beside it
    fake.set("100_2", "RUNNING")             # now the array has no task waiting and one running: one slot
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry")
    assert "#SBATCH --array=1" in fake.scripts[1].splitlines()
    await until(lambda: ex.progress()["shards"][1]["job"] == "101_1", "the retry in squeue")
    assert [s["retries"] for s in ex.progress()["shards"]] == [0, 1, 0]
    # the daemon stops (its task cancelled): the array runs on; a new executor adopts it, submits nothing
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    ex2 = executor(cfg, work, fake, max_parallel=2, poll_s=0.01, lines=[])
    run = asyncio.create_task(ex2.run())
    await until(lambda: ex2.progress()["shards"][1]["job"] == "101_1", "the adopted retry")
    answer_shard(work, 2)
    fake.set("100_2", "COMPLETED")
    fake.set("101_1", "FAILED", "NonZeroExitCode")
    await until(lambda: len(fake.scripts) == 3, "shard 1's second retry")
    fake.set("102_1", "TIMEOUT")             # max_task_retries (2) spent: shard 1 is given up
    completed, failed = await asyncio.wait_for(run, 5)
    assert (completed, failed) == (6, 3) and len(fake.scripts) == 3 and not fake.cancelled
    assert [o["custom_id"] for o in read_jsonl(tmp_path / "out.jsonl")] == [f"req-{n}" for n in (0, 1, 2, 6, 7, 8)]
    errors = read_jsonl(tmp_path / "err.jsonl")
    assert [o["custom_id"] for o in errors] == ["req-3", "req-4", "req-5"]
    assert "3 times (last: TIMEOUT)" in errors[0]["error"]["message"]
    assert ex2.progress()["shards"][1]["state"] == "failed"
    # merged: a third executor (another restart) returns the counts without touching SLURM
    assert await executor(cfg, work, None, lines=[]).run() == (6, 3)


async def test_progress_counts_lines_answered_with_an_error_as_the_merge_does(tmp_path):
    """request_counts come from progress while the array runs: a line answered 400 is not counted completed
    there and then failed at the merge (the count going back), neither in a running shard nor in a done one."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, total=6, shards=2, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the array's sbatch")
    fake.set("100_0", "RUNNING")
    fake.set("100_1", "RUNNING")
    lines = (work / "shard-0001.jsonl").read_bytes().splitlines()
    (work / "out" / "shard-0001.jsonl.part").write_text(
        json.dumps(vllm_answer(lines[0], 400)) + "\n" + json.dumps(vllm_answer(lines[1])) + "\n")
    await until(lambda: shard(ex, 1).get("done") == 2, "shard 1's answers so far")
    assert shard(ex, 1)["errors"] == 1
    answer_shard(work, 0, bad={"req-1"})
    fake.set("100_0", "COMPLETED")
    await until(lambda: ex.progress()["shards_done"] == 1, "shard 0 done")
    assert shard(ex, 0)["errors"] is None   # its answers not read yet
    await ex.shard_usage()   # (the runner reads a done shard's answers each scan, before the progress)
    assert (shard(ex, 0)["done"], shard(ex, 0)["errors"]) == (3, 1)
    answer_shard(work, 1, bad={"req-3"})   # (its .part renamed whole)
    fake.set("100_1", "COMPLETED")
    assert await asyncio.wait_for(run, 5) == (4, 2)


async def test_a_task_that_can_never_start_blocks_the_batch_and_cancels_the_array(tmp_path):
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    answer_shard(work, 1)                 # shard 1 was done
    fake.set("100_1", "COMPLETED")
    fake.set("100_0", "PENDING", "PartitionConfig")
    with pytest.raises(ArrayBlocked, match="SLURM says PartitionConfig"):
        await asyncio.wait_for(run, 5)
    assert fake.cancelled == ["100"]
    with pytest.raises(ArrayBlocked):    # a restart does not submit it again
        await executor(cfg, work, fake, lines=[]).run()
    assert len(fake.scripts) == 1
    assert await ex.merge_done() == (3, 0)   # the batch fails with the shard done
    assert [o["custom_id"] for o in read_jsonl(tmp_path / "out.jsonl")] == ["req-3", "req-4", "req-5"]


@pytest.mark.parametrize("refusal", ["Job violates accounting/QOS policy (job submit limit, user's size and/or time "
                                     "limits)", "Required partition not available (inactive or drain)"])
async def test_a_retry_slurm_refuses_for_now_waits_and_leaves_the_running_shards_alone(tmp_path, monkeypatch, refusal):
    """A shard's retry refused at the user's job count limit (every array task counts) or in a drained partition
    blocked the batch and cancelled its whole array, hours of running shards with it; now it is tried again
    later (batchsubmit.NOT_NOW_S), the reason in the progress.  A task SLURM held after a failed launch (PENDING
    "launch failed requeued held": it never runs) waited for ever and held back every retry: it is cancelled
    and its shard retried."""
    import orchestrator.fleet.batchsubmit as batchsubmit
    monkeypatch.setattr(batchsubmit, "NOT_NOW_S", 0.5)
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the array's sbatch")
    fake.set("100_0", "RUNNING")
    fake.set("100_2", "PENDING", "launch failed requeued held")
    fake.refusals.append(SlurmError("sbatch", f"sbatch: error: Batch job submission failed: {refusal}",
                                    transient=False))
    fake.set("100_1", "FAILED")   # ended without its output: retried
    await until(lambda: ex.progress()["waiting"], "the refusal")
    assert refusal in ex.progress()["waiting"] and not ex.st["blocked"]
    assert fake.cancelled == ["100_2"] and fake.rows["100_0"].state == "RUNNING"   # (the held task alone)
    await until(lambda: len(fake.scripts) == 3, "the retries of shards 1 and 2, once SLURM takes them")
    assert sorted(re.search(r"--array=(\S+)", s)[1] for s in fake.scripts[1:]) == ["1", "2"]
    assert ex.progress()["waiting"] is None
    for i in range(3):
        answer_shard(work, i)
        fake.set(f"{ex._attempt(i)}_{i}", "COMPLETED")
    assert await asyncio.wait_for(run, 5) == (9, 0)


async def test_an_sbatch_that_never_reached_slurmctld_is_submitted_again_at_the_next_look(tmp_path):
    """No connection to slurmctld: no job was made, so none is awaited in squeue for submit_confirm_s (the array
    waited 2 minutes for one); a timeout, which slurmctld may have taken, is still awaited."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    fake.refusals.append(SlurmError("sbatch", "Unable to contact slurm controller (connect failure)", transient=True,
                                    started=False))
    ex = executor(cfg, work, fake, poll_s=0.01, submit_confirm_s=600)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the array's sbatch, at the next look")
    assert not fake.refusals and ex.st["job"] == "100"
    run.cancel()


async def test_jobs_submitted_just_before_a_crash_are_adopted_not_submitted_again(tmp_path):
    """The daemon died between sbatch and writing array.json: the array (and a retry) are found by name."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    await asyncio.to_thread(ex._split)
    await fake.submit(ex.script("0-2%3"))      # in SLURM, not in array.json
    fake.set("100_1", "FAILED")
    await fake.submit(ex.script("1"))          # its retry, likewise
    ex = executor(cfg, work, fake, poll_s=0.01, lines=[])
    run = asyncio.create_task(ex.run())
    await until(lambda: shard(ex, 1).get("job") == "101_1", "the adopted retry")
    assert ex.st["job"] == "100" and len(fake.scripts) == 2
    for i, task in enumerate(("100_0", "101_1", "100_2")):
        answer_shard(work, i)
        fake.set(task, "COMPLETED")
    assert await asyncio.wait_for(run, 5) == (9, 0) and len(fake.scripts) == 2


async def test_a_held_array_holds_what_waits_and_its_retries_until_released_and_counts_each_shard_done(tmp_path):
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)   # 3 shards, all 3 at once
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    fake.set("100_0", "RUNNING")
    answer_shard(work, 0)
    fake.set("100_0", "COMPLETED")
    await until(lambda: ex.progress()["shards_done"] == 1, "shard 0 done")
    assert await ex.shard_usage() == {0: (3, 3 * 3, 3 * 2)}   # its 3 lines answered, 3 + 2 tokens each
    fake.set("100_1", "RUNNING")
    ex.hold("budget spent")
    await until(lambda: fake.holds == [("hold", "100")], "the array held")
    assert ex.progress()["held"] == "budget spent"
    await until(lambda: shard(ex, 2).get("reason") == "JobHeldUser", "shard 2 held in squeue")
    assert shard(ex, 1)["state"] == "RUNNING"     # a running task runs on
    fake.set("100_2", "RUNNING")                  # (it had started): no task of the array waits now ...
    fake.set("100_1", "FAILED", "NonZeroExitCode")
    await asyncio.sleep(0.2)
    assert len(fake.scripts) == 1                 # ... yet shard 1's retry, a new job, waits for the release
    assert executor(cfg, work, fake, lines=[]).progress()["held"] == "budget spent"   # kept for a restart
    ex.release()
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry after the release")
    assert fake.holds == [("hold", "100")]        # nothing of the array waited held: nothing to release
    await until(lambda: shard(ex, 1).get("job") == "101_1", "the retry in squeue")
    ex.hold("spent again")                        # what waits now: the retry
    await until(lambda: fake.holds[1:] == [("hold", "101")], "the retry held")
    fake.set("101_1", "PENDING", "Priority")      # waiting unheld while held (an operator released it, say)
    await until(lambda: fake.holds[1:] == [("hold", "101")] * 2, "held again at the next look")
    ex.release()
    await until(lambda: fake.holds[-1] == ("release", "101"), "the retry released")
    fake.set("101_1", "PENDING", "JobHeldUser")   # then an operator holds it: theirs, left alone
    await asyncio.sleep(0.2)
    assert fake.holds[-1] == ("release", "101") and fake.holds.count(("release", "101")) == 1
    answer_shard(work, 1)
    fake.set("101_1", "COMPLETED")
    answer_shard(work, 2)
    fake.set("100_2", "COMPLETED")
    assert await asyncio.wait_for(run, 5) == (9, 0)
    assert await ex.shard_usage() == {i: (3, 9, 6) for i in range(3)} and ex.progress()["held"] is None


async def test_an_array_held_when_its_last_shard_ends_does_not_say_held_once_merged(tmp_path):
    """The last shard's own tokens spend its owner's budget: the array is held as it ends (or just after, before
    the runner sees its end), and the batch, done, said "held: the token budget ... is spent" for good in `batch status` (found by a soak)."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    for i in range(3):
        fake.set(f"100_{i}", "RUNNING")
    for i in range(2):
        answer_shard(work, i)
        fake.set(f"100_{i}", "COMPLETED")
    await until(lambda: ex.progress()["shards_done"] == 2, "shards 0 and 1 done")
    ex.hold("budget spent")
    assert ex.progress()["held"] == "budget spent"
    answer_shard(work, 2)
    fake.set("100_2", "COMPLETED")
    assert await asyncio.wait_for(run, 5) == (9, 0)
    assert ex.progress()["merged"] and ex.progress()["held"] is None
    ex.hold("budget spent")   # (the runner's budget look, between the array's end and its batch's)
    assert ex.progress()["held"] is None


@pytest.mark.parametrize("held, rows, mine, want", [
    # held: every job with a task waiting unheld, whatever the reason it waits for
    (True, [("100_1", "PENDING", "JobArrayTaskLimit"), ("100_2", "PENDING", "Priority"), ("101_0", "PENDING", None)],
     [], ["100", "101"]),
    (True, [("100_1", "PENDING", "JobHeldUser"), ("100_2", "RUNNING", None), ("101_0", "PENDING", "JobHeldAdmin")],
     ["100"], []),
    # released: only the jobs this batch held, still waiting in a user hold (an admin's hold stays)
    (False, [("100_1", "PENDING", "JobHeldUser"), ("102_0", "PENDING", "JobHeldUser"),
             ("103_0", "PENDING", "JobHeldAdmin")], ["100", "103"], ["100"]),
    (False, [("100_1", "PENDING", "Priority"), ("100_2", "COMPLETED", "JobHeldUser")], ["100"], []),
    (True, [None, ("bad", "PENDING", None)], [], []),
])
def test_which_jobs_a_hold_or_release_acts_on(held, rows, mine, want):
    infos = [None if r is None else JobInfo(r[0], "n", r[1], r[2], None, None, None, None, "", 0, None, "")
             for r in rows]
    assert to_hold_or_release(infos, held, mine) == want


async def test_a_cancel_after_a_restart_finds_an_array_submitted_just_before_the_crash(tmp_path):
    """sbatch went through, the daemon died before array.json had the job id, and the batch was cancelled (or
    expired, or its key revoked) meanwhile: the array is found by its name and cancelled, not left to run."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    await asyncio.to_thread(ex._split)
    await fake.submit(ex.script("0-2%3"))      # in SLURM, not in array.json
    ex = executor(cfg, work, fake, poll_s=0.01, lines=[])
    await ex.cancel()
    assert await asyncio.wait_for(ex.run(), 5) == (0, 0)
    assert set(fake.cancelled) == {"100"} and len(fake.scripts) == 1


async def test_a_batch_cancelled_before_its_split_reads_nothing_and_submits_nothing(tmp_path):
    def lines():
        raise AssertionError("the input was read")
        yield
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01, lines=lines())
    await ex.cancel()
    assert await asyncio.wait_for(ex.run(), 5) == (0, 0) and not fake.scripts and ex.st["counts"] == []


async def test_an_expired_array_gives_every_line_not_answered_a_batch_expired_error_line(tmp_path):
    """As shared mode's expired batches: the counts add up to the total, whether shards ran or (a daemon down
    across the expiry) nothing was even split or submitted."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    answer_shard(work, 0)
    fake.set("100_0", "COMPLETED")
    fake.set("100_1", "RUNNING")
    await until(lambda: ex.progress()["shards_done"] == 1, "shard 0 done")
    await ex.cancel(expired=True)
    assert await asyncio.wait_for(run, 5) == (3, 6) and fake.cancelled == ["100"]
    errors = read_jsonl(tmp_path / "err.jsonl")
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"req-{n}", "batch_expired") for n in range(3, 9)]
    assert executor(cfg, work, None, lines=[]).st["expired"]   # (kept for a restart's merge)
    ex = executor(cfg, tmp_path / "w2", fake, poll_s=0.01)   # expired before its split: split, never submitted
    await ex.cancel(expired=True)
    assert await asyncio.wait_for(ex.run(), 5) == (0, 9) and len(fake.scripts) == 1
    assert [e["error"]["code"] for e in read_jsonl(tmp_path / "err.jsonl")] == ["batch_expired"] * 9


async def test_a_job_is_listed_as_the_batchs_before_it_is_held(tmp_path):
    """So a crash (or a failed scontrol) between the two leaves it to the next period's release."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"

    async def refuse(job):
        raise SlurmError("scontrol", "slurmctld unreachable", transient=True)
    fake.hold = refuse
    ex = executor(cfg, work, fake, poll_s=0.01)
    ex.hold("budget spent")
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    await until(lambda: executor(cfg, work, fake, lines=[]).st.get("held_jobs") == ["100"], "listed, saved")
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)


async def test_a_restart_with_every_shard_done_cancels_a_retry_still_queued(tmp_path):
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    await asyncio.to_thread(ex._split)
    ex.st["job"] = await fake.submit(ex.script("0-2%3"))
    ex.st["attempts"]["1"] = await fake.submit(ex.script("1"))   # shard 1's retry, waiting (held, say)
    ex._save()
    for i, task in enumerate(("100_0", "100_1", "100_2")):
        answer_shard(work, i)                   # shard 1's first output came after all
        fake.set(task, "COMPLETED")
    ex = executor(cfg, work, fake, poll_s=0.01, lines=[])
    assert await asyncio.wait_for(ex.run(), 5) == (9, 0)
    assert fake.cancelled == ["101"]


async def test_an_exit_0_without_the_output_waits_for_the_shared_file_system_then_retries(tmp_path):
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, total=4, shards=2, poll_s=0.01, settle_s=2.0)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    fake.set("100_0", "COMPLETED")           # the renamed output has not reached this host yet
    fake.set("100_1", "COMPLETED")           # this one never comes
    await asyncio.sleep(0.25)                # (many looks, well within settle_s even on a loaded machine)
    assert len(fake.scripts) == 1
    answer_shard(work, 0)
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry after settle_s", 8)
    assert "#SBATCH --array=1" in fake.scripts[1].splitlines() and ex.progress()["shards"][0]["state"] == "done"
    await until(lambda: shard(ex, 1).get("job") == "101_1", "the retry in squeue")
    answer_shard(work, 1)   # the first output came after all, while its retry waits: the retry is not needed
    assert await asyncio.wait_for(run, 5) == (4, 0)
    assert fake.cancelled == ["101"]


async def test_a_task_slurm_requeued_held_after_a_special_exit_is_cancelled_and_its_shard_retried(tmp_path):
    # (a site's RequeueExitHold: the task stays in the queue held, SPECIAL_EXIT; released, it would run beside
    # its retry and write the same shard)
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, total=4, shards=2, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    fake.set("100_0", "RUNNING")
    fake.set("100_1", "SPECIAL_EXIT", "JobHeldAdmin")
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry")
    assert "#SBATCH --array=1" in fake.scripts[1].splitlines()
    assert fake.cancelled == ["100_1"] and fake.rows["100_1"].state == "CANCELLED"   # the task, not the array
    assert fake.rows["100_0"].state == "RUNNING"
    for i, task in ((0, "100_0"), (1, "101_1")):
        answer_shard(work, i)
        fake.set(task, "COMPLETED")
    assert await asyncio.wait_for(run, 5) == (4, 0)


# -- an sbatch whose outcome is unknown ---------------------------------------------------------------------
class LaggingSlurm(FakeSlurm):
    """sbatch times out (the calls numbered in ``timeouts``, from 0) although slurmctld took the job, or (``hang``)
    never answers, as a daemon killed while its sbatch child runs; squeue shows a job only ``lag`` looks after
    its sbatch.  ``saved``: the array's state on disk as each sbatch began (``state``: its file)."""

    def __init__(self, timeouts=(), lag: int = 2, hang: bool = False, state: Path | None = None):
        super().__init__()
        self.timeouts, self.lag, self.hang, self.calls, self.state = set(timeouts), lag, hang, 0, state
        self.unseen: dict[str, int] = {}   # job -> looks before squeue lists it
        self.saved: list[dict] = []
        self.answer = asyncio.Event()   # (hang: sbatch answers once it is set)

    async def submit(self, script: str) -> str:
        if self.state:
            self.saved.append(json.loads(self.state.read_text()))
        job = await super().submit(script)
        self.unseen[job], self.calls = self.lag, self.calls + 1
        if self.hang:
            await self.answer.wait()
        if self.calls - 1 in self.timeouts:
            raise SlurmError("sbatch", "timed out after 30s", transient=True)
        return job

    async def list_array_tasks(self, name: str) -> list[JobInfo]:
        rows = [r for r in await super().list_array_tasks(name) if not self.unseen.get(r.job_id.split("_")[0])]
        self.unseen = {job: max(0, n - 1) for job, n in self.unseen.items()}
        return rows


async def finish(ex: ArrayBatch, fake: FakeSlurm, work: Path, run, tasks) -> tuple[int, int]:
    """Each task runs (seen running: a retry still queued when its shard is done is cancelled), then ends done."""
    for task in tasks:
        fake.set(task, "RUNNING")
    await until(lambda: all(s["state"] == "RUNNING" for s in ex.progress()["shards"]), "every task running")
    for i, task in enumerate(tasks):
        answer_shard(work, i)
        fake.set(task, "COMPLETED")
    return await asyncio.wait_for(run, 5)


async def test_an_array_whose_sbatch_timed_out_is_awaited_in_squeue_and_adopted_not_submitted_twice(tmp_path):
    """slurmctld took the job, sbatch timed out, squeue lists it only two looks later: one array, not two (two
    tasks of a shard delete each other's output)."""
    cfg, work = fleet(VLLM_MODEL), tmp_path / "w"
    fake = LaggingSlurm(timeouts={0}, state=work / "array.json")
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: ex.st["job"] is not None, "the array known")
    await asyncio.sleep(0.1)
    assert ex.st["job"] == "100" and len(fake.scripts) == 1 and ex.st["submitting"] == {}
    assert fake.saved[0]["submitting"]["array"]["array"] == "0-2%3" and fake.saved[0]["job"] is None
    assert executor(cfg, work, None, lines=[]).st["job"] == "100"
    assert await finish(ex, fake, work, run, ("100_0", "100_1", "100_2")) == (9, 0)
    assert len(fake.scripts) == 1 and not fake.cancelled


async def test_a_daemon_killed_while_its_sbatch_ran_adopts_the_array_when_squeue_shows_it(tmp_path):
    cfg, fake, work = fleet(VLLM_MODEL), LaggingSlurm(hang=True, lag=3), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    run.cancel()    # the daemon dies with its sbatch child (slurmctld had the job)
    await asyncio.gather(run, return_exceptions=True)
    fake.hang = False
    ex = executor(cfg, work, fake, poll_s=0.01, lines=[])
    run = asyncio.create_task(ex.run())
    await until(lambda: ex.st["job"] is not None, "the array known")
    await asyncio.sleep(0.1)
    assert ex.st["job"] == "100" and len(fake.scripts) == 1
    assert await finish(ex, fake, work, run, ("100_0", "100_1", "100_2")) == (9, 0) and len(fake.scripts) == 1


async def test_a_retry_whose_sbatch_timed_out_is_awaited_in_squeue_and_adopted_not_submitted_twice(tmp_path):
    cfg, work = fleet(VLLM_MODEL), tmp_path / "w"
    fake = LaggingSlurm(timeouts={1}, state=work / "array.json")
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    fake.set("100_0", "RUNNING")
    fake.set("100_1", "FAILED", "NonZeroExitCode")
    fake.set("100_2", "RUNNING")
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry")
    await until(lambda: ex.st["attempts"].get("1"), "the retry known")
    await asyncio.sleep(0.1)
    assert ex.st["attempts"] == {"1": "101"} and ex.st["retries"] == {"1": 1} and ex.st["submitting"] == {}
    assert fake.saved[1]["submitting"]["1"]["array"] == "1" and fake.saved[1]["retries"] == {"1": 1}
    assert len(fake.scripts) == 2 and shard(ex, 1)["job"] == "101_1"
    assert await finish(ex, fake, work, run, ("100_0", "101_1", "100_2")) == (9, 0)
    assert len(fake.scripts) == 2 and not fake.cancelled


async def test_a_retry_whose_sbatch_is_awaited_holds_back_no_other_shards_retry(tmp_path):
    """While shard 1's retry is awaited in squeue (its sbatch timed out), its attempt is still the array's task
    and reads PENDING: that was taken for a task of the array still waiting (SLURM's %K counts those), so no
    other shard's retry went for up to submit_confirm_s.  It takes one of the K slots, no more (retry_slots)."""
    cfg, work = fleet(VLLM_MODEL), tmp_path / "w"
    fake = LaggingSlurm(timeouts={1}, lag=10**6)   # squeue lists a job only once the test says so
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    fake.unseen["100"] = 0
    fake.set("100_0", "RUNNING")
    fake.set("100_1", "FAILED", "NonZeroExitCode")
    fake.set("100_2", "RUNNING")
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry")
    await asyncio.sleep(0.05)
    assert ex.subs.awaited("1") and ex.st["attempts"] == {}
    fake.set("100_2", "FAILED", "NonZeroExitCode")
    await until(lambda: len(fake.scripts) == 3, "shard 2's retry beside the one awaited", timeout=2)
    assert "#SBATCH --array=2" in fake.scripts[2].splitlines() and ex.st["attempts"] == {"2": "102"}
    fake.unseen.update({"101": 0, "102": 0})   # squeue lists them: shard 1's retry is adopted
    await until(lambda: ex.st["attempts"] == {"1": "101", "2": "102"}, "the retry adopted")
    assert await finish(ex, fake, work, run, ("100_0", "101_1", "102_2")) == (9, 0)
    assert len(fake.scripts) == 3 and not fake.cancelled


async def test_a_cancel_leaves_no_task_of_the_batch_waiting_or_running(tmp_path):
    """After an sbatch whose outcome was unknown: the array found in squeue is cancelled, even when it shows
    up only after the cancel; and one whose sbatch answers after the cancel."""
    cfg, fake, work = fleet(VLLM_MODEL), LaggingSlurm(timeouts={0}), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: ex.st["job"] is not None, "the array known")
    await asyncio.sleep(0.1)
    for task in fake.rows:
        fake.set(task, "RUNNING")
    await ex.cancel()
    assert await asyncio.wait_for(run, 5) == (0, 0)
    assert fake.live() == [] and fake.rows and len(fake.scripts) == 1
    fake = LaggingSlurm(timeouts={0}, lag=4)   # cancelled before squeue lists it
    ex = executor(cfg, tmp_path / "w2", fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    await ex.cancel()
    assert await asyncio.wait_for(run, 5) == (0, 0)
    assert fake.live() == [] and fake.cancelled == ["100"] and len(fake.scripts) == 1
    fake = LaggingSlurm(hang=True, lag=4)   # cancelled while the sbatch runs, which then answers
    ex = executor(cfg, tmp_path / "w3", fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    await ex.cancel()
    fake.answer.set()
    assert await asyncio.wait_for(run, 5) == (0, 0)
    assert fake.live() == [] and fake.cancelled == ["100"] and len(fake.scripts) == 1


async def test_a_stray_job_of_the_batchs_name_is_cancelled(tmp_path):
    """A duplicate array (an sbatch awaited too long that showed up after all) and a second retry of a shard:
    neither runs beside the job kept."""
    cfg, fake, work = fleet(VLLM_MODEL), FakeSlurm(), tmp_path / "w"
    ex = executor(cfg, work, fake, poll_s=0.01)
    run = asyncio.create_task(ex.run())
    await until(lambda: fake.scripts, "the sbatch")
    fake.set("100_0", "RUNNING")
    await fake.submit(ex.script("0-2%3"))                  # 101: a duplicate array
    await until(lambda: fake.cancelled == ["101"], "the duplicate cancelled")
    assert fake.live() == ["100_0", "100_1", "100_2"] and ex.st["job"] == "100" and ex.st["attempts"] == {}
    fake.set("100_1", "FAILED", "NonZeroExitCode")
    fake.set("100_2", "RUNNING")                           # (no task of the array waits: a retry may go)
    await until(lambda: shard(ex, 1).get("job") == "102_1", "shard 1's retry")
    await fake.submit(ex.script("1"))                      # 103: a second retry of shard 1
    await until(lambda: fake.cancelled == ["101", "103"], "the second retry cancelled")
    assert ex.st["attempts"] == {"1": "102"} and fake.live() == ["100_0", "100_2", "102_1"]
    assert await finish(ex, fake, work, run, ("100_0", "102_1", "100_2")) == (9, 0)
    assert fake.cancelled == ["101", "103"] and len(fake.scripts) == 4


async def test_an_sbatch_that_never_shows_up_in_squeue_is_submitted_again_after_the_confirm_window(tmp_path):
    """sbatch failed before slurmctld took the job: after submit_confirm_s without it in squeue, submitted
    again (a retry's count given back)."""
    class Lost(FakeSlurm):
        calls, lost = 0, []

        async def submit(self, script):   # calls 0 and 2 fail before slurmctld has the job
            self.calls += 1
            if self.calls - 1 in (0, 2):
                self.lost = [*self.lost, self.calls - 1]
                raise SlurmError("sbatch", "Socket timed out on send/recv operation", transient=True)
            return await super().submit(script)
    fake, work = Lost(), tmp_path / "w"
    ex = executor(fleet(VLLM_MODEL), work, fake, poll_s=0.01, submit_confirm_s=2.0)
    run = asyncio.create_task(ex.run())
    await asyncio.sleep(0.2)
    assert fake.lost == [0] and not fake.scripts and ex.progress()["shards"][0]["state"] == "UNSUBMITTED"
    await until(lambda: fake.scripts, "the array's sbatch again", 8)
    fake.set("100_0", "RUNNING")
    fake.set("100_1", "FAILED", "NonZeroExitCode")
    fake.set("100_2", "RUNNING")
    await until(lambda: fake.lost == [0, 2], "shard 1's retry's sbatch")
    await asyncio.sleep(0.2)
    assert len(fake.scripts) == 1 and ex.st["retries"] == {"1": 1} and "1" in ex.st["submitting"]
    await until(lambda: len(fake.scripts) == 2, "shard 1's retry again", 8)
    assert await finish(ex, fake, work, run, ("100_0", "101_1", "100_2")) == (9, 0)
    assert ex.st["retries"] == {"1": 1} and ex.st["submitting"] == {}


def jobinfo(task: str, state: str = "PENDING") -> JobInfo:
    return JobInfo(task, "n", state, None, None, None, None, None, "", 0, None, "")


@pytest.mark.parametrize("rows,base,attempts,want", [
    ([], None, {}, (None, {}, set())),
    # the array not known (its sbatch timed out): the oldest job listed; a second array is a stray
    ([("100_0",), ("100_1",), ("101_0",), ("101_1", "RUNNING")], None, {}, ("100", {}, {"101"})),
    # a job of one task beside the array's task of that shard, waiting: a stray (a second array of one shard)
    ([("100_0",), ("101_0",)], None, {}, ("100", {}, {"101"})),
    # a retry whose sbatch timed out (or a crash came before it was saved): a newer job of that shard alone,
    # the shard's task ended; a second one is a stray, an ended one left alone
    ([("100_0", "FAILED"), ("100_1",), ("102_0",), ("103_0",), ("104_1", "FAILED")], "100", {},
     ("100", {0: "102"}, {"103"})),
    ([("100_1", "FAILED"), ("101_1", "CANCELLED"), ("102_1",)], "100", {1: "101"}, ("100", {1: "102"}, set())),
    # an older attempt's job, still held (SPECIAL_EXIT), is a stray; a job of the array's shard 1 alone while
    # it runs is one too
    ([("100_1", "RUNNING"), ("101_0", "SPECIAL_EXIT"), ("102_0",), ("103_1",)], "100", {0: "102"},
     ("100", {}, {"101", "103"})),
])
def test_which_listed_jobs_are_the_arrays_a_retry_or_strays(rows, base, attempts, want):
    from orchestrator.fleet.batchrules import sort_jobs   # (here: the other tests also run against an older tree)
    assert sort_jobs([jobinfo(*r) for r in rows], base, attempts, 2) == want


# -- on the local cluster -----------------------------------------------------------------------------------
def cluster_fleet(tmp_path: Path, model: dict) -> FleetConfig:
    return FleetConfig.model_validate({"fleet": "b" + os.urandom(4).hex(), "state_dir": str(tmp_path / "state"),
                                       "models": [model], "cluster": {"partition": "gpu",
                                                                      "slurm_conf": os.environ.get("SLURM_CONF")}})


def sim_answer(raw: bytes) -> tuple[str, int]:
    """What the simulator's deterministic tokens answer to a request line: (text, completion tokens)."""
    body, vocab = json.loads(raw)["body"], SimVocab()
    ids = list(vocab.generate(vocab.prompt(body, True), body["max_tokens"], body))
    return vocab.text(ids), len(ids)


async def test_simulator_array_retries_a_killed_task_across_a_daemon_restart(cluster, tmp_path):
    """3 shards; shard 1's task is scancelled mid-shard while the executor is stopped (a daemon restart): the
    next executor adopts the array (no second sbatch of it), resubmits only task 1, and the merged output
    has every line once, in input order, with the simulator's answers."""
    cfg = cluster_fleet(tmp_path, sim_model("sim", simulator={"ttft_s": 0.05, "tokens_per_s": 20, "max_num_seqs": 1}))
    cli = CliSlurm(f"{cfg.job_name}-batch_0123abcd", cfg.cluster.slurm_conf)
    lines = numbered(30, "sim", max_tokens=16)   # 0.85 s a line, 8.5 s a shard: the kill lands mid-shard
    work = tmp_path / "state" / "batches" / "batch_0123abcd.array"
    t0 = time.monotonic()
    ex = executor(cfg, work, cli, total=30, shards=3, lines=lines, poll_s=0.3)
    run = asyncio.create_task(ex.run())
    try:
        await until(lambda: shard(ex, 1).get("state") == "RUNNING" and shard(ex, 1)["done"] >= 2,
                    "shard 1 half answered", 90)
        killed, base = ex.progress()["shards"][1]["job"], ex.st["job"]
        run.cancel()    # the daemon stops ...
        await asyncio.gather(run, return_exceptions=True)
        slurm("scancel", killed)     # ... and meanwhile shard 1's task is killed
        ex2 = executor(cfg, work, cli, total=30, shards=3, lines=[], poll_s=0.3)
        completed, failed = await asyncio.wait_for(ex2.run(), 120)
    finally:
        run.cancel()
        slurm("scancel", "--name", cli.job_name, check=False)
    elapsed = time.monotonic() - t0
    assert (completed, failed) == (30, 0) and ex2.st["job"] == base and ex2.st["retries"] == {"1": 1}
    out = read_jsonl(tmp_path / "state" / "batches" / "out.jsonl")
    assert [o["custom_id"] for o in out] == [f"req-{n}" for n in range(30)]           # input order, none twice
    assert [o["id"] for o in out] == [f"batch_req_0123abcd-{n}" for n, _ in lines]
    for o, (_, raw) in zip(out, lines, strict=True):
        text, n = sim_answer(raw)
        assert o["response"]["body"]["choices"][0]["message"]["content"] == text
        assert o["response"]["body"]["usage"]["completion_tokens"] == n == 16
    assert read_jsonl(tmp_path / "state" / "batches" / "err.jsonl") == []
    rows = {r.job_id: r for r in await cli.list_array_tasks(cli.job_name)}
    retry = ex2.st["attempts"]["1"]
    assert {k: r.state for k, r in rows.items()} == {f"{base}_0": "COMPLETED", f"{base}_1": "CANCELLED",
                                                     f"{base}_2": "COMPLETED", f"{retry}_1": "COMPLETED"}
    # each task gave its GPU back when its shard was done: shards 0 and 2 ended before the retry did
    assert max(rows[f"{base}_0"].end_time, rows[f"{base}_2"].end_time) < rows[f"{retry}_1"].end_time
    log0 = (work / "logs" / f"shard-0.{base}.log").read_text()
    assert re.search(r"CUDA_VISIBLE_DEVICES=\d", log0), log0
    print(f"simulator array: 3 shards x 10 lines, task 1 killed once and retried, in {elapsed:.1f}s")


async def test_cancel_scancels_the_array_and_keeps_the_shards_done(cluster, tmp_path):
    cfg = cluster_fleet(tmp_path, sim_model("sim", simulator={"ttft_s": 0.05, "tokens_per_s": 20, "max_num_seqs": 1}))
    cli = CliSlurm(f"{cfg.job_name}-batch_0123abcd", cfg.cluster.slurm_conf)
    # 4 lines of 1 s a shard: shard 1 is still running when the cancel comes right after shard 0
    ex = executor(cfg, tmp_path / "state" / "w", cli, total=8, shards=2, lines=numbered(8, "sim", max_tokens=20),
                  max_parallel=1, poll_s=0.3)
    run = asyncio.create_task(ex.run())
    reasons = set()
    try:
        def watch():
            reasons.add(shard(ex, 1).get("reason"))
            return ex.progress()["shards_done"] == 1
        await until(watch, "shard 0 done", 90)
        t0 = time.monotonic()
        await ex.cancel()
        completed, failed = await asyncio.wait_for(run, 30)
        took = time.monotonic() - t0
    finally:
        run.cancel()
        slurm("scancel", "--name", cli.job_name, check=False)
    assert "JobArrayTaskLimit" in reasons           # shard 1 waited for the array's %1, as SLURM says
    assert (completed, failed) == (4, 0) and took < 10
    assert [o["custom_id"] for o in read_jsonl(tmp_path / "state" / "out.jsonl")] == [f"req-{n}" for n in range(4)]
    states = {r.job_id: r.state for r in await cli.list_array_tasks(cli.job_name)}
    assert states[f"{ex.st['job']}_1"] == "CANCELLED" and ex.progress()["shards"][1]["state"] == "cancelled"


@pytest.mark.cluster
@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_real_vllm_run_batch_two_shards_one_task_killed_and_retried(cluster, tmp_path, monkeypatch):
    if not (VLLM_BIN / "vllm").exists() or not (MODEL_DIR / "config.json").exists():
        pytest.fail("real vLLM is not set up: run .ci/setup-vllm")
    from test_vllm_e2e import ARGS, ENV

    image = tmp_path / "vllm-cpu.sif"
    image.write_text("stand-in image for the apptainer shim")
    shim = tmp_path / "bin"  # the apptainer shim only: `vllm` is the real one
    shim.mkdir()
    (shim / "apptainer").symlink_to(SHIMS / "apptainer")
    calls = tmp_path / "apptainer.log"
    monkeypatch.setenv("PATH", f"{shim}:{VLLM_BIN}:{os.environ['PATH']}")
    monkeypatch.setenv("SF_APPTAINER_REQUIRE_NV", "1")
    monkeypatch.setenv("SF_APPTAINER_LOG", str(calls))
    cfg = cluster_fleet(tmp_path, {
        "name": "tiny", "engine": "vllm", "model_path": str(MODEL_DIR), "gpus_per_node": 1, "cpus_per_task": 1,
        "container": {"image": str(image), "binds": [f"{MODEL_DIR}:{MODEL_DIR}:ro"]}, "env": ENV,
        "vllm_args": {**ARGS, "enforce-eager": True}})
    cli = CliSlurm(f"{cfg.job_name}-batch_0123abcd", cfg.cluster.slurm_conf)
    lines = numbered(12, "tiny", max_tokens=4)
    work = tmp_path / "state" / "w"
    ex = executor(cfg, work, cli, total=12, shards=2, lines=lines, poll_s=1)
    t0 = time.monotonic()
    run = asyncio.create_task(ex.run())
    try:
        await until(lambda: shard(ex, 1).get("state") == "RUNNING", "shard 1's task running", 120)
        killed = shard(ex, 1)["job"]
        log1 = work / "logs" / f"shard-1.{ex.st['job']}.log"
        await until(lambda: "run_batch.py" in (log1.read_text() if log1.exists() else ""), "vllm run-batch started", 180)
        slurm("scancel", killed)    # vLLM is loading the model or running the shard
        completed, failed = await asyncio.wait_for(run, 600)
    finally:
        run.cancel()
        slurm("scancel", "--name", cli.job_name, check=False)
    elapsed = time.monotonic() - t0
    base, retry = ex.st["job"], ex.st["attempts"]["1"]
    assert (completed, failed) == (12, 0) and ex.st["retries"] == {"1": 1}, ex.progress()
    out = read_jsonl(tmp_path / "state" / "out.jsonl")
    assert [o["custom_id"] for o in out] == [f"req-{n}" for n in range(12)]
    assert [o["id"] for o in out] == [f"batch_req_0123abcd-{n}" for n, _ in lines]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["object"] == "chat.completion" and
               o["response"]["body"]["usage"]["completion_tokens"] == 4 for o in out)
    states = {r.job_id: r.state for r in await cli.list_array_tasks(cli.job_name)}
    assert states == {f"{base}_0": "COMPLETED", f"{base}_1": "CANCELLED", f"{retry}_1": "COMPLETED"}
    runs = [c.split("\0") for c in calls.read_text().splitlines()]
    assert len(runs) == 3 and all(r[:2] == ["exec", "--nv"] for r in runs)
    after = runs[0][runs[0].index(str(image)) + 1:]
    assert after[:4] == ["vllm", "run-batch", "--model", str(MODEL_DIR)] and "--enforce-eager" in after
    print(f"real vLLM array: 2 shards x 6 lines, task 1 killed once and retried, in {elapsed:.1f}s")


def test_the_simulators_run_batch_reads_max_tokens_as_vllm_serve_does(tmp_path):
    """simbatch's answers as vLLM's: max_completion_tokens before max_tokens, none asked is the context left,
    more than the context a 400, and the model's first served name in the answer."""
    from orchestrator.devtools.simbatch import SimBatch, parse_args
    from orchestrator.devtools.simengine import MAX_MODEL_LEN

    sb = SimBatch(parse_args(["-i", "x", "-o", "y", "--served-model-name", "m", "alias", "--tokens-per-s", "1e6",
                              "--ttft-s", "0"]))
    msgs = [{"role": "user", "content": "hi"}]

    def answer(**body):
        out = asyncio.run(sb.answer({"custom_id": "c", "url": "/v1/chat/completions",
                                     "body": {"model": "alias", "messages": msgs, "ignore_eos": True, **body}}))
        return out["response"]["status_code"], out["response"]["body"], out["error"]
    status, body, _ = answer(max_tokens=50, max_completion_tokens=7)
    assert status == 200 and body["usage"]["completion_tokens"] == 7 and body["model"] == "m"
    status, body, _ = answer()
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_MODEL_LEN - body["usage"]["prompt_tokens"]
    status, body, err = answer(max_tokens=MAX_MODEL_LEN + 1)
    assert status == 400 and body is None and "cannot be greater than max_model_len" in err["error"]["message"]
    full = answer(max_tokens=20)[1]["choices"][0]["message"]["content"]   # a stop string ends it, as vllm serve
    stop = full[10:13]
    choice = answer(max_tokens=20, stop=[stop])[1]["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == \
        (full[:full.find(stop)], "stop", stop)
    # n choices, as vllm serve answers them (each seeded seed + j; the prompt counted once)
    status, body, _ = answer(max_tokens=5, n=3, temperature=1.0, seed=4)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 15 and len({c["message"]["content"] for c in body["choices"]}) == 3
    alone = answer(max_tokens=5, temperature=1.0, seed=6)[1]["choices"][0]["message"]["content"]
    assert body["choices"][2]["message"]["content"] == alone
    status, _, err = answer(max_tokens=5, n=2, temperature=0)
    assert status == 400 and "greedy" in err["error"]["message"]
    # logprobs in vllm serve's shape, and its 400 past --max-logprobs
    status, body, _ = answer(max_tokens=6, logprobs=True, top_logprobs=2)
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"] and len(content) == 6
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in content)
    assert answer(max_tokens=6)[1]["choices"][0]["logprobs"] is None
    status, _, err = answer(max_tokens=5, logprobs=True, top_logprobs=21)
    assert status == 400 and "greater than max allowed: 20" in err["error"]["message"]
    assert err["error"]["param"] == "logprobs"


def test_a_dedicated_batch_whose_shards_were_all_answered_completes_though_its_window_closes_in_the_merge(
        tmp_path, monkeypatch):
    """Every shard answered within the window, the merge (minutes for a large batch) still running as it closed:
    the batch ended ``expired`` with every line completed. Once every shard is done nothing but a cancel decides
    its end. Found by a review."""
    from orchestrator.batches import BatchStore
    from orchestrator.batchfiles import FileStore
    from orchestrator.fleet import batchdedicated, batcharray
    from orchestrator.fleet.batchrun import BatchRunner
    monkeypatch.setattr(batchdedicated, "SCAN_S", 0.05)
    cfg, fake = fleet(VLLM_MODEL), FakeSlurm()
    store = BatchStore(tmp_path / "batches")
    rec = new_batch("alice", "file-x", "/v1/chat/completions", "24h", {"shards": "2"}, 6, ["m1"])
    rec["shards"] = 2
    store.save(rec)
    later, made, merge_of = [0.0], [], batcharray.merge

    def slow_merge(*args, **kwargs):   # the window closes while the shards done are merged
        later[0] = 86400 + 1
        time.sleep(0.5)
        return merge_of(*args, **kwargs)
    monkeypatch.setattr(batcharray, "merge", slow_merge)

    def factory(rec, out, err):
        made.append(ArrayBatch(rec, cfg, cfg.models[0], iter(numbered(6)), tmp_path / "batches" / f"{rec['id']}.array",
                               out, err, fake, 2, poll_s=0.01, settle_s=0.0))
        return made[-1]
    runner = BatchRunner(store, FileStore(tmp_path / "files"), url=lambda: "x", secret="s", session=None,
                         table=lambda: None, queued=dict, max_inflight=lambda m: 1,
                         clock=lambda: time.time() + later[0], dedicated=factory)

    async def main():
        task = asyncio.create_task(runner._guarded(store.load(rec["id"])))
        while not (made and made[0].st["job"]):
            await asyncio.sleep(0.01)
        for i in range(2):
            answer_shard(made[0].work, i)
            fake.set(f"100_{i}", "COMPLETED")
        await asyncio.wait_for(task, 30)
    asyncio.run(main())
    done = store.load(rec["id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}, done


def test_a_cancel_while_slurm_does_not_answer_waits_for_it_before_the_merge_and_cancels_the_tasks():
    """slurmctld restarting or failing over for over two minutes (squeue and scancel fail) as a batch is cancelled:
    the executor merged after two minutes and its folder went, the array never cancelled: its running tasks kept
    their GPUs and the queued ones started once SLURM was back, on shards gone. It waits for SLURM to answer now,
    and cancels them then. Found by a review."""
    class Unreachable(FakeSlurm):
        down = False

        async def list_array_tasks(self, name):
            if self.down:
                raise SlurmError("squeue", "Unable to contact slurm controller", transient=True)
            return await super().list_array_tasks(name)

        async def cancel(self, job_id, signal=None):
            if self.down:
                raise SlurmError("scancel", "Unable to contact slurm controller", transient=True)
            await super().cancel(job_id, signal)

    class LaterLoop(asyncio.SelectorEventLoop):   # (its clock jumps past the two minutes)
        ahead = 0.0

        def time(self):
            return super().time() + self.ahead

    loop, cfg, fake = LaterLoop(), fleet(VLLM_MODEL), Unreachable()

    async def main(work: Path):
        ex = executor(cfg, work, fake, poll_s=0.01)
        run = asyncio.create_task(ex.run())
        await until(lambda: ex.st["job"] is not None, "the array submitted")
        fake.down = True   # (before a look saw its tasks: the last look's showed none)
        await ex.cancel()
        await asyncio.sleep(0.1)
        loop.ahead += 125
        await asyncio.sleep(0.3)
        assert not run.done() and [r for r in fake.rows.values() if r.state == "PENDING"]   # (still waiting)
        fake.down = False   # SLURM answers again: the tasks are cancelled, then the shards done merged
        await asyncio.wait_for(run, 5)
        assert not [r for r in fake.rows.values() if r.state in ("PENDING", "RUNNING")]
    try:
        with tempfile.TemporaryDirectory() as d:
            loop.run_until_complete(main(Path(d) / "w"))
    finally:
        loop.close()
