"""The simulator's vocabulary: ``simtokens``' own, or a model's tokenizer with ``simtokens``' generator in it.

Both give the simulator the same interface: ``prompt(body, chat)`` (the prompt's token ids; ValueError for a
bad request), ``generate(prompt, max_tokens, body)`` (the ids, lazily; bad parameters raise at once), ``eos``,
``piece(seq, tok)`` (the text a streamed token adds) and ``text(ids)``.  With a model directory (vllm serve's
positional model path holding a ``tokenizer.json``) prompts are the ids vLLM computes for them
(``orchestrator.prompttokens``), so the simulator's KV-cache blocks hash as the real engine's would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from orchestrator.devtools import simtokens

if TYPE_CHECKING:
    from orchestrator.prompttokens import PromptTokenizer


class SimVocab:
    """``simtokens``' own vocabulary, template and generator (no model directory)."""
    eos = simtokens.EOS
    size = simtokens.VOCAB

    def prompt(self, body: dict, chat: bool) -> list[int]:
        return simtokens.request_prompt(body, chat)

    def generate(self, prompt: list[int], max_tokens: int, body: dict, adapter: str = "") -> Iterator[int]:
        return simtokens.generate(prompt, max_tokens, body, adapter)

    def piece(self, _seq: list[int], tok: int) -> str:
        return simtokens.token_text(tok)

    def predict(self, seq: list[int], ignore_eos: bool = False, adapter: str = "") -> int:
        """The token greedy decoding writes after ``seq`` (logprobs' rank 1; with ``ignore_eos`` never EOS)."""
        return next(simtokens.generate(seq, 1, {"ignore_eos": ignore_eos}, adapter))

    def token(self, tid: int) -> str:
        """One token's text, as logprobs name it."""
        return simtokens.token_text(tid)

    def text(self, ids: list[int]) -> str:
        return simtokens.decode(ids)


class ModelVocab:
    """A model's tokenizer and chat template for prompts; ``simtokens``' generator moved into its vocabulary.

    Each step asks ``simtokens`` for one token of the sequence so far (model ids: the generator hashes ids,
    whatever their vocabulary), and maps it to an id of this vocabulary that decodes to some text (EOS to the
    model's EOS), so the next step hashes the mapped ids and a resumed request goes on exactly."""

    def __init__(self, tok: PromptTokenizer):
        self.tok = tok
        eos = tok.encode(tok.special_tokens.get("eos_token") or "", add_special_tokens=False)
        self.eos = eos[0] if len(eos) == 1 else None  # None: never ends on its own (no EOS known)
        self.size = tok.vocab_size

    @classmethod
    def load(cls, model: str | None) -> ModelVocab | None:
        if not model or not os.path.isfile(os.path.join(model, "tokenizer.json")):
            return None
        from orchestrator.prompttokens import PromptTokenizer  # tokenizers and jinja2: only with a model
        return cls(PromptTokenizer.from_dir(model))

    def prompt(self, body: dict, chat: bool) -> list[int]:
        ids = self.tok.prompt_ids(body, chat)
        bad = [t for t in ids if not 0 <= t < self.tok.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        return ids

    def generate(self, prompt: list[int], max_tokens: int, body: dict, adapter: str = "") -> Iterator[int]:
        knobs = {k: body.get(k) for k in ("temperature", "seed", "ignore_eos")}
        knobs["ignore_eos"] = knobs["ignore_eos"] or self.eos is None
        min_tokens = int(body.get("min_tokens") or 0)
        simtokens.generate(prompt, 1, {**knobs, "min_tokens": min_tokens})  # bad parameters raise now
        return self._steps(list(prompt), max_tokens, knobs, min_tokens, adapter)

    def _steps(self, seq: list[int], max_tokens: int, knobs: dict, min_tokens: int,
               adapter: str = "") -> Iterator[int]:
        for n in range(max_tokens):
            step = next(simtokens.generate(seq, 1, {**knobs, "min_tokens": max(0, min_tokens - n)}, adapter))
            if step == simtokens.EOS:
                yield self.eos
                return
            tok = step % self.tok.vocab_size
            while tok == self.eos or not self.tok.decode([tok], skip_special_tokens=True):
                tok = (tok + 1) % self.tok.vocab_size  # a special or empty token: the next one
            seq.append(tok)
            yield tok

    def predict(self, seq: list[int], ignore_eos: bool = False, adapter: str = "") -> int:
        """The token greedy decoding writes after ``seq`` (logprobs' rank 1; with ``ignore_eos`` never EOS)."""
        knobs = {"temperature": None, "seed": None, "ignore_eos": ignore_eos or self.eos is None}
        return next(self._steps(list(seq), 1, knobs, 0, adapter))

    def token(self, tid: int) -> str:
        """One token's text, as logprobs name it."""
        return self.tok.decode([tid], skip_special_tokens=False)

    def piece(self, seq: list[int], tok: int) -> str:
        """The text ``tok`` adds after ``seq`` (decoded with a few tokens of context, as vLLM's detokenizer)."""
        ctx = seq[-6:]
        before = self.tok.decode(ctx, skip_special_tokens=True)
        return self.tok.decode([*ctx, tok], skip_special_tokens=True)[len(before):]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class Adapted:
    """A vocabulary as a LoRA adapter's requests see it: the same tokens, its own greedy choices (its weights)."""

    def __init__(self, vocab: SimVocab | ModelVocab, adapter: str):
        self.vocab, self.adapter = vocab, adapter

    def __getattr__(self, name: str):
        return getattr(self.vocab, name)

    def generate(self, prompt: list[int], max_tokens: int, body: dict) -> Iterator[int]:
        return self.vocab.generate(prompt, max_tokens, body, self.adapter)

    def predict(self, seq: list[int], ignore_eos: bool = False) -> int:
        return self.vocab.predict(seq, ignore_eos, self.adapter)
