"""Checks of :mod:`orchestrator.config` kept out of it (its size): values that become words of a job's
command lines."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator


class FieldError(ValueError):
    """A problem a model-wide check finds, told at the field it is about: the first of ``fields`` (each a
    path below the checked object, ``"drain.signal_lead_s"``) the file sets (else the first), not the
    object's first line."""

    def __init__(self, fields: str | tuple, message: str, at_key: bool = False):
        super().__init__(message)
        self.fields = tuple(f if isinstance(f, tuple) else tuple(f.split("."))   # (a tuple: a path with indexes)
                            for f in ((fields,) if isinstance(fields, str) else fields))
        self.at_key = at_key   # (told at the key's position, not its value's: a name that is wrong)
        self.each = [self]


class FieldErrors(FieldError):
    """Several problems one check finds (a mapping's bad keys), each told at its own field."""

    def __init__(self, errors: list[FieldError]):
        super().__init__(errors[0].fields, "; ".join(map(str, errors)), errors[0].at_key)
        self.each = errors


def _not_an_option(value: str) -> str:
    """A value the job passes as an operand (a path, an image, a bind): one with a leading ``-`` would be read
    as an option by the program it reaches (quoting does not help: argparse and apptainer see the word itself),
    one slurmfleet sets itself (``--api-key=...``) included."""
    if value.startswith("-"):
        raise ValueError(f"{value!r} starts with '-', which the engine's or apptainer's command line would read "
                         "as an option (write a path as ./-name)")
    return value


Operand = Annotated[str, AfterValidator(_not_an_option)]
"""A string that reaches a job's command line as an operand, never as an option."""


def _no_option_in_value(value: object) -> object:
    """A ``vllm_args`` value: each string (a list's items too) becomes a word of its own after ``--key``, so one
    with a leading ``-`` is read by vLLM's argparse as an option of its own (after an on/off flag, or in place of
    a value), one slurmfleet sets itself (``--api-key``, ``--served-model-name``) included; argparse takes only a
    negative number (``-1``, ``-0.5``) or a lone ``-`` as a value."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str) and v.startswith("-") and not re.fullmatch(r"-|-[0-9]+|-[0-9]*\.[0-9]+", v):
            raise ValueError(f"{v!r} starts with '-', which vLLM would read as an option of its own, not as this "
                             "flag's value (a negative number such as -1 or -0.5 is fine)")
    return value


VllmArg = Annotated[str | int | float | bool | list[str | int | float], AfterValidator(_no_option_in_value)]
"""A ``vllm_args`` value: ``true`` renders ``--flag``, ``false`` nothing, a list repeats the flag."""


BASH_OWN = {"UID", "EUID", "PPID", "SHELLOPTS", "BASHOPTS", "GROUPS", "FUNCNAME", "DIRSTACK", "BASHPID", "RANDOM",
            "SRANDOM", "SECONDS", "LINENO", "HISTCMD", "EPOCHSECONDS", "EPOCHREALTIME", "SHLVL", "_"}
"""Variables of bash's own (``BASH_*`` too) that a bash script cannot export with a value of its own: read-only
ones (``UID: readonly variable``), ones bash sets itself (``RANDOM``, ``SECONDS``; ``SHLVL`` and ``_`` at exec),
and arrays it never exports (``GROUPS``, ``FUNCNAME``)."""


def env_problems(env: dict) -> list[FieldError]:
    """A model's ``env`` names it may not set, each at its own key (:func:`env_name_problem`)."""
    return [FieldError((name,), why, at_key=True) for name in env if (why := env_name_problem(name))]


def env_name_problem(name: str) -> str | None:
    """Why a model's ``env`` may not set ``name``, or None: the job's own variables, and bash's (the job script,
    a bash script, exports the model's env before it execs the engine)."""
    if name in ("VLLM_API_KEY", "BASH_ENV") or name.startswith(("SF_", "SLURM_", "APPTAINER", "SINGULARITY")):
        return (f"{name} is the job's own (the replica's secret, slurmfleet's, SLURM's or Apptainer's variables): it "
                "cannot be set here")
    if name in BASH_OWN or name.startswith("BASH_"):
        return (f"{name} is one of bash's own variables (read-only, or set by bash itself): the job script, a bash "
                "script, cannot export it, so the engine would get bash's value")
    return None


def handover_cap_s(time_limit_s: float, stagger_s: float) -> float:
    """Half the shortest time limit a model's slot jobs get: the time limit, or with ``drain.stagger_s`` as
    little as half of it (slot limits wrap within half the limit).  No warning or handover may lead by more."""
    return time_limit_s / (4 if stagger_s else 2)


