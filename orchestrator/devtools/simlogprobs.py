"""Log probabilities in the simulator, asked and answered as vLLM 0.32 does (what evaluation harnesses read).

Asked: a chat's ``logprobs: true`` with ``top_logprobs`` (0 by default), a completion's ``logprobs: K``; -1 is
the whole vocabulary, more than vLLM's ``--max-logprobs`` (20) is its 400, as are a negative ``top_logprobs``
other than -1 and a ``top_logprobs`` without ``logprobs``.  A completion's ``echo`` puts the prompt before the
text (its logprobs too, the first position ``null``), and ``echo`` with ``max_tokens: 0`` answers the prompt
alone (vLLM generates one token for it all the same, and its usage counts it).

The simulator's "distribution" at a position is made from its own greedy generator: rank 1 is the token greedy
decoding would pick after the context (probability 0.5-0.99), ranks 2, 3, ... other tokens, the rest of the mass
halving from one to the next (where greedy decoding would end, rank 1 is EOS and rank 2 the token ``ignore_eos``
writes, as vLLM's raw logprobs have it); a token that is none of the ranks listed (a sampled one, or a prompt's
word the generator would not have written) gets less than rank 20.  Everything is a hash of the context, so the
same request gets the same numbers, the listed probabilities never sum above 1, and a completion's greedy text
(without ``ignore_eos``) scored by ``echo`` is greedy at every position.

Answered in vLLM's shapes: a chat choice's ``logprobs.content`` (per token its text, logprob, UTF-8 bytes and
the first ``top_logprobs`` entries of vLLM's per-position list: the token itself, then the top ranks), a
completion's ``tokens``/``token_logprobs``/``top_logprobs`` (up to K+1 entries by text)/``text_offset``, a
stream's per chunk (offsets going on across chunks).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Protocol

from orchestrator.devtools.simengine import RequestError

MAX_LOGPROBS = 20   # vLLM's --max-logprobs default
WINDOW = 16         # context tokens a position's numbers hash (the generator's own window)
TRUE = (True, 1, "true", "True", "1", "yes", "on", "t", "y")   # (pydantic's lax bool)
HALF = math.log(0.5)
NUDGE = 1 << 30     # context ids (no token's) that make the generator name ranks 2, 3, ...

Position = list[tuple[int, float]]   # vLLM's logprobs of one position: the token's first, then ranks 1, 2, ...


class Vocab(Protocol):
    size: int
    eos: int | None

    def predict(self, seq: list[int], ignore_eos: bool = False) -> int: ...
    def token(self, tid: int) -> str: ...


def _integer(v, field: str) -> None:
    """vLLM's 400s for a count that is no integer (None passes; a bool is an int: pydantic's lax int reads true as 1)."""
    if v is not None and not isinstance(v, (int, float)):
        raise RequestError(f"`{field}` must be an integer.", param=field)
    if isinstance(v, float) and not v.is_integer():
        raise RequestError(f"{field}: Input should be a valid integer, got a number with a fractional part",
                           param=field)


def _top(v, vocab_size: int, kind: str, param: str) -> int:
    """The entries asked per position (-1: the whole vocabulary); vLLM's 400 past ``--max-logprobs``."""
    k = vocab_size if v == -1 else int(v)
    if k > MAX_LOGPROBS:
        raise RequestError(f"Requested {kind} logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}",
                           param=param)
    return k


def asked(body: dict, chat: bool, vocab_size: int) -> int | None:
    """The top logprobs asked per position (None: no logprobs), as vLLM validates them; RequestError (400)."""
    field = "top_logprobs" if chat else "logprobs"
    v = body.get(field)
    _integer(v, field)
    if v is not None and v < 0 and v != -1:
        raise RequestError(f"`{field}` must be a positive value or -1.", param=field)
    if chat:
        on = body.get("logprobs") in TRUE
        if v is not None and v != 0 and not on:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        if not on:
            return None
        v = v or 0
    elif v is None:
        return None
    return _top(v, vocab_size, "sample", "logprobs")


