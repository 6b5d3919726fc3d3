"""The fleet config: typed, validated, with errors that name file, line and field.

The schema; files are read by :mod:`orchestrator.fleetfile` (``load_config``).  The gateway's part
(:class:`GatewayConfig`, its keys :class:`KeyPolicy`, the base :class:`Strict`) lives in :mod:`orchestrator.keys`,
a model's ``autoscale`` (:class:`AutoscaleConfig`) in :mod:`orchestrator.autoscaleconf`, the daemon's own settings
(:class:`DaemonConfig`, :class:`BatchesConfig`) in :mod:`orchestrator.daemonconf`; all are re-exported here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, field_validator, model_validator

from .gateway.balancer import DEFAULT_POLICY, POLICIES
from . import jobshape
from .autoscaleconf import AutoscaleConfig  # noqa: F401 - re-exported: the whole schema is here
from .daemonconf import BatchesConfig, DaemonConfig  # noqa: F401 - re-exported: the whole schema is here
from .configchecks import (FieldError, FieldErrors, Operand, VllmArg, env_problems, int_arg, lora_problem,
                           managed_flag_problem, multinode_backend_problem, multinode_dp_problem, name_clash,
                           parallel_world, port_clash_problem, signal_lead_problem)
from .keys import GatewayConfig, Host, KeyPolicy, Secret, Strict  # noqa: F401 - re-exported: the whole schema is here
from .modelgateway import ModelGateway
from .sbatchopts import SLURM_WORD_RE, sbatch_option_problems
from .timefmt import parse_memory, parse_time_limit

MAX_REPLICAS = 1000   # a model's replica count, in the file or pinned by `slurmfleet scale`
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


def _secs(v: Any) -> Any:
    return parse_time_limit(v) if v is not None else None


TimeLimit = Annotated[int | None, BeforeValidator(_secs)]
Memory = Annotated[str, BeforeValidator(parse_memory)]
SlurmWord = Annotated[str, Field(pattern=SLURM_WORD_RE)]
Constraint = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.,:&|*\[\]()!-]+$")]   # sbatch --constraint's syntax


class ClusterConfig(Strict):
    """Where and how jobs are submitted."""

    partition: SlurmWord | None = None
    account: SlurmWord | None = None
    qos: SlurmWord | None = None
    reservation: SlurmWord | None = None
    constraint: Constraint | None = None
    sbatch_options: dict[str, str | int | bool] = Field(default_factory=dict)
    """Extra ``#SBATCH --key=value`` lines; ``true`` renders a bare flag."""
    slurm_conf: str | None = None
    """SLURM_CONF passed to every SLURM command (None: inherit the environment)."""
    requeue: bool = False
    """Let SLURM requeue a job whose node fails (the daemon handles both ways)."""
    command_timeout_s: float = Field(30.0, gt=0)

    @field_validator("sbatch_options")
    @classmethod
    def _check_opts(cls, v: dict[str, Any]) -> dict[str, Any]:
        if problems := sbatch_option_problems(v):   # (each at its own key, all at once)
            raise FieldErrors(problems)
        return v


class ContainerConfig(Strict):
    """Apptainer settings; ``enabled: false`` runs the engine on the host."""

    enabled: bool = True
    image: Operand | None = None
    binds: list[Operand] = Field(default_factory=list)
    nv: bool = True
    apptainer: Operand = "apptainer"   # (the command: an option would be read as its first word)
    extra_args: list[str] = Field(default_factory=list)


class ProbeConfig(Strict):
    """How replicas are probed."""

    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(3.0, gt=0)
    failure_threshold: int = Field(3, ge=1)
    startup_timeout_s: float = Field(900.0, gt=0)
    """A job running this long without passing a probe is replaced."""
    deep_interval_s: float | None = Field(None, gt=0)
    """Interval of a 1-token completion probe (default: 30 s for multi-node models, off otherwise)."""
    deep_timeout_s: float = Field(10.0, gt=0)
    """How long the 1-token completion of a deep probe may take."""


