"""How deep a parsed JSON document nests: orjson reads 1,023 levels, but what reads it after may not (orjson
writes 254; vLLM's ``run-batch`` parses its lines with pydantic, which refuses about 200), so a body must be
refused where it comes in, with a 400 that says so, not fail later."""

from __future__ import annotations


def nests_deeper(raw: bytes, obj: object, limit: int) -> bool:
    """Whether ``obj`` (parsed from ``raw``) nests more than ``limit`` levels, itself the first: a count of
    ``raw``'s brackets first (in C), the walk only when there are that many."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return False
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(o, dict):
            stack.extend((v, depth + 1) for v in o.values() if isinstance(v, (dict, list)))
        elif isinstance(o, list):
            stack.extend((v, depth + 1) for v in o if isinstance(v, (dict, list)))
    return False