def prompt_asked(body: dict, chat: bool, vocab_size: int) -> int | None:
    """The prompt logprobs the request asks for per position (None: none), as vLLM reads them: its
    ``prompt_logprobs``, else with ``echo`` a completion's ``logprobs`` or a chat's ``top_logprobs`` (0 by
    default); RequestError (400) as vLLM's.  A request that asks computes its prompt whole: vLLM then reads none
    of its prefix cache (``skip_reading_prefix_cache``)."""
    v = body.get("prompt_logprobs")
    if v is not None:
        _integer(v, "prompt_logprobs")
        if body.get("stream") and (v > 0 or v == -1):
            raise RequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if v < 0 and v != -1:
            raise RequestError("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
    elif body.get("echo") in TRUE:   # (a chat's top_logprobs null is 0, as vLLM's TopLogprobsParam reads it)
        v = (body.get("top_logprobs") or 0) if chat else body.get("logprobs")
    if v is None or not isinstance(v, (int, float)):
        return None
    return max(_top(v, vocab_size, "prompt", "prompt_logprobs"), 0)


def _unit(seq: list[int], salt: int) -> float:
    """A number in [0, 1) of the context and a salt."""
    window = [*seq[-WINDOW:], salt]
    digest = hashlib.blake2b(struct.pack(f"<{len(window)}q", *window), digest_size=8, key=b"logprob").digest()
    return int.from_bytes(digest, "little") / 2**64


def position(vocab: Vocab, ctx: list[int], tok: int, k: int) -> Position:
    """The logprobs of ``tok`` after ``ctx``: ``tok``'s first, then the top ``k`` (max 1) ranks, no token twice.

    Rank 1 (the greedy token) has probability 0.5-0.99, the rest of the mass halving from rank to rank (rank 2
    where greedy decoding would end: the token ``ignore_eos`` writes there, as in vLLM's raw logprobs, which
    ``ignore_eos`` does not change); a token beyond the ranks listed has less than rank 20's."""
    ranks, own = _ranked(vocab, ctx, tok, k)
    return [(tok, own), *((t, lp) for t, lp in ranks[:max(k, 1)] if t != tok)]


def prompt_position(vocab: Vocab, ctx: list[int], tok: int, k: int) -> dict:
    """A prompt token's entry of vLLM's ``prompt_logprobs``: by token id, its own logprob, rank and text, and
    the top ``k`` ranks' (a token beyond the ranks listed has a rank past :data:`MAX_LOGPROBS`)."""
    ranks, own = _ranked(vocab, ctx, tok, k)
    at = next((r for r, (t, _) in enumerate(ranks, 1) if t == tok), MAX_LOGPROBS + 1 + int(100 * _unit(ctx, -3)))
    out = {str(tok): {"logprob": own, "rank": at, "decoded_token": vocab.token(tok)}}   # (first, as vLLM's)
    out.update((str(t), {"logprob": lp, "rank": r, "decoded_token": vocab.token(t)}) for r, (t, lp) in
               enumerate(ranks[:k], 1) if t != tok)
    return out


def _ranked(vocab: Vocab, ctx: list[int], tok: int, k: int) -> tuple[Position, float]:
    """The top ``k`` (max 1) ranks after ``ctx`` and ``tok``'s logprob there."""
    top = vocab.predict(ctx)
    first = -0.01 - 0.69 * _unit(ctx, -1)
    rest = math.log(-math.expm1(first))   # (the mass below rank 1)

    def rank_lp(r: int, salt: int) -> float:   # rank r > 1
        return rest + (r - 1) * HALF - 0.2 * _unit(ctx, salt)
    ranks = [(top, first)]
    if top == vocab.eos:
        ranks.append((vocab.predict(ctx, ignore_eos=True), rank_lp(2, 0)))
    salt = 0
    while len(ranks) < max(k, 1) and salt < 4 * k + 8:   # ranks 3, ...: what it predicts after a nudge
        salt += 1
        alt = vocab.predict([*ctx[-(WINDOW - 1):], NUDGE + salt])
        if all(alt != t for t, _ in ranks):
            ranks.append((alt, rank_lp(len(ranks) + 1, salt)))
    own = next((lp for t, lp in ranks if t == tok), None)
    if own is None:
        own = rest + MAX_LOGPROBS * HALF - 0.3 - 6.0 * _unit([*ctx, tok], -2)
    return ranks, own


class Logprobs:
    """One choice's logprobs as vLLM renders them (a stream's chunk by chunk: offsets go on)."""

    def __init__(self, vocab: Vocab, k: int, chat: bool):
        self.vocab, self.k, self.chat = vocab, k, chat
        self.offset = 0   # a completion's next text offset

    def at(self, ctx: list[int], tok: int) -> Position:
        return position(self.vocab, ctx, tok, self.k)

    def prompt(self, ids: list[int]) -> list[Position | None]:
        """A prompt's positions (an echo's): the first has none."""
        return [None, *(self.at(ids[:i], ids[i]) for i in range(1, len(ids)))]

    def render(self, ids: list[int], positions: list[Position | None]) -> dict:
        token = self.vocab.token
        if self.chat:
            content = []
            for tid, pos in zip(ids, positions):
                text = token(tid)
                entry = {"token": text, "logprob": pos[0][1] if pos else -9999.0, "bytes": list(text.encode())}
                entry["top_logprobs"] = [{"token": token(t), "logprob": lp, "bytes": list(token(t).encode())}
                                         for t, lp in (pos or [])[:self.k]]
                content.append(entry)
            return {"content": content}
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid, pos in zip(ids, positions):
            text = token(tid)
            out["text_offset"].append(self.offset)
            out["tokens"].append(text)
            out["token_logprobs"].append(pos[0][1] if pos else None)
            out["top_logprobs"].append({token(t): lp for t, lp in pos[:self.k + 1]} if pos else None)
            self.offset += len(text)
        return out
