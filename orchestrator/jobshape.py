"""What of a model's config reaches its job: the hash each job is tagged with (a change rolls the replicas).

A job is tagged ``MODEL+SITE``: ``MODEL`` hashes the model's own settings that the job script or the engine
reads, ``SITE`` the ``cluster`` settings its jobs inherit. Settings only the daemon or the gateway reads (the
replica count, routing but ``kv_aware``, probes, back-off, a drain's wait and handover lead) are left out, and
so are settings the job has no use for (``simulator`` on vLLM, ``vllm_args`` on the simulator, the GPU
exporter's where it does not run, the image of a job without the container): changing one rolls nothing.

Tags written by earlier releases still count as current while their part is (:func:`adopted`): a daemon
upgrade rolls nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

NOT_THE_JOBS = {"replicas", "autoscale", "resume", "aliases", "routing", "max_inflight_per_replica", "max_surge",
                "probe", "backoff", "tokenizer_path", "gateway"}
"""Model settings only the daemon and the gateway read (``routing`` reaches the job only as ``kv_events``)."""


UNSET_UNHASHED = {"gpu_type", "reservation", "constraint", "lora_adapters"}
"""Settings added since jobs were first tagged: unset, they are not hashed (a daemon upgrade rolls nothing)."""


def _digest(value: Any, n: int) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:n]


def model_part(dump: dict[str, Any], *, kv_events: bool, legacy: bool = False) -> str:
    """The model part of the hash, from ``model_dump()``. ``legacy``: the form of releases before 2026-12-03,
    which also hashed the settings the job does not read (their tags are adopted, :func:`adopted`)."""
    fields = {k: v for k, v in dump.items() if k not in NOT_THE_JOBS and not (k in UNSET_UNHASHED and not v)}
    if kv_events:
        fields["kv_events"] = True
    if legacy:
        return _digest(fields, 12)
    fields["drain"] = {k: v for k, v in fields["drain"].items() if k not in ("timeout_s", "handover_lead_s")}
    fields.pop("vllm_args" if fields["engine"] == "simulator" else "simulator")
    gpu = fields["gpu_metrics"]
    if not gpu["enabled"] or not fields["gpus_per_node"]:
        fields["gpu_metrics"] = None
    elif not fields["container"]["enabled"]:
        gpu.pop("container_path")
    if not fields["container"]["enabled"]:
        fields["container"] = None
    return _digest(fields, 12)


# vllm serve's flags that vllm run-batch refuses, having no server (vLLM 0.32: the options of launchers/cli_args.py's
# make_arg_parser that launchers/run_batch.py's lacks, less the ones slurmfleet sets itself: host, port, headless)
SERVE_ONLY = frozenset({
    "api-server-count", "grpc", "no-allow-credentials", "no-disable-fastapi-docs", "no-disable-uvicorn-access-log",
    "no-enable-flash-late-interaction", "no-enable-offline-docs", "no-enable-request-id-headers",
    "no-enable-ssl-refresh", "grpc-port", "data-parallel-supervisor-port", "dp-supervisor-probe-interval-s", "dp-supervisor-probe-timeout-s",
    "dp-supervisor-probe-failure-threshold", "uds", "uvicorn-log-level", "disable-uvicorn-access-log",
    "disable-access-log-for-endpoints", "allow-credentials", "allowed-origins", "allowed-methods",
    "allowed-headers", "api-key", "ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "enable-ssl-refresh",
    "ssl-cert-reqs", "ssl-ciphers", "root-path", "middleware", "enable-request-id-headers", "disable-fastapi-docs",
    "h11-max-incomplete-event-size", "h11-max-header-count", "enable-offline-docs", "enable-flash-late-interaction"})
SCHEDULING_ONLY = SERVE_ONLY | {
    "max-num-seqs", "max-num-batched-tokens", "gpu-memory-utilization", "scheduling-policy", "enable-prefix-caching",
    "no-enable-prefix-caching", "block-size", "num-gpu-blocks-override", "swap-space", "enforce-eager",
    "enable-chunked-prefill", "long-prefill-token-threshold", "max-num-partial-prefills", "kv-events-config",
    "api-server-count", "disable-log-requests", "enable-log-requests", "disable-log-stats", "max-log-len",
    "enable-force-include-usage", "ttft_s", "tokens_per_s", "max_num_seqs", "block_size", "num_gpu_blocks",
    "prefill_s_per_token", "fail_after_s"}
"""Engine settings (vLLM's arguments, the simulator's) that change when, how fast or how a replica answers, not
which tokens (``stream-interval`` is not one: a generation cut after an event of several tokens cannot go on)."""


def engine_part(dump: dict[str, Any]) -> str:
    """What a replica's token ids mean and which follow, from ``model_dump()``: the engine, its weights and
    tokenizer (``model_path``, and the container's binds, which may put other files behind it), its LoRA adapters,
    and its arguments but :data:`SCHEDULING_ONLY`.  A generation continued elsewhere (:mod:`orchestrator.gateway.resume`) moves only
    between replicas with the same: during a roll that changes one, the new replicas would read its token ids as
    other text, or another model would finish it.  The image and ``env`` are left out (a new vLLM release, NCCL
    settings: the same model, the same tokens)."""
    args = dump["simulator"] if dump["engine"] == "simulator" else dump["vllm_args"]
    fields = {"engine": dump["engine"], "model_path": dump["model_path"],
              "binds": dump["container"]["binds"] if dump["container"]["enabled"] else None,
              "args": {k: v for k, v in args.items() if k not in SCHEDULING_ONLY}}
    if dump.get("lora_adapters"):   # (an adapter's path moved: other weights; none: hashed as before adapters)
        fields["lora_adapters"] = dump["lora_adapters"]
    return _digest(fields, 12)


def site_part(site: dict[str, Any]) -> str:
    """The inherited ``cluster`` settings' part (only those set)."""
    return _digest({k: v for k, v in site.items() if v is not None}, 8)


def adopted(now: str, legacy: str, tagged: str) -> str:
    """The hash a running job tagged ``tagged`` counts with, ``now`` the model's current hash and ``legacy``
    its form before 2026-12-03: ``now`` for a tag in the legacy form of the current settings, with its site
    part or from before hashes had one (that form was the model part alone); else the tag itself."""
    if tagged == legacy or ("+" not in tagged and tagged == legacy.split("+")[0]):
        return now
    return tagged
