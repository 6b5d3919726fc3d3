"""The check of a batch input file as it streams in (:class:`BatchLines`): the Files API refuses an upload that
is no valid batch, naming its line, before anything is stored (:mod:`orchestrator.gateway.files`)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Collection

import orjson

from .batchbody import LAX_FALSE, BadBody, check_body, is_bool, show as _show
from .batches import ENDPOINTS
from .jsondepth import nests_deeper

MAX_LINES = 2_000_000
"""Requests in one batch file at most: the duplicate check's table then stays at most 48 MiB (72 while it
doubles), see :class:`IdSet`."""
MAX_LINE_DEPTH = 128   # a line nested deeper is refused at upload (see nests_deeper)


class BadFile(ValueError):
    """The upload is not a valid batch input file: the 400's message."""


class BadLine(BadFile):
    def __init__(self, line: int, problem: str):
        super().__init__(f"Line {line}: {problem}")
        self.line = line


class IdSet:
    """The ``custom_id``s seen: 8-byte BLAKE2b digests in an open-addressing table with the line of each
    (12 bytes a slot, at most half full): 24 to 48 bytes a line (72 while it doubles), 24 MiB for
    1,000,000 lines.  Two ids taken for one need a 64-bit collision (about 3e-8 in a million ids)."""

    def __init__(self, slots: int = 1024):
        self.keys = array("Q", [0]) * slots
        self.lines = array("I", [0]) * slots
        self.count = 0

    def add(self, custom_id: str, line: int) -> int:
        """0 if new, else the line that has it already."""
        h = int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little") or 1
        keys = self.keys
        mask = len(keys) - 1
        i = h & mask
        while (k := keys[i]) != 0:
            if k == h:
                return self.lines[i]
            i = (i + 1) & mask
        keys[i] = h
        self.lines[i] = line
        self.count += 1
        if self.count * 2 > len(keys):
            self._grow()
        return 0

    def _grow(self) -> None:
        old, old_lines = self.keys, self.lines
        self.keys = keys = array("Q", [0]) * (2 * len(old))
        self.lines = lines = array("I", [0]) * len(keys)
        mask = len(keys) - 1
        for j, h in enumerate(old):
            if h:
                i = h & mask
                while keys[i]:
                    i = (i + 1) & mask
                keys[i], lines[i] = h, old_lines[j]


class BatchLines:
    """Checks a batch input file chunk by chunk as it streams in (:meth:`feed`, then :meth:`close`): every
    line a JSON object with a unique ``custom_id``, ``method`` POST, one ``url`` of :data:`ENDPOINTS` for
    all, a ``body`` object whose ``model`` ``resolve`` knows (served name or alias -> the model) and that is
    in ``allowed`` (None: all), and that vLLM's request model takes (:func:`orchestrator.batchbody.check_body`).
    Raises :class:`BadLine` at the first problem.  Memory: one line (``max_line_bytes``) and :class:`IdSet`."""

    def __init__(self, resolve: Callable[[str], str | None], allowed: Collection[str] | None,
                 max_line_bytes: int = 8 * 1024 * 1024, max_lines: int = MAX_LINES):
        self.resolve, self.allowed, self.max_line_bytes, self.max_lines = resolve, allowed, max_line_bytes, max_lines
        self.lines = 0            # requests
        self.endpoint: str | None = None
        self.endpoint_line = 0
        self.names: dict[str, str] = {}   # model names as written -> the model (only names the fleet serves)
        self.ids = IdSet()
        self.partial = bytearray()
        self.n = 0                # lines read
        self.blank = 0            # the first blank line since the last request (only the last lines may be)

    @property
    def models(self) -> list[str]:
        """The models the file's requests use, in order of first use."""
        return list(dict.fromkeys(self.names.values()))

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if self.partial:
                self.partial += chunk[start:nl]
                raw = bytes(self.partial)
                self.partial.clear()
            else:
                raw = chunk[start:nl]
            self.n += 1
            if len(raw) > self.max_line_bytes:
                raise BadLine(self.n, f"is longer than {self.max_line_bytes} bytes.")
            self._line(raw, self.n)
            start = nl + 1
        if start < len(chunk):
            self.partial += chunk[start:]
            if len(self.partial) > self.max_line_bytes:
                raise BadLine(self.n + 1, f"is longer than {self.max_line_bytes} bytes.")

    def close(self) -> None:
        if self.partial:   # the last line, without its end
            self.n += 1
            self._line(bytes(self.partial), self.n)
            self.partial.clear()
        if not self.lines:
            raise BadFile("The file is empty: a batch file has one request (a JSON object) on each line.")

    def _line(self, raw: bytes, n: int) -> None:
        if not raw.strip():
            self.blank = self.blank or n
            return
        if self.blank:
            raise BadLine(self.blank, "is empty: a batch file has one request on each line.")
        if self.lines >= self.max_lines:
            raise BadLine(n, f"is one request too many: a batch file has at most {self.max_lines}.")
        try:
            req = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:   # also invalid UTF-8, and nesting past orjson's limit
            raise BadLine(n, f"is not valid JSON ({exc}).") from None
        if type(req) is not dict:
            raise BadLine(n, "is not a JSON object.")
        if nests_deeper(raw, req, MAX_LINE_DEPTH):   # vLLM's run-batch refuses about 200 (and one bad line fails a
            raise BadLine(n, f"nests more than {MAX_LINE_DEPTH} levels deep.")   # shard), the gateway past 254
        cid = req.get("custom_id")
        if type(cid) is not str or not cid:
            raise BadLine(n, "`custom_id` must be a non-empty string.")
        first = self.ids.add(cid, n)
        if first:
            raise BadLine(n, f"duplicate `custom_id` {_show(cid)} (also on line {first}).")
        if req.get("method") != "POST":
            raise BadLine(n, f'`method` must be "POST", not {_show(req.get("method"))}.')
        url = req.get("url")
        if url != self.endpoint or url is None:   # (no url on a first line is no url: it matches no endpoint)
            if url not in ENDPOINTS:
                raise BadLine(n, f"`url` must be one of {', '.join(ENDPOINTS)}, not {_show(url)}.")
            if self.endpoint is not None:
                raise BadLine(n, f"`url` is {url} but line {self.endpoint_line}'s is {self.endpoint}: "
                                 "all the requests of a batch go to one endpoint.")
            self.endpoint, self.endpoint_line = url, n
        body = req.get("body")
        if type(body) is not dict:
            raise BadLine(n, "`body` must be a JSON object.")
        name = body.get("model")
        if type(name) is not str or name not in self.names:
            self._model(name, n)
        stream = body.get("stream")   # (vLLM reads 1, "yes", ... as true too; the gateway takes only a boolean)
        if stream and is_bool(stream) and str(stream).lower() not in LAX_FALSE:
            raise BadLine(n, "`body.stream` must not be true: a batch request gets one answer.")
        if stream is not None and type(stream) is not bool:
            raise BadLine(n, f"`body.stream` must be false or absent, not {_show(stream)}.")
        try:
            check_body(url, body)
        except BadBody as exc:
            raise BadLine(n, str(exc)) from None
        self.lines += 1

    def _model(self, name, n: int) -> None:
        if type(name) is not str or not name:
            raise BadLine(n, "`body.model` must name a model.")
        model = self.resolve(name)
        if model is None or self.allowed is not None and model not in self.allowed:
            raise BadLine(n, f"the model `{name}` does not exist or you do not have access to it.")
        self.names[name] = model
