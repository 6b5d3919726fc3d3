"""What vLLM makes of a model's ``generation_config.json`` for the length of an answer, so that a continued
generation (:mod:`.resume`) stops where the uninterrupted one would.

vLLM (``ModelConfig.get_diff_sampling_param``) reads ``max_new_tokens`` from the model's
``generation_config.json`` (``--generation-config auto``, the default; a folder given there instead; none with
``vllm``), overridden by ``--override-generation-config``: it is the ``max_tokens`` of a chat without one (a
completion without one has 16, ``null`` too: vLLM's request model sets it).  And it caps every request's (``override_max_tokens``)
when the generation config is such a folder, or else when the override sets it.  The files are read on the
daemon's host (``model_path`` through the container's binds, :func:`host_path`), as the tokenizer of
``kv_aware`` is: a vLLM model whose ``config.json`` is not readable there is not continued (whether vLLM splits
its output into reasoning, as it does for gpt-oss with no flag, cannot be told)."""

from __future__ import annotations

import json
import logging
import os

from ..config import ModelConfig
from .stitch import output_penalised

log = logging.getLogger("orchestrator.gateway")


def generation_limits(m: ModelConfig) -> tuple[int | None, int | None] | None:
    """(the default ``max_tokens`` of a request without one, the cap of every request's), None where none; None
    for a model whose generations are not continued: a reasoning parser splits the output in fields a
    continuation cannot rebuild, and so does gpt-oss's harmony format (vLLM parses its channels with no flag:
    ``model_type`` ``gpt_oss`` in the model's ``config.json``, read on the daemon's host)."""
    if m.vllm_args.get("reasoning-parser") or "reasoning_parser" in str(m.vllm_args.get(
            "structured-outputs-config") or ""):
        return None
    found = model_config(m)
    if m.engine == "vllm" and not found:   # its config.json not readable here: whether vLLM splits its output
        log.warning("model %s: its config.json is not readable on this host (model_path %s, through the container's "
                    "binds): its generations are not continued on another replica", m.name, m.model_path)
        return None   # (gpt-oss's harmony channels, with no flag) and where it stops cannot be told
    if found.get("model_type") == "gpt_oss":
        return None
    src = m.vllm_args.get("generation-config", "auto")
    cfg: dict = {}
    folder = host_path(m, m.model_path if src == "auto" else src if src != "vllm" else None)
    if isinstance(folder, str):
        try:
            with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
                read = json.load(f)
            cfg = read if isinstance(read, dict) else {}
        except (OSError, ValueError):
            pass
    override = m.vllm_args.get("override-generation-config")
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except ValueError:
            override = None
    override = override if isinstance(override, dict) else {}
    cfg.update(override)
    if output_penalised(cfg):   # (vLLM's default for every request without its own)
        log.warning("model %s: its generation config sets a presence or frequency penalty, which vLLM counts on the "
                    "output alone: its generations are not continued on another replica", m.name)
        return None

    def tokens(v) -> int | None:
        return v if type(v) is int and v > 0 else None
    default = tokens(cfg.get("max_new_tokens"))
    cap = default if src not in ("auto", "vllm") else tokens(override.get("max_new_tokens"))
    return default, cap


def host_path(m: ModelConfig, path):
    """``path``, one of the engine's (inside its container), as this host sees it: through the container's
    binds (``SRC[:DST[:OPTS]]``), the host's SRC for a path at or under a DST; as it is otherwise."""
    if not isinstance(path, str) or not m.container.enabled:
        return path
    for bind in m.container.binds:
        src, _, rest = str(bind).partition(":")
        dst = rest.partition(":")[0] or src
        if path == dst or path.startswith(dst.rstrip("/") + "/"):
            return src + path[len(dst):]
    return path


def model_config(m: ModelConfig) -> dict:
    """The model's ``config.json`` on the daemon's host ({} where it cannot be read)."""
    try:
        with open(os.path.join(str(host_path(m, m.model_path)), "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        return cfg if isinstance(cfg, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


# architectures whose prompts vLLM renders with a tokenizer of its own, not the model's chat template and
# tokenizer.json (its tokenizer_mode "auto" picks it: vllm/config/model.py)
OWN_RENDERERS = {"MoonshotKimiaForCausalLM": "kimi_audio", "KimiK3ForConditionalGeneration": "kimi_k3",
                 "DeepseekV32ForCausalLM": "deepseek_v32", "DeepseekV4ForCausalLM": "deepseek_v4",
                 "DeepseekV4ForConditionalGeneration": "deepseek_v4", "DeepseekV41ForCausalLM": "deepseek_v41",
                 "InklingForCausalLM": "inkling", "InklingForConditionalGeneration": "inkling"}


def own_renderer(m: ModelConfig) -> str | None:
    """The renderer vLLM picks by itself for this model, where it is not the model's chat template (gpt-oss's
    harmony format, or an architecture's own tokenizer mode); None otherwise, or where it cannot be told."""
    cfg = model_config(m)
    if cfg.get("model_type") == "gpt_oss":
        return "harmony (gpt-oss)"
    archs = cfg.get("architectures")
    return next((OWN_RENDERERS[a] for a in archs if a in OWN_RENDERERS), None) if isinstance(archs, list) else None
