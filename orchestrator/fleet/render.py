"""Render sbatch scripts from the Jinja2 templates in ``sbatch/``.

Every value that came from the YAML passes through the ``q`` filter
(``shlex.quote``), so it reaches the engine as one literal argument.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

import jinja2

from .. import resources
from ..config import FleetConfig, ModelConfig
from ..jobshape import SERVE_ONLY
from ..statedir import StateDir
from ..timefmt import format_time_limit

TAG_PREFIX = "slurmfleet:v1"
# the middleware vLLM loads from the job's folder (--middleware): every path asks for the job's secret
ENGINE_AUTH_SOURCE = (Path(__file__).parent / "engine_auth.py").read_text().rstrip("\n")
# the relay a kv_aware job runs in front of its engine's KV-cache events (the job's secret opens them)
KV_RELAY_SOURCE = (Path(__file__).parent.parent / "kvrelay.py").read_text().rstrip("\n")
# a multi-node replica's head's alone: its HTTP server's, which vLLM refuses with --headless (the other ranks') too
HEAD_ONLY = SERVE_ONLY


def state_tag(state_dir: str | Path) -> str:
    """A short digest of the state dir's path, its spelling normalized (``/srv/f/`` and ``/srv//f`` are
    ``/srv/f``: respelling it in the config must not orphan the running jobs)."""
    return hashlib.blake2b(os.path.normpath(str(state_dir)).encode(), digest_size=4).hexdigest()


@dataclasses.dataclass(frozen=True)
class JobTag:
    """What a job's SLURM comment says about it, so a restarted daemon can adopt it."""

    fleet: str
    model: str
    slot: int
    config_hash: str
    nonce: str
    state: str = ""   # state_tag() of the fleet's state dir ("": a job tagged before there was one)
    engine: str = ""  # its model's engine_hash() ("": a job tagged before there was one)

    def encode(self) -> str:
        return (f"{TAG_PREFIX};fleet={self.fleet};model={self.model};slot={self.slot};"
                f"hash={self.config_hash};nonce={self.nonce}" + (f";sd={self.state}" if self.state else "")
                + (f";eng={self.engine}" if self.engine else ""))

    def owned_by(self, fleet: str, state_dir: str | Path) -> bool:
        """Whether this job belongs to the fleet ``fleet`` kept in ``state_dir``: a copy of the config with the
        same fleet name and another state dir (a staging daemon) must neither adopt nor cancel its jobs.  A tag
        without a state dir (an older release's) belongs to the fleet of its name."""
        return self.fleet == fleet and (not self.state or self.state == state_tag(state_dir))

    @classmethod
    def decode(cls, comment: str) -> "JobTag | None":
        parts = comment.strip().split(";")
        if not parts or parts[0] != TAG_PREFIX:
            return None
        kv = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        try:
            return cls(kv["fleet"], kv["model"], int(kv["slot"]), kv["hash"], kv.get("nonce", ""), kv.get("sd", ""),
                       kv.get("eng", ""))
        except (KeyError, ValueError):
            return None


def engine_argv(model: ModelConfig, python: str | None = None) -> list[str]:
    """The engine command line, without host/port and the multi-node flags."""
    # vLLM's default is fcfs; priority orders its waiting queue by each request's `priority` (lower first)
    policy = ["--scheduling-policy", "priority"] if model.scheduling_policy == "priority" else []
    if model.engine == "simulator":
        sim = model.simulator
        argv = [python or sys.executable, "-m", "orchestrator.devtools.simulator"]
        if model.model_path:   # as vllm serve's: the simulator takes its tokenizer from there
            argv.append(str(model.model_path))
        argv += ["--served-model-name", model.name, "--ttft-s", str(sim.ttft_s), "--tokens-per-s", str(sim.tokens_per_s),
                 "--max-num-seqs", str(sim.max_num_seqs), "--block-size", str(sim.block_size),
                 "--num-gpu-blocks-override", str(sim.num_gpu_blocks)]
        if sim.prefill_s_per_token:
            argv += ["--prefill-s-per-token", str(sim.prefill_s_per_token)]
        if sim.fail_after_s is not None:
            argv += ["--exit-after-s", str(sim.fail_after_s)]
        return argv + policy + _lora(model, True) + list(sim.extra_args)
    argv = ["vllm", "serve", str(model.model_path), "--served-model-name", model.name,
            "--tensor-parallel-size", str(model.tensor_parallel_size),
            "--pipeline-parallel-size", str(model.pipeline_parallel_size), *policy, *_lora(model, model.nodes == 1)]
    return argv + _flags(model, lambda key: model.nodes > 1 and key in HEAD_ONLY)


