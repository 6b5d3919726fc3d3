"""vLLM's stop conditions over the simulator's text: ``stop`` strings (its detokenizer's rule: the earliest
completed string wins, the text cut before it, or after it with ``include_stop_str_in_output``, none checked
within ``min_tokens``; a stream holds back the longest string's length - 1 characters until it ends) and
``stop_token_ids`` (its scheduler's: the token ends the sequence, its text left out unless included; not within
``min_tokens``, where vLLM's sampler never picks it; the model's EOS is an EOS, not a stop token).  The
answer's ``finish_reason`` is then "stop" and its ``stop_reason`` the string or the token id."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class Stops:
    def __init__(self, body: dict, eos: int | None = None):
        """ValueError (vLLM's 400) for a ``stop`` that is not a string or a list of strings, or ``stop_token_ids``
        that are not integers."""
        stop, ids = body.get("stop"), body.get("stop_token_ids")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError("stop must be a string or a list of strings")
        if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
            raise ValueError("stop_token_ids must be a list of integers")
        self.strings = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
        self.token_ids = frozenset(ids or ()) - {eos}   # (vLLM checks its EOS first: stop_reason null)
        self.include = body.get("include_stop_str_in_output") is True
        self.min_tokens = body["min_tokens"] if type(body.get("min_tokens")) is int else 0
        self.hold = max(map(len, self.strings)) - 1 if self.strings and not self.include else 0
        self.active = bool(self.strings or self.token_ids)
        self.text, self.sent, self.tokens = "", 0, 0
        self.reason: str | int | None = None   # what stopped it

    def step(self, tok: int, piece: str) -> bool:
        """Token ``tok`` adding ``piece`` to the text: whether it ends the sequence."""
        self.tokens += 1
        if tok in self.token_ids and self.tokens > self.min_tokens:   # (vLLM's sampler masks them until then)
            self.text += piece if self.include else ""
            self.reason = tok
            return True
        new = len(piece)
        self.text += piece
        if not self.strings or not new or self.tokens <= self.min_tokens:
            return False
        best = None   # (end, index, string): the earliest end, then the list's order
        for s in self.strings:
            at = self.text.find(s, max(0, len(self.text) - new - len(s) + 1))
            if at >= 0 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), at, s)
        if best is None:
            return False
        end, at, self.reason = best
        self.text = self.text[:end if self.include else at]
        return True

    def upto(self, tokens: Iterable[int], piece: Callable[[int], str]) -> Iterator[int]:
        """A whole answer's ``tokens``, up to the one that stops it (``piece``: the text a token adds, asked
        before the caller takes it; only with a stop condition)."""
        for tok in tokens:
            stopped = self.step(tok, piece(tok) if self.active else "")
            yield tok
            if stopped:
                return

    def delta(self, finished: bool) -> str:
        """The text not sent yet: all of it once ``finished``, else what no stop string can still take back."""
        upto = max(self.sent, len(self.text) - (0 if finished else self.hold))
        out, self.sent = self.text[self.sent:upto], upto
        return out