class DrainConfig(Strict):
    """Handover and draining."""

    timeout_s: float = Field(60.0, ge=0)
    """Wait this long for in-flight requests of a draining replica, then cancel it."""
    handover_lead_s: float = Field(600.0, ge=0)
    """Submit a successor this long before a replica's time limit."""
    signal_lead_s: int = Field(120, ge=0, le=65535)
    """SLURM sends USR1 to the job this long before its time limit (``--signal=B:USR1@N``)."""
    stagger_s: float = Field(0.0, ge=0)
    """Shorten each slot's time limit by slot x stagger_s (wrapping within half the limit) so replicas do not expire together."""


class BackoffConfig(Strict):
    """Crash-loop back-off and bad-node exclusion."""

    base_s: float = Field(10.0, gt=0)
    max_s: float = Field(600.0, gt=0)
    early_failure_s: float = Field(300.0, ge=0)
    """A replica that fails or turns unhealthy before it is READY, or within this long of being READY, is a crash."""
    node_failure_threshold: int = Field(2, ge=1)
    node_exclude_s: float = Field(1800.0, ge=0)


class SimulatorConfig(Strict):
    """Knobs of the built-in vLLM simulator (``engine: simulator``)."""

    ttft_s: float = Field(0.05, ge=0)
    tokens_per_s: float = Field(200.0, gt=0)
    max_num_seqs: int = Field(16, ge=1)
    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV-cache block (vLLM's ``--block-size``)."""
    num_gpu_blocks: int = Field(4096, ge=1)
    """KV-cache capacity in blocks (vLLM's ``--num-gpu-blocks-override``); cached prefixes beyond it are
    evicted least recently used first."""
    prefill_s_per_token: float = Field(0.0, ge=0)
    """Prefill cost of each prompt token not found in the prefix cache (seconds; one prefill at a time per
    replica, so a miss delays the others' first tokens too). 0: prefill is free."""
    fail_after_s: float | None = Field(None, gt=0)
    extra_args: list[str] = Field(default_factory=list)


class GpuMetricsConfig(Strict):
    """The NVML exporter the job starts on every node (it reports nothing where there is no GPU)."""

    enabled: bool = True
    interval_s: float = Field(5.0, gt=0)
    container_path: Operand = "/opt/slurmfleet/gpu_exporter.py"
    """Where the exporter lies inside the image (see containers/)."""


class ResumeConfig(Strict):
    """Continuing a generation on another replica when its replica fails or drains mid-generation
    (``/v1/completions`` and ``/v1/chat/completions``; see :mod:`orchestrator.gateway.resume` for which
    requests can be continued exactly)."""

    enabled: bool = True
    max_migrations: int = Field(3, ge=0, le=20)
    """Moves per request at most; after that a break ends the stream with an error event."""
    drain_grace_s: float = Field(30.0, ge=0)
    """A draining replica's generations move to another replica after this long (seconds)."""
    replica_wait_s: float = Field(5.0, ge=0)
    """How long a broken generation waits for another replica with room before it ends (seconds)."""
    unstreamed: bool = True
    """Stream non-streamed requests from the replica too (the client still gets one JSON body), so that
    they can be continued."""


def _known_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; one of: {', '.join(sorted(POLICIES))}")
    return name


RoutingPolicy = Annotated[str, AfterValidator(_known_policy)]


# vllm_args that change the engine's prompt tokens, unlike kv_aware's tokenizer (with the values that change nothing)
KV_UNFOLLOWED_ARGS = (("chat-template-content-format", ("auto",)), ("default-chat-template-kwargs", ()),
                      ("tokenizer-mode", ("auto", "hf")), ("exclude-tools-when-tool-choice-none", (False,)))


class ModelConfig(Strict):
    """One served model: a set of identical replicas, each one SLURM job."""

    name: Annotated[str, Field(pattern=NAME_RE)]
    """Served model name (what clients put in ``model``)."""
    aliases: list[Annotated[str, Field(pattern=NAME_RE)]] = Field(default_factory=list)
    engine: Literal["vllm", "simulator"] = "vllm"
    model_path: Operand | None = None
    tokenizer_path: str | None = None
    """Where the gateway reads the model's tokenizer (``tokenizer.json``, ``tokenizer_config.json``) for
    ``routing: kv_aware``, on the daemon's host (default: ``vllm_args`` ``tokenizer`` when set, else ``model_path``)."""
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS)
    """A fixed replica count (exclusive with ``autoscale``)."""
    autoscale: AutoscaleConfig | None = None
    """Follow the load instead of a fixed count (see :class:`AutoscaleConfig`)."""
    nodes: int = Field(1, ge=1, le=64)
    gpus_per_node: int = Field(1, ge=0, le=64)
    cpus_per_task: int = Field(8, ge=1, le=65536)
    memory: Memory | None = None
    tensor_parallel_size: int = Field(1, ge=1, le=4096)
    pipeline_parallel_size: int = Field(1, ge=1, le=4096)
    time_limit: TimeLimit = Field(4 * 3600, validate_default=False)
    partition: SlurmWord | None = None
    account: SlurmWord | None = None
    qos: SlurmWord | None = None
    gpu_type: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")] | None = None
    """The GPUs' type in the job's gres (``--gres=gpu:TYPE:N``, as the site's gres.conf names it: ``a100``, ``h100``);
    None: any type."""
    reservation: SlurmWord | None = None
    constraint: Constraint | None = None
    """Node features the job needs (``--constraint``: ``h100``, ``h100&ib``); with ``reservation``, replaces
    ``cluster``'s for this model."""
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = Field(default_factory=dict)
    vllm_args: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")], VllmArg] = Field(default_factory=dict)
    """Extra ``vllm serve`` flags; ``true`` renders ``--flag``, ``false`` is omitted, a list repeats."""
    lora_adapters: dict[Annotated[str, Field(pattern=NAME_RE)], Operand] = Field(default_factory=dict)
    """LoRA adapters on the model's replicas, NAME: PATH as the engine sees it (``--enable-lora --lora-modules
    NAME=PATH``): a request naming one goes to this model's replicas as it came, and the engine applies it."""
    bind_host: Host = "0.0.0.0"   # (an address or a host name)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    backoff: BackoffConfig = Field(default_factory=BackoffConfig)
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)
    gpu_metrics: GpuMetricsConfig = Field(default_factory=GpuMetricsConfig)
    routing: RoutingPolicy = DEFAULT_POLICY
    """How the gateway picks a replica (a policy of ``orchestrator.gateway.balancer.POLICIES``)."""
    resume: ResumeConfig = Field(default_factory=ResumeConfig)
    """Continuing broken generations on another replica."""
    max_inflight_per_replica: int = Field(64, ge=1, le=1_000_000)
    gateway: ModelGateway = Field(default_factory=ModelGateway)   # (timeouts and queue over the gateway's)
    max_surge: int = Field(1, ge=1, le=MAX_REPLICAS)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """The engine's queue order: ``priority`` starts vLLM with ``--scheduling-policy priority`` and the gateway
    sends each request's priority class index (``gateway.priority_classes``) as vLLM's ``priority``."""

    @field_validator("vllm_args")
    @classmethod
    def _managed_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        if problem := managed_flag_problem(v):   # (said at the first such flag's line, naming what sets it)
            raise FieldError(*problem)
        return v   # (a carriage return or NUL in any value: fleetfile._value_problems, at the value)

    @field_validator("env")
    @classmethod
    def _own_env(cls, v: dict[str, str]) -> dict[str, str]:
        if problems := env_problems(v):   # (each at its own name, all at once)
            raise FieldErrors(problems)
        return v

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.autoscale is not None and "replicas" in self.model_fields_set:
            raise FieldError("autoscale", "replicas and autoscale exclude each other: a fixed count, or "
                             "autoscale.min_replicas/max_replicas")
        if self.gpu_type and not self.gpus_per_node:
            raise FieldError(("gpu_type", "gpus_per_node"), "gpu_type needs gpus_per_node of 1 or more (a job "
                             "without GPUs has no GPU type): set gpus_per_node, or remove gpu_type")
        world, counted = parallel_world(self.tensor_parallel_size, self.pipeline_parallel_size, self.vllm_args)
        if self.engine == "vllm":
            if self.gpus_per_node > 0 and world != self.nodes * self.gpus_per_node:
                raise FieldError(
                    ("tensor_parallel_size", "pipeline_parallel_size", "gpus_per_node", "nodes"),
                    f"{counted} = {world} GPUs must equal nodes x gpus_per_node = "
                    f"{self.nodes} x {self.gpus_per_node} = {self.nodes * self.gpus_per_node}")
            if world % self.nodes:
                raise FieldError(("tensor_parallel_size", "pipeline_parallel_size", "nodes"),
                                 f"{counted} = {world} GPUs must divide over {self.nodes} nodes")
            if why := multinode_dp_problem(self.nodes, self.vllm_args):
                raise FieldError((("vllm_args", "data-parallel-backend"),), why)
            if not self.model_path:
                raise FieldError(("model_path", "engine"), "model_path is required for engine vllm")
        if self.engine == "simulator" and self.container.enabled:   # (the host's python, which no image has)
            raise FieldError(("container.enabled", "container", "engine"), "engine simulator runs the daemon's own "
                             "Python on the node, not in an image: set container: {enabled: false} (or leave "
                             "container out: a simulator model has none)")
        if self.container.enabled and not self.container.image:
            raise FieldError(("container.image", "container.enabled", "container"),
                             "container.image is required when container.enabled is true")
        if why := signal_lead_problem(self.time_limit, self.drain.signal_lead_s, self.drain.stagger_s):
            raise FieldError(("drain.signal_lead_s", "drain.stagger_s", "time_limit"), why)
        if why := multinode_backend_problem(self.nodes, self.vllm_args):
            raise FieldError(tuple(("vllm_args", k) for k in self.vllm_args
                                   if "distributed-executor-backend".startswith(k) and len(k) > 12), why)
        if why := lora_problem(self.routing, self.vllm_args, self.lora_adapters):
            raise FieldError(*why)
        if self.routing == "kv_aware":
            unfollowed = [k for k, fine in KV_UNFOLLOWED_ARGS if k in self.vllm_args and self.vllm_args[k] not in fine]
            if unfollowed:
                raise FieldError(tuple(("vllm_args", k) for k in unfollowed), f"vllm_args {', '.join(unfollowed)} change how the engine tokenizes prompts, which "
                                 "routing kv_aware cannot follow (its cache lookups would never match): remove "
                                 "them, or route otherwise")
            if (dp := int_arg(self.vllm_args.get("data-parallel-size"))) is not None and dp > 1:
                raise FieldError((("vllm_args", "data-parallel-size"),), f"vllm_args data-parallel-size {dp} with "
                                 "routing kv_aware: each rank keeps a cache of its own, whose events vLLM publishes "
                                 "only on tcp endpoints (its ranks past 0 fail to start on the job's ipc ones): "
                                 "run more replicas instead, or route otherwise")
        return self

    @property
    def served_names(self) -> list[str]:
        return [self.name, *self.aliases]

    @property
    def deep_probe_interval_s(self) -> float | None:
        if self.probe.deep_interval_s is not None:
            return self.probe.deep_interval_s
        return 30.0 if self.nodes > 1 else None

    @property
    def engine_slots(self) -> int | None:
        """One replica's engine slots (vLLM's ``max_num_seqs``) when the config sets them: the simulator's, or
        ``max-num-seqs`` in ``vllm_args``; None when vLLM picks its own."""
        if self.engine == "simulator":
            return self.simulator.max_num_seqs
        return int_arg(self.vllm_args.get("max-num-seqs"))

    @property
    def kv_events(self) -> bool:
        """Whether the job publishes its engine's KV-cache events (``routing: kv_aware`` reads them)."""
        return self.routing == "kv_aware"

    @property
    def count_label(self) -> str:
        """Its replica count as a reload reports it: ``2``, or ``autoscaled 0-4``."""
        a = self.autoscale
        return str(self.replicas) if a is None else f"autoscaled {a.min_replicas}-{a.max_replicas}"

    _site: str = PrivateAttr("")
    """The hash of the ``cluster`` settings this model's jobs inherit (set by :class:`FleetConfig`)."""

    def job_hash(self, legacy: bool = False) -> str:
        """Hash of everything that shapes the job, the cluster settings it inherits included; a change rolls
        the replicas: ``MODEL+SITE`` (:mod:`orchestrator.jobshape`; ``legacy``: its form before 2026-12-03)."""
        h = jobshape.model_part(self.model_dump(), kv_events=self.kv_events, legacy=legacy)
        return f"{h}+{self._site}" if self._site else h

    def engine_hash(self) -> str:
        """What its replicas' generations follow from (:func:`orchestrator.jobshape.engine_part`)."""
        return jobshape.engine_part(self.model_dump())

    def adopted_hash(self, tagged: str) -> str:
        """The hash a running job tagged ``tagged`` counts with (:func:`orchestrator.jobshape.adopted`): a tag
        of an earlier release whose settings are current counts as current, so a daemon upgrade rolls nothing."""
        return jobshape.adopted(self.job_hash(), self.job_hash(legacy=True), tagged)