def _placement(model: ModelConfig, cluster) -> dict:
    """Where a model's jobs go: its own partition, account, qos, reservation and constraint, else the cluster's."""
    return {k: getattr(model, k) or getattr(cluster, k) for k in ("partition", "account", "qos", "reservation",
                                                                   "constraint")}


def _lora(model: ModelConfig, modules: bool) -> list[str]:
    """``--enable-lora`` (an engine setting: every rank's) and, with ``modules``, the adapters (``--lora-modules``,
    the HTTP server's: a multi-node replica's head alone), for a model with ``lora_adapters``."""
    if not model.lora_adapters:
        return []
    # (vLLM reads an item holding a , as JSON: NAME=PATH with one failed every start)
    pairs = [json.dumps({"name": name, "path": path}) if "," in path else f"{name}={path}"
             for name, path in model.lora_adapters.items()]
    return ["--enable-lora", *(["--lora-modules", *pairs] if modules else [])]


def head_argv(model: ModelConfig) -> list[str]:
    """A multi-node replica's ``vllm_args`` for its head alone (rank 0): the HTTP server's, and
    ``api-server-count``, which vLLM refuses on the headless ranks (every start failed)."""
    if model.nodes == 1 or model.engine != "vllm":
        return []
    return _lora(model, True)[1:] + _flags(model, lambda key: key not in HEAD_ONLY)


def _flags(model: ModelConfig, skip) -> list[str]:
    """``vllm_args`` as flags (true: the flag alone, false: none, a list: the flag repeated), less ``skip``'s."""
    argv = []
    for key, value in model.vllm_args.items():
        if skip(key):
            continue
        for v in value if isinstance(value, list) else [value]:
            if v is True:
                argv.append(f"--{key}")
            elif v is not False:
                argv += [f"--{key}", str(v)]
    return argv


def run_batch_argv(model: ModelConfig, python: str | None = None) -> list[str]:
    """The task's engine command line, without ``-i``/``-o``: ``vllm run-batch`` with the model's arguments
    (every served name, so lines may name an alias), or the simulator's stand-in."""
    if model.engine == "simulator":
        sim = model.simulator
        argv = [python or sys.executable, "-m", "orchestrator.devtools.simbatch"]
        argv += [str(model.model_path)] if model.model_path else []
        return argv + ["--served-model-name", *model.served_names, "--ttft-s", str(sim.ttft_s), "--tokens-per-s",
                       str(sim.tokens_per_s), "--max-num-seqs", str(sim.max_num_seqs), *_lora(model, True),
                       *sim.extra_args]
    argv = ["vllm", "run-batch", "--model", str(model.model_path), "--served-model-name", *model.served_names,
            "--tensor-parallel-size", str(model.tensor_parallel_size),
            "--pipeline-parallel-size", str(model.pipeline_parallel_size), *_lora(model, True)]
    return argv + _flags(model, lambda key: key in SERVE_ONLY)


