"""SegmentEncoder: a chat prompt encoded piece by piece (between the special tokens, long pieces from a cache)
gives exactly the ids of encoding it whole, and turns itself off for tokenizers where that does not hold."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from orchestrator.devtools.tinymodel import build_tokenizer
from orchestrator.segmentcache import MIN_PIECE_CHARS, SegmentEncoder


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_file(str(build_tokenizer(tmp_path_factory.mktemp("tok")) / "tokenizer.json"))


def prompts(rng: random.Random, n: int) -> list[str]:
    """Chat-template-like texts: a few shared long documents, varied questions, odd whitespace and unicode
    next to the special tokens, a special token's text inside a message."""
    words = ["fleet", "GPU", " node", "\n\n", "  ", "Ünïcode", "数据", "x", "<|im_end", "tab\t", "'s", "123", "😀"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(80, 400))) for _ in range(4)]
    out = []
    for _ in range(n):
        turns = [f"<|im_start|>system\n{rng.choice(docs)}<|im_end|>\n"]
        for _ in range(rng.randint(1, 3)):
            q = "".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
            turns.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{rng.choice(docs)[:300]}<|im_end|>\n")
        out.append("".join(turns) + rng.choice(["<|im_start|>assistant\n", " <|im_start|> ", "<|im_end|><|im_end|>"]))
    return out


def test_pieces_give_the_whole_encoding_and_repeated_text_comes_from_the_cache(tok: Tokenizer) -> None:
    enc = SegmentEncoder(tok, checks=4)
    assert enc.usable
    texts = prompts(random.Random(3), 300)
    for text in texts:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert enc.usable and enc.checks_left == 0          # the self-check passed and ended
    assert enc.hits > 5 * enc.misses > 0                 # the shared documents were encoded a few times only
    assert enc.encode("no special token here") == tok.encode("no special token here", add_special_tokens=False).ids


def test_the_cache_holds_at_most_its_limit(tok: Tokenizer) -> None:
    enc = SegmentEncoder(tok, limit_chars=4 * MIN_PIECE_CHARS, checks=0)
    for i in range(50):
        text = f"<|im_start|>{'word ' * 60}{i}<|im_end|>"
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert enc._chars <= 4 * MIN_PIECE_CHARS and len(enc._cache) <= 4


@pytest.fixture
def strip(tok: Tokenizer, tmp_path: Path) -> Tokenizer:
    """The tokenizer with one more special token that takes the whitespace on both sides of it."""
    tok.save(str(tmp_path / "t.json"))
    out = Tokenizer.from_file(str(tmp_path / "t.json"))
    out.add_special_tokens([AddedToken("<|sep|>", rstrip=True, lstrip=True)])
    return out


def test_added_tokens_that_take_whitespace_are_not_split_on(strip: Tokenizer) -> None:
    enc = SegmentEncoder(strip)
    assert not enc.usable
    text = "a long piece " * 40 + " <|sep|>  next " * 3
    assert enc.encode(text) == strip.encode(text, add_special_tokens=False).ids


def test_the_self_check_turns_the_cache_off_where_pieces_encode_differently(strip: Tokenizer) -> None:
    enc = SegmentEncoder(strip)
    enc.usable = True   # as if the flags had not told: the whitespace it takes is in the pieces beside it
    texts = ["a long piece " * 40 + " <|sep|>  next " * 3, "short"]
    for text in texts:
        assert enc.encode(text) == strip.encode(text, add_special_tokens=False).ids
    assert not enc.usable and not enc._cache and enc.checks_left > 0