def signal_lead_problem(time_limit_s: int | None, signal_lead_s: int, stagger_s: float) -> str | None:
    """Why SLURM's time-limit warning (USR1 ``signal_lead_s`` before the limit) would come too early, or None.

    A warned replica is handed over at once, so the warning may come no earlier than the planner's own
    handover (:func:`orchestrator.fleet.planner.handover_lead_s`): at most half the shortest limit a slot's
    job gets, which is the time limit, or with ``drain.stagger_s`` as little as half of it (slot limits wrap
    within half the limit: :meth:`orchestrator.fleet.render.Renderer.time_limit_s`).  A lead past that handed
    every replica over as soon as it was ready (one past the limit itself: USR1 at its start), forever."""
    if time_limit_s is None:   # UNLIMITED: no warning comes
        return None
    cap = handover_cap_s(time_limit_s, stagger_s)
    if signal_lead_s < cap:
        return None
    staggered = ", shortened by drain.stagger_s to as little as half of it" if stagger_s else ""
    return (f"drain.signal_lead_s = {signal_lead_s} s must be below {cap:g} s, half the shortest time limit of this "
            f"model's jobs (time_limit = {time_limit_s} s{staggered}): SLURM's USR1 that early would hand every "
            "replica over as soon as it is ready")


def multinode_backend_problem(nodes: int, vllm_args: dict) -> str | None:
    """Why a model's ``distributed-executor-backend`` cannot run on its ``nodes``, or None: the job starts one
    engine per node with vLLM's own multi-node flags (``--nnodes``/``--node-rank``, mp), which vLLM refuses
    with any other backend (the job has no Ray cluster: every start would fail)."""
    backend = [v for k, v in vllm_args.items() if "distributed-executor-backend".startswith(k) and len(k) > 12]
    if nodes > 1 and backend and backend[0] != "mp":
        return (f"vllm_args distributed-executor-backend {backend[0]!r} cannot run on {nodes} nodes: a multi-node "
                "replica runs vLLM's own multi-node mode (--nnodes, --node-rank), which needs 'mp'")
    return None


def parallel_world(tp: int, pp: int, vllm_args: dict) -> tuple[int, str]:
    """The GPUs one replica's engine uses, as vLLM counts its world (tensor x pipeline x prefill-context x data
    parallel sizes), and how it was counted."""
    world, parts = tp * pp, [f"tensor_parallel_size {tp}", f"pipeline_parallel_size {pp}"]
    for flag in ("prefill-context-parallel-size", "data-parallel-size"):
        n = int_arg(vllm_args.get(flag))
        if n is not None and n > 1:
            world, parts = world * n, parts + [f"vllm_args {flag} {n}"]
    return world, " x ".join(parts)


def multinode_dp_problem(nodes: int, vllm_args: dict) -> str | None:
    """Why a model's ``data-parallel-backend`` cannot run on its ``nodes``, or None (vLLM: ``--nnodes`` > 1 needs
    ``mp``)."""
    backend = vllm_args.get("data-parallel-backend")
    if nodes > 1 and backend is not None and backend != "mp":
        return (f"vllm_args data-parallel-backend {backend!r} cannot run on {nodes} nodes: vLLM's multi-node mode "
                "(--nnodes) needs 'mp'")
    return None


def int_arg(value) -> int | None:
    """A ``vllm_args`` value as the whole number it is, or None: ASCII digits only ("²" is a digit to str.isdigit
    that int() refuses: it raised where a config was taken, after validation had passed it)."""
    return int(value) if isinstance(value, (int, str)) and str(value).isascii() and str(value).isdigit() else None