class Renderer:
    """Turns (fleet, model, slot) into a job script."""

    def __init__(self, templates_dir: Path | None = None, python: str | None = None):
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(templates_dir or resources.templates_dir())),
            undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
        )
        self.env.filters["q"] = lambda v: shlex.quote(str(v))
        self.python = python

    def time_limit_s(self, model: ModelConfig, slot: int) -> int | None:
        """The slot's time limit: shortened by ``slot x stagger_s`` so replicas do not all expire together,
        wrapping within half the limit (a high slot never gets a limit its handover lead would eat whole)."""
        if model.time_limit is None:
            return None
        return max(60, int(model.time_limit - (slot * model.drain.stagger_s) % (model.time_limit / 2)))

    def _common(self, model: ModelConfig) -> dict:
        return {"engine_auth": ENGINE_AUTH_SOURCE if model.engine == "vllm" else "",
                "simulator": model.engine == "simulator",   # it takes the flag as vLLM does: every path asks the secret
                "nodes": model.nodes, "model_name": model.name, "engine_argv": engine_argv(model, self.python),
                "head_argv": head_argv(model),
                "bind_host": model.bind_host, "container": model.container, "env": model.env,
                "gpu_parts": self._gpu_parts(model), "gpu_interval_s": model.gpu_metrics.interval_s,
                "kv_events": model.kv_events, "kv_relay": KV_RELAY_SOURCE if model.kv_events else "",
                # the relay's interpreter: the image's python3 (vLLM's, with pyzmq), or the daemon's
                "relay_python": "python3" if model.container.enabled else (self.python or sys.executable)}

    def _gpu_parts(self, model: ModelConfig) -> tuple[list[str], list[str]]:
        """How the job starts the NVML exporter on each node (([], []) when off or the job has no GPU): (the
        container runtime's part, the command's part) of its argv; the node script puts
        ``--bind "$SF_GPU_READINGS"`` between them (the exporter writes there: a state dir outside the image's
        default binds, such as /srv, was not writable from the container, and no GPU reading ever came)."""
        if not model.gpu_metrics.enabled or model.gpus_per_node == 0:
            return [], []
        c = model.container
        if c.enabled:
            argv = [c.apptainer, "exec"] + (["--nv"] if c.nv else [])
            for b in c.binds:
                argv += ["--bind", b]
            return argv + list(c.extra_args), [str(c.image), "python3", model.gpu_metrics.container_path]
        return [], [self.python or sys.executable, "-m", "orchestrator.observability.gpu_exporter"]

    def node_script(self, model: ModelConfig) -> str:
        """The per-node part: the batch script writes it to ``<state_dir>/jobs/<jobid>.<restart>.node.sh`` and runs it
        (``bash FILE``) on every node of the job, so its size is not bound by the environment's limits."""
        return self.env.get_template("node.sh.j2").render(**self._common(model)).rstrip("\n")

    def render(self, fleet: FleetConfig, model: ModelConfig, slot: int = 0, nonce: str = "0",
               exclude: tuple[str, ...] = ()) -> str:
        cluster = fleet.cluster
        tag = JobTag(fleet.fleet, model.name, slot, model.job_hash(), nonce, state_tag(fleet.state_dir),
                     model.engine_hash())
        state = StateDir(fleet.state_dir)
        job = {
            "name": fleet.job_name,
            "comment": tag.encode(),
            "slot": slot,
            "log_path": state.log_pattern(model.name),
            "cpus_per_task": model.cpus_per_task,
            "gpus_per_node": model.gpus_per_node,
            "gpu_type": model.gpu_type,
            "memory": model.memory,
            "time": format_time_limit(self.time_limit_s(model, slot)),
            "signal_lead_s": model.drain.signal_lead_s,
            **_placement(model, cluster),
            "exclude": ",".join(exclude),
            "requeue": cluster.requeue,
            "extra": cluster.sbatch_options,
        }
        common = self._common(model)
        node_script = self.node_script(model)
        delimiter = "SF_NODE_EOF_" + hashlib.sha256(node_script.encode()).hexdigest()[:16]
        return self.env.get_template("replica.sh.j2").render(
            **common, job=job, paths=state.template_paths(), node_script=node_script, delimiter=delimiter)

    def array_script(self, fleet: FleetConfig, model: ModelConfig, batch_id: str, job_name: str, work: Path,
                     array: str) -> str:
        """A dedicated batch's job array script (``sbatch/batch-array.sh.j2``) for the tasks ``array``
        (``0-3%2``; a retry: ``2``): each task runs ``vllm run-batch`` on its shard, as the model is started."""
        c = fleet.cluster
        job = {"name": job_name, "comment": f"slurmfleet-batch:v1;fleet={fleet.fleet};batch={batch_id}",
               "log_path": f"{work}/logs/shard-%a.%A.log", "array": array, "cpus_per_task": model.cpus_per_task,
               "gpus_per_node": model.gpus_per_node, "gpu_type": model.gpu_type, "memory": model.memory,
               "time": format_time_limit(model.time_limit), **_placement(model, c), "extra": c.sbatch_options}
        return self.env.get_template("batch-array.sh.j2").render(
            job=job, work=str(work), engine_argv=run_batch_argv(model, self.python), container=model.container,
            env=model.env, batch_id=batch_id, model_name=model.name)
