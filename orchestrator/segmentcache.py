"""Encoding the long, repeated parts of chat prompts once.

A ``kv_aware`` gateway tokenizes every chat prompt, and chat prompts repeat most of their text: a tenant's
document, an assistant's system prompt, the earlier turns of a conversation.  Tokenizing a 3,000-token
prompt costs milliseconds of CPU per request; most of it is text encoded many times before.

``tokenizers`` takes the added (special) tokens out of the text first and encodes the pieces between them
independently, so a prompt can be encoded piece by piece: the special tokens' ids, and each long piece
from a bounded LRU cache.  That holds for the usual byte-level tokenizers; it does not when the added
tokens take the whitespace beside them (``lstrip``/``rstrip``), are matched after a normalizer, or when
the pre-tokenizer treats the start of the text differently (a Metaspace ``prepend_scheme: first``).  So the
cache is used only when no added token has those flags and there is no normalizer, and it checks itself:
its first ``checks`` prompts of several pieces are also encoded whole, and one difference turns it off for
good (the ids then come from encoding the whole text, as before).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

MIN_PIECE_CHARS = 256        # shorter pieces are encoded each time (a cache entry would cost more than it saves)
DEFAULT_LIMIT_CHARS = 8 << 20  # cached text, in characters (the ids take about as much again)


class SegmentEncoder:
    """``encode(text)`` = ``tokenizer.encode(text, add_special_tokens=False).ids``, faster on repeated text."""

    def __init__(self, tok: Tokenizer, limit_chars: int = DEFAULT_LIMIT_CHARS, checks: int = 16):
        self._tok = tok
        added = tok.get_added_tokens_decoder()
        self._ids = {t.content: i for i, t in added.items() if t.content}
        self.usable = bool(self._ids) and tok.normalizer is None and not any(
            t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values())
        self._split = re.compile("(" + "|".join(re.escape(c) for c in sorted(self._ids, key=len, reverse=True))
                                 + ")") if self._ids else None
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.limit_chars = limit_chars
        self.checks_left = checks
        self.hits = self.misses = 0

    def _whole(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        if not self.usable:   # (also without added tokens: nothing to split on)
            return self._whole(text)
        parts = self._split.split(text)   # text, special, text, special, ..., text
        if len(parts) == 1:
            return self._whole(text)
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._ids[part])
            elif len(part) < MIN_PIECE_CHARS:
                if part:
                    ids.extend(self._whole(part))
            else:
                ids.extend(self._piece(part))
        if self.checks_left > 0:
            whole = self._whole(text)
            if whole != ids:
                self.usable = False
                self._cache.clear()
                log.warning("this tokenizer does not encode a prompt piece by piece as it encodes it whole: "
                            "prompts are encoded whole from now on")
                return whole
            self.checks_left -= 1
        return ids

    def _piece(self, part: str) -> list[int]:
        hit = self._cache.get(part)
        if hit is not None:
            self._cache.move_to_end(part)
            self.hits += 1
            return hit
        self.misses += 1
        ids = self._whole(part)
        if len(part) <= self.limit_chars:
            self._cache[part] = ids
            self._chars += len(part)
            while self._chars > self.limit_chars:
                old, _ = self._cache.popitem(last=False)
                self._chars -= len(old)
        return ids