def dial_host(host: str) -> str:
    """Where a client on this host reaches a listener on ``host``, as a URL's host: its loopback for an address
    that takes them all ("", "*", ``0.0.0.0``; ``::`` is IPv6 alone: ``[::1]``), an IPv6 address in brackets."""
    if host in ("", "*", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _families(host: str) -> set[int]:
    """The address families a listener on ``host`` takes its port in: an IPv6 one only IPv6 (asyncio binds
    it IPV6_V6ONLY), an IPv4 one IPv4, a name or "" (every address) both."""
    if host in ("", "*", "localhost"):
        return {4, 6}
    return {6} if ":" in host else {4} if host.replace(".", "").isdigit() else {4, 6}


def port_clash_problem(gateway_host: str, gateway_port: int, admin_host: str, admin_port: int) -> str | None:
    """The admin API and the gateway asked to listen where only one can (the second failed at start, after the
    file had validated): the same port (but 0, any free one) on the same address, or in one family on an
    address of that family that one of them takes whole (``0.0.0.0``, ``::``, ""), or loopback named twice."""
    if gateway_port != admin_port or not gateway_port:
        return None
    a, b = gateway_host, admin_host
    wild = {"", "*", "0.0.0.0", "::"}
    loop = {"127.0.0.1", "localhost"}
    if a == b or ((a in wild or b in wild) and _families(a) & _families(b)) or {a, b} <= loop:
        return (f"daemon.admin_port {admin_port} is gateway.port too (hosts {admin_host!r} and {gateway_host!r}): "
                "the admin API and the gateway cannot listen on one port")
    return None


def name_clash(models) -> tuple[tuple, str] | None:
    """The first name a model serves (its name, an alias, a LoRA adapter) that an earlier one serves too: (the
    field's path, why), or None."""
    seen: dict[str, str] = {}
    for i, m in enumerate(models):
        paths = [("models", i, "name"), *(("models", i, "aliases", j) for j in range(len(m.aliases))),
                 *(("models", i, "lora_adapters", a) for a in m.lora_adapters)]
        for path, n in zip(paths, [*m.served_names, *m.lora_adapters]):
            if n in seen:
                return path, f"served name, alias or LoRA adapter {n!r} of model {m.name!r} is already used by model {seen[n]!r}"
            seen[n] = m.name
    return None


def lora_problem(routing: str, vllm_args: dict, adapters: dict) -> tuple[tuple, str] | None:
    """Why a model's LoRA adapters cannot be served as set: (the fields, why), or None."""
    given = [k for k in vllm_args if k in ("lora-modules", "enable-lora")]
    if given:
        return tuple(("vllm_args", k) for k in given), (
            f"vllm_args {', '.join(given)}: list the adapters in lora_adapters (NAME: PATH) instead, which the job "
            "passes as --enable-lora --lora-modules and the gateway routes by name to this model")
    if adapters and routing == "kv_aware":
        return ("routing", "lora_adapters"), (
            "routing kv_aware with lora_adapters: vLLM caches an adapter's blocks under the adapter's name and path, "
            "which kv_aware's index does not follow (its lookups would never match): route otherwise")
    return None


# a reserved sbatch option's field (the others slurmfleet sets itself: the job's name, comment, log, signal, ...)
SBATCH_FIELD = {"time": "time_limit", "t": "time_limit", "partition": "partition", "p": "partition",
                "account": "account", "A": "account", "qos": "qos", "q": "qos", "mem": "memory",
                "nodes": "nodes", "N": "nodes", "gres": "gpus_per_node (and gpu_type)", "gpus": "gpus_per_node",
                "gpus-per-node": "gpus_per_node", "cpus-per-task": "cpus_per_task", "c": "cpus_per_task",
                "reservation": "reservation", "constraint": "constraint", "C": "constraint",
                "requeue": "cluster.requeue", "no-requeue": "cluster.requeue"}
MANAGED_FLAGS = {"host": "", "port": "", "api-key": "the job's own secret", "served-model-name": "name and aliases",
                 "tensor-parallel-size": "tensor_parallel_size", "pipeline-parallel-size": "pipeline_parallel_size",
                 "nnodes": "nodes", "node-rank": "", "master-addr": "", "master-port": "", "headless": "",
                 "scheduling-policy": "scheduling_policy", "hf-token": ""}
SECRET_FLAGS = {"hf-token": "HF_TOKEN"}   # a secret on the engine's command line: every user of its node sees it in ps


def reserved_sbatch_problem(key: str) -> str:
    """An sbatch option slurmfleet writes itself, and where its value is set instead."""
    return (f"sbatch option {key!r} is set by slurmfleet: use {SBATCH_FIELD[key]}" if key in SBATCH_FIELD else
            f"sbatch option {key!r} is set by slurmfleet itself")


def managed_flag_problem(vllm_args: dict) -> tuple[tuple, str] | None:
    """(the first flag's key, what is wrong) for vLLM flags slurmfleet sets itself (argparse takes a start of one as
    the flag), naming the field that sets it; None if there is none."""
    bad = sorted(k for k in vllm_args if any(f.startswith(k) for f in MANAGED_FLAGS))
    if not bad:
        return None
    whole = next(f for f in sorted(MANAGED_FLAGS) if f.startswith(bad[0]))
    if whole in SECRET_FLAGS:
        return (bad[0],), (f"--{whole} would put a secret on the engine's command line, which every user of its "
                           f"node sees in `ps`: set env {SECRET_FLAGS[whole]} instead")
    by = MANAGED_FLAGS[whole] or "slurmfleet itself, for each job"
    return (bad[0],), (f"--{whole}{f' (which {bad[0]!r} abbreviates)' if whole != bad[0] else ''} is set by {by}"
                       + (f"; so are {', '.join(bad[1:])}" if bad[1:] else ""))