class FleetConfig(Strict):
    """The whole fleet."""

    fleet: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]{0,31}$")]
    state_dir: Annotated[str, Field(pattern=r"^/[^\s'\"\\$`;|&<>%:,#/][^\s'\"\\$`;|&<>%:,#]*$")]
    """Shared file system path: records, job logs (no ``%``: sbatch expands it in ``--output``, no ``#``: a comment;
    not ``/``: the daemon makes it private)."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    batches: BatchesConfig = Field(default_factory=BatchesConfig)
    defaults: dict[str, Any] = Field(default_factory=dict)
    models: list[ModelConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> "FleetConfig":
        if clash := name_clash(self.models):
            raise FieldError((clash[0],), clash[1])
        if p := port_clash_problem(self.gateway.host, self.gateway.port, self.daemon.admin_host, self.daemon.admin_port):
            raise FieldError((("daemon", "admin_port"), ("gateway", "port")), p)
        if self.daemon.admin_tls and self.gateway.tls is None:
            raise FieldError((("daemon", "admin_tls"),), "daemon.admin_tls serves gateway.tls's certificate: set gateway.tls")
        return self

    @model_validator(mode="after")
    def _inherit(self) -> "FleetConfig":
        """Each model's jobs take the ``cluster`` settings it does not set itself: a change of those rolls its
        replicas as a change of its own does (:meth:`ModelConfig.job_hash`)."""
        c = self.cluster
        self.models[:] = [m.model_copy() for m in self.models]   # (a model given as an object may be another fleet's)
        for i, m in enumerate(self.models):
            if m.memory and (mem := {"mem-per-cpu", "mem-per-gpu"} & c.sbatch_options.keys()):
                raise FieldError((("models", i, "memory"),), f"memory (--mem) and cluster.sbatch_options "
                                 f"{min(mem)} exclude each other in sbatch: set one of them")
            site = {"partition": None if m.partition else c.partition, "account": None if m.account else c.account,
                    "qos": None if m.qos else c.qos, "reservation": None if m.reservation else c.reservation,
                    "constraint": None if m.constraint else c.constraint,
                    "requeue": c.requeue or None, "sbatch_options": c.sbatch_options or None}
            m._site = jobshape.site_part(site)
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def job_name(self) -> str:
        """Every job of this fleet has this SLURM job name: one squeue filter finds them all."""
        return f"slurmfleet-{self.fleet}"
