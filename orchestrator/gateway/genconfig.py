"""What vLLM makes of a model's ``generation_config.json`` for the length of an answer, so that a continued
generation (:mod:`.resume`) stops where the uninterrupted one would.

vLLM (``ModelConfig.get_diff_sampling_param``) reads ``max_new_tokens`` from the model's
``generation_config.json`` (``--generation-config auto``, the default; a folder given there instead; none with
``vllm``), overridden by ``--override-generation-config``: it is the ``max_tokens`` of a chat without one (a
completion without one has 16, ``null`` too: vLLM's request model sets it).  And it caps every request's (``override_max_tokens``)
when the generation config is such a folder, or else when the override sets it.  The files are read on the
daemon's host, as the tokenizer of ``kv_aware`` is: a model whose files live only on the nodes keeps the
context's end as its default."""

from __future__ import annotations

import json
import os

from ..config import ModelConfig


def generation_limits(m: ModelConfig) -> tuple[int | None, int | None] | None:
    """(the default ``max_tokens`` of a request without one, the cap of every request's), None where none; None
    for a model whose generations are not continued: a reasoning parser splits the output in fields a
    continuation cannot rebuild, and so does gpt-oss's harmony format (vLLM parses its channels with no flag:
    ``model_type`` ``gpt_oss`` in the model's ``config.json``, read on the daemon's host)."""
    if m.vllm_args.get("reasoning-parser") or _model_type(m) == "gpt_oss":
        return None
    src = m.vllm_args.get("generation-config", "auto")
    cfg: dict = {}
    folder = m.model_path if src == "auto" else src if src != "vllm" else None
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

    def tokens(v) -> int | None:
        return v if type(v) is int and v > 0 else None
    default = tokens(cfg.get("max_new_tokens"))
    cap = default if src not in ("auto", "vllm") else tokens(override.get("max_new_tokens"))
    return default, cap


def _model_type(m: ModelConfig) -> str | None:
    return model_config(m).get("model_type")


def model_config(m: ModelConfig) -> dict:
    """The model's ``config.json`` on the daemon's host ({} where it cannot be read)."""
    try:
        with open(os.path.join(str(m.model_path), "config.json"), encoding="utf-8") as f:
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
