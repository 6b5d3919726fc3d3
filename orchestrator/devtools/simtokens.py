"""The simulator's tokenizer, chat template and "model": deterministic, so a resumed stream can be checked.

Text to ids: the text is split on whitespace; a special marker (``<|user|>``, ...) is its reserved id (0-99),
``t<N>`` (what the simulator writes) is id N, any other word ``100 + crc32(word) % 49900``.  Id to text:
``" t<N>"`` (a leading space), special ids ``""``; ``decode(ids)`` is the concatenation of the per-token texts
and ``encode(decode(ids)) == ids`` for generated ids.

Generation: the next token is a hash of the last ``WINDOW`` ids of the whole sequence (prompt + generated so
far), so a request whose prompt is ``prompt_token_ids + token_ids[:k]`` generates exactly ``token_ids[k:]``.
Greedy requests (``temperature`` 0 or absent) and seeded ones are deterministic; ``temperature > 0`` without
a ``seed`` draws at random.  About one step in ``EOS_EVERY`` samples EOS (id 2, text ``""``, included in
``token_ids`` and the usage count), which ends the generation with ``finish_reason`` "stop" unless
``ignore_eos`` (or ``min_tokens`` not yet reached).
"""

from __future__ import annotations

import hashlib
import random
import re
import struct
import zlib
from collections.abc import Iterator

VOCAB = 50_000
FIRST_WORD = 100  # ids below are special
BOS, EOS = 1, 2
SPECIAL = {"<|bos|>": BOS, "<|eos|>": EOS, "<|system|>": 3, "<|user|>": 4, "<|assistant|>": 5, "<|tool|>": 6,
           "<|developer|>": 8, "<|end|>": 7}
EOS_EVERY = 500
WINDOW = 16
_SIM_WORD = re.compile(r"t([1-9][0-9]{2,4})")


def word_id(word: str) -> int:
    if word in SPECIAL:
        return SPECIAL[word]
    m = _SIM_WORD.fullmatch(word)
    if m and int(m[1]) < VOCAB:
        return int(m[1])
    return FIRST_WORD + zlib.crc32(word.encode()) % (VOCAB - FIRST_WORD)


def encode(text: str) -> list[int]:
    return [word_id(w) for w in text.split()]


def token_text(tid: int) -> str:
    return "" if tid < FIRST_WORD else f" t{tid}"


def decode(ids: list[int]) -> str:
    return "".join(token_text(t) for t in ids)


def _content(content) -> str:
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return " ".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def render_chat(messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """``<|role|> content <|end|>`` per message, then ``<|assistant|>``; continuing leaves the last one open."""
    parts = []
    for n, m in enumerate(messages):
        parts.append(f"<|{m.get('role')}|> {_content(m.get('content'))}")
        if not (continue_final_message and n == len(messages) - 1):
            parts.append("<|end|>")
    if add_generation_prompt and not continue_final_message:
        parts.append("<|assistant|>")
    return " ".join(parts)


def request_prompt(body: dict, chat: bool) -> list[int]:
    """The prompt's token ids (a chat's after its template); ValueError says what is wrong (HTTP 400)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("messages must be a non-empty list of message objects")
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        cont = bool(body.get("continue_final_message"))
        return encode(render_chat(msgs, body.get("add_generation_prompt", True) is not False, cont))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = [t for t in prompt if not 0 <= t < VOCAB]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        return list(prompt)
    raise ValueError("prompt must be a string, a non-empty list of token ids, or a list of one of those")


def generate(prompt_ids: list[int], max_tokens: int, body: dict, adapter: str = "") -> Iterator[int]:
    """Up to ``max_tokens`` ids, lazily; a yielded EOS is the last one.  Bad parameters raise ValueError now.
    ``adapter``: a LoRA adapter's name (its weights: other choices, as deterministic)."""
    temperature = float(body.get("temperature") or 0)
    seed = body.get("seed")
    rng = random.Random() if temperature > 0 and seed is None else None
    key = f"seed:{seed}".encode()[:40] if temperature > 0 and seed is not None else b""
    if adapter:
        key = hashlib.blake2b(f"lora:{adapter}".encode(), digest_size=16).digest() + key
    ignore_eos = bool(body.get("ignore_eos"))
    min_tokens = int(body.get("min_tokens") or 0)
    return _sample(list(prompt_ids), max_tokens, rng, key, ignore_eos, min_tokens)


def _sample(seq: list[int], max_tokens: int, rng: random.Random | None, key: bytes, ignore_eos: bool,
            min_tokens: int) -> Iterator[int]:
    for n in range(max_tokens):
        if rng:
            h = rng.getrandbits(64)
        else:
            window = seq[-WINDOW:]
            data = struct.pack(f"<{len(window)}I", *window)
            h = int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little")
        if h % EOS_EVERY == 0 and not ignore_eos and n >= min_tokens:
            yield EOS
            return
        tok = FIRST_WORD + (h >> 16) % (VOCAB - FIRST_WORD)
        seq.append(tok)
        yield tok
