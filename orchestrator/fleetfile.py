"""Reading a fleet file: YAML with positions, ``defaults`` deep-merged into every model, values no job
can carry refused, then the schema of :mod:`orchestrator.config`; every problem is collected into one
:class:`~orchestrator.yamlsrc.ConfigError` naming file, line and field."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from .config import FleetConfig, ModelConfig
from .keysfile import resolve_keys
from .modelgateway import fallback_problems
from .tlsfiles import resolve_tls
from .configwords import PATTERN_WORDS, field_names
from .yamlsrc import ConfigError, Problem, Source, load_file, load_with_positions, validation_problems

MAX_VALUE_BYTES = 65_536
"""The longest string a fleet file may hold in one value, in bytes of UTF-8 (a character may take 4): every value
ends up in one process argument or environment entry of the engine, and Linux refuses a single one over 128 KiB
(MAX_ARG_STRLEN), counted in bytes."""


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _apply_defaults(src: Source, skip: frozenset[str] = frozenset(),
                    inherited: dict[tuple, tuple] | None = None) -> dict[str, Any]:
    """The models with ``defaults`` merged in (less the keys in ``skip``: reported already); ``inherited`` gets
    each path a model took from ``defaults`` -> that path in ``defaults``."""
    data = src.data
    if not isinstance(data, dict):
        raise ConfigError([src.problem((), "the config must be a mapping")])
    defaults = data.get("defaults") or {}
    if isinstance(defaults, dict) and skip:
        defaults = {k: v for k, v in defaults.items() if k not in skip}
    models = data.get("models")
    if isinstance(defaults, dict) and isinstance(models, list):
        merged = []
        for i, m in enumerate(models):
            if isinstance(m, dict):
                merged.append(_deep_merge(defaults, m))
                if merged[-1].get("engine") == "simulator" and "container" not in m:   # (it runs the daemon's
                    merged[-1]["container"] = {"enabled": False}   # Python: in no image; defaults' is vLLM's)
                for mine, theirs in (("autoscale", "replicas"), ("replicas", "autoscale")):
                    if mine in m and theirs not in m:   # (the model's own shape over the one defaults gives)
                        merged[-1].pop(theirs, None)
                # a value inherited from defaults is reported where defaults sets it
                for table in (src.positions, src.key_positions):
                    for path, pos in list(table.items()):
                        if path[:1] == ("defaults",) and len(path) > 1 and ("models", i, *path[1:]) not in table:
                            table[("models", i, *path[1:])] = pos
                            if inherited is not None:
                                inherited[("models", i, *path[1:])] = path
            else:
                merged.append(m)
        data = {**data, "models": merged}
    return data


def _value_problems(src: Source) -> list[Problem]:
    """Strings no job can carry: NUL bytes (no C string holds one), carriage returns (sbatch refuses a script
    with DOS line breaks, and every value a job uses is written into its script) and values over MAX_VALUE_BYTES."""
    out: list[Problem] = []

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(k, path + (k,)) if isinstance(k, str) else None
                walk(v, path + (k,))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, path + (i,))
        elif isinstance(value, str):
            if "\x00" in value:
                out.append(src.problem(path, "contains a NUL byte"))
            elif "\r" in value:
                out.append(src.problem(path, "contains a carriage return, which no job script can hold (sbatch "
                                             "refuses DOS line breaks)"))
            elif (size := len(value.encode("utf-8", "surrogatepass"))) > MAX_VALUE_BYTES:
                out.append(src.problem(path, f"is {size} bytes long in UTF-8; at most {MAX_VALUE_BYTES}"))
            elif not value.isascii() and any("\ud800" <= c <= "\udfff" for c in value):   # (rendering raised)
                out.append(src.problem(path, "holds a lone surrogate (an escape like \\ud800), which is no UTF-8 text"))
    walk(src.data, ())
    return out


def _duplicate_names(src: Source) -> list[Problem]:
    """Served names and aliases used twice, each at its own line (the model validator can only say the root's)."""
    models = src.data.get("models") if isinstance(src.data, dict) else None
    seen: dict[str, Any] = {}
    out: list[Problem] = []
    for i, m in enumerate(models if isinstance(models, list) else ()):
        if not isinstance(m, dict):
            continue
        aliases = m.get("aliases") if isinstance(m.get("aliases"), list) else []
        adapters = m.get("lora_adapters") if isinstance(m.get("lora_adapters"), dict) else {}
        for path, name in [(("models", i, "name"), m.get("name")),
                           *((("models", i, "aliases", j), a) for j, a in enumerate(aliases)),
                           *((("models", i, "lora_adapters", a), a) for a in adapters)]:
            if isinstance(name, str) and name in seen:
                out.append(src.problem(path, f"model {name!r} is defined twice" if len(path) == 3 and seen[name] == name
                                       else f"served name, alias or LoRA adapter {name!r} of model {m.get('name')!r} "
                                            f"is already used by model {seen[name]!r}", at_key=path[2] == "lora_adapters"))
            elif isinstance(name, str):
                seen[name] = m.get("name")
    return out


def parse_config(src: Source, env: Mapping[str, str] | None = None) -> FleetConfig:
    """Validate a parsed fleet file, then read and check its keys file (``env`` expands its ``${VAR}``)."""
    problems = _value_problems(src)
    defaults = src.data.get("defaults") if isinstance(src.data, dict) else None
    unknown = [k for k in defaults if k not in ModelConfig.model_fields or k == "name"] \
        if isinstance(defaults, dict) else []
    allowed = [k for k in ModelConfig.model_fields if k != "name"]
    problems += [src.problem(("defaults", k), "unknown field" + (
        f" (did you mean {near[0]!r}?)" if (near := difflib.get_close_matches(str(k), allowed, 1, 0.75)) else
        " (or not allowed in defaults)"), at_key=True)
                 for k in unknown]   # (and the rest checked without them: every problem, not the first kind)
    inherited: dict[tuple, tuple] = {}
    data = _apply_defaults(src, frozenset(unknown), inherited)
    try:
        cfg = FleetConfig.model_validate(data)
    except ValidationError as exc:
        # (a value that came from defaults is said once, at its path there: not once per model, at each model's)
        problems += validation_problems(exc, src, words=PATTERN_WORDS, names=field_names(), alias=inherited)
        if dups := _duplicate_names(src):
            problems = [p for p in problems if "is already used by model" not in p.message] + dups
    else:
        served = {n for m in cfg.models for n in m.served_names}
        problems += resolve_keys(cfg.gateway, served, src, env) + resolve_tls(cfg.gateway, src) + \
            fallback_problems(cfg.models, src)
    if problems:   # in file order (a file's keys file after it)
        files = {f: i for i, f in enumerate(dict.fromkeys(p.file for p in problems))}
        raise ConfigError(sorted(problems, key=lambda p: (files[p.file], p.line, p.col)))
    return cfg


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> FleetConfig:
    """Load and validate a fleet file; raise ConfigError listing every problem."""
    return parse_config(load_file(path, env), env)


def load_config_text(text: str, file: str = "<string>", env: Mapping[str, str] | None = None) -> FleetConfig:
    return parse_config(load_with_positions(text, file, env), env)
