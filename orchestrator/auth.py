"""API keys: the gateway's client keys and the admin API's keys.

A key is configured plain or as ``sha256:<hex>``; requests are checked by digest in constant time.
A client presents its key as ``Authorization: Bearer KEY`` or ``x-api-key: KEY``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path


def key_digest(key: str) -> str:
    """The key's sha256 hex digest, of the bytes the client sent (a header's bytes that are not UTF-8 come
    decoded with surrogates: a wrong key, a 401, not a 500)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def read_keys_file(path: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    return [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


class KeySet:
    """A set of keys; empty means open (every request passes)."""

    def __init__(self, keys: list[str], file: str | None = None):
        entries = list(keys) + (read_keys_file(file) if file else [])
        self.digests = [e.split(":", 1)[1].lower() if e.startswith("sha256:") else key_digest(e) for e in entries]

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def check(self, headers: Mapping[str, str]) -> bool:
        """Does a request with these headers present one of the keys?"""
        if not self.digests:
            return True
        auth = headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if not token:
            return False
        d = key_digest(token)
        return any(hmac.compare_digest(d, x) for x in self.digests)
