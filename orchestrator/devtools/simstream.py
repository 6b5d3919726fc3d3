"""The simulator's answers in vLLM's shapes (:mod:`orchestrator.devtools.simulator` serves them): a stream's
chunks, its usage chunk and ``[DONE]``, the whole JSON body, and vLLM's end of a request it aborted; and vLLM's
shutdown, which aborts the requests in flight.

JSON as vLLM writes it: compact (``"finish_reason":"abort"``, no spaces: pydantic's ``model_dump_json`` for a
stream's chunks, starlette's ``JSONResponse`` for a whole answer).

vLLM (0.32, ``EngineCore._handle_shutdown``) on SIGTERM with its default ``--shutdown-timeout 0`` aborts every
request in flight; with N > 0 it lets them run for up to N s, then aborts the rest; from the signal on, a
request added is aborted at once.  An aborted stream ends with a chunk whose ``finish_reason`` is "abort"
(empty text, ``token_ids: []``), the usage chunk when asked, and ``[DONE]``; one aborted before its first token
gets no such chunk (vLLM drops an empty chunk then): a chat its role chunk alone, a completion nothing, before
the usage and ``[DONE]``.  A whole answer is a 200 whose choice ends "abort" with the text so far.

A stream's headers go out as vLLM's do: once the request is rendered (``StreamingResponse`` around an async
generator that adds the request to the engine when first read), so its wait in the queue, its prefill and a hung
engine come after them.  With ``--sse-keep-alive-interval N`` (vLLM's ``with_sse_keep_alive``, an integer, 0 off)
a stream idle for N s (queued, prefilling, between tokens, hung) gets a ``: keep-alive`` comment event.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
import uuid

from aiohttp import web

from orchestrator import vllmanswer
from orchestrator.devtools.simengine import SimState

KEEP_ALIVE = b": keep-alive\n\n"   # vLLM's SSE_KEEP_ALIVE_COMMENT
dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=False)


def error_response(status: int, message: str, etype: str = "BadRequestError", param: str | None = None) -> web.Response:
    """vLLM's error body."""
    return web.json_response({"error": {"message": message, "type": etype, "param": param, "code": status}},
                             status=status)


async def json_object(request: web.Request) -> dict | web.Response:
    """A request's JSON object body, or vLLM's 400 for one that is not JSON or not an object."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "invalid JSON body")
    if not isinstance(body, dict):
        return error_response(400, "body must be a JSON object")
    return body


class Answer:
    """One generation request's answer: its id, and its stream (``open`` first) or its whole body.  Its choices
    are its prompts' (several for a completion's list of prompts), ``n`` each: choice ``i`` is prompt ``i // n``'s."""

    def __init__(self, request: web.Request, body: dict, chat: bool, prompts: list[list[int]], include_usage: bool,
                 continuous_usage: bool, keep_alive_s: float, served: str, n: int = 1):
        self.request, self.chat, self.prompts, self.n = request, chat, prompts, n
        self.lock = asyncio.Lock()   # (choices generated at once write their chunks one at a time)
        self.model = served   # vLLM names its first served name, whichever alias was asked
        self.want_ids = bool(body.get("return_token_ids"))  # vLLM's extension: prompt_token_ids and token_ids
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        # vLLM's id: the X-Request-Id header, else the body's request_id, else random (not the engine's own key)
        base = request.headers.get("X-Request-Id")
        if base is None:
            base = body["request_id"] if isinstance(body.get("request_id"), str) else uuid.uuid4().hex
        self.rid = ("chatcmpl-" if chat else "cmpl-") + base
        self.created = int(time.time())
        self.obj = "chat.completion" if chat else "text_completion"
        self.resp: web.StreamResponse | None = None
        self.sent_role = False
        self.keep_alive_s, self.ticker = keep_alive_s, None   # (--sse-keep-alive-interval)
        self.writing, self.last_write = False, 0.0
        self.details, self.cached = False, None   # --enable-prompt-tokens-details; the prompt tokens cached
        # vLLM's --fingerprint-mode full (the default): "vllm-<version>-<8 hex of its config>"
        self.fingerprint = "vllm-0.0.0-" + hashlib.sha256(served.encode()).hexdigest()[:8]

    def usage(self, n: int, prompt: int | None = None, final: bool = False) -> dict:
        """``n`` completion tokens after ``prompt`` tokens (default: every prompt's, each counted once); the
        ``final`` usage (a stream's last, a whole answer's) with the cached prompt tokens when vLLM's would."""
        p = sum(map(len, self.prompts)) if prompt is None else prompt
        out = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
        if final and self.details and self.cached is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out

    # -- a stream ----------------------------------------------------------------------------------------
    def chunk(self, text: str, ids: list[int] | None, finish: str | None, role: bool = False,
              stop_reason: str | int | None = None, index: int = 0) -> dict:
        """A chunk of choice ``index`` with the fields vLLM sets (null ones too): a completion's every field, a
        chat's ``token_ids`` after the role and ``stop_reason`` at the end."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": stop_reason, "prompt_token_ids": None}
        if not role:
            choice["token_ids"] = ids if self.want_ids and ids is not None else None
        out = {"id": self.rid, "object": self.obj + ".chunk" if self.chat else self.obj, "created": self.created,
               "model": self.model, "choices": [choice]}
        if finish is not None and not self.include_usage:   # (vLLM's fingerprint: on the usage chunk when asked)
            out["system_fingerprint"] = self.fingerprint
        return out

    async def open(self) -> None:
        """The stream's headers (vLLM's go before the request joins the engine's queue), and its keep-alives."""
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await self.resp.prepare(self.request)
        self.last_write = time.monotonic()
        if self.keep_alive_s > 0:   # until the stream's end, or its handler's (the client left, the process died)
            ticker = self.ticker = asyncio.create_task(self._keep_alive())
            asyncio.current_task().add_done_callback(lambda _: ticker.cancel())

    async def _keep_alive(self) -> None:
        """vLLM's ``with_sse_keep_alive``: a comment event once the stream has been idle for the interval."""
        try:
            while True:
                await asyncio.sleep(self.keep_alive_s if self.writing else
                                    max(0.0, self.last_write + self.keep_alive_s - time.monotonic()))
                if not self.writing and time.monotonic() - self.last_write >= self.keep_alive_s:
                    await self.write(KEEP_ALIVE)
        except (ConnectionError, RuntimeError):   # the client left, or the stream ended
            pass

    async def write(self, data: bytes) -> None:
        async with self.lock:
            self.writing = True   # (a write held up by a slow client is not idleness: vLLM's wait starts after it)
            try:
                await self.resp.write(data)
            finally:
                self.writing, self.last_write = False, time.monotonic()

    async def send(self, obj: dict) -> None:
        await self.write(b"data: " + dumps(obj).encode() + b"\n\n")

    async def first(self) -> None:
        """Before a stream's first output (of any choice: a token, or an abort): a chat's role chunks, one per
        choice, each with the prompt's ids when asked (vLLM's first iteration); nothing for a completion."""
        if self.sent_role or not self.chat:
            return
        self.sent_role = True
        roles = []
        for i in range(self.n):
            first = self.chunk("", None, None, role=True, index=i)
            first["prompt_token_ids"], first["prompt_text"] = self.prompts[0] if self.want_ids else None, None
            if self.continuous_usage:
                first["usage"] = self.usage(0)
            roles.append(b"data: " + dumps(first).encode() + b"\n\n")
        await self.write(b"".join(roles))   # (one write: no other choice's chunk comes between them)

    async def end(self, n: int) -> web.StreamResponse:
        """The usage chunk (no choices) when asked, then ``[DONE]``, after ``n`` tokens."""
        self.ticker.cancel() if self.ticker else None
        if self.include_usage:
            await self.send({**self.chunk("", None, None), "choices": [], "usage": self.usage(n, final=True),
                             "system_fingerprint": self.fingerprint})
        await self.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp

    async def aborted(self, index: int, n: int) -> None:
        """Choice ``index`` aborted by its engine after ``n`` tokens: its last chunk (none before a first token)."""
        await self.first()
        if n:
            last = self.chunk("", [], "abort", index=index)
            if self.continuous_usage:
                last["usage"] = self.usage(n, len(self.prompts[index // self.n]))
            await self.send(last)

    # -- a whole answer ----------------------------------------------------------------------------------
    def whole(self, choices: list[tuple[int, list[int], str, str, str | int | None, dict | None]],
              prompt_logprobs: list | None = None) -> web.Response:
        """The answer of every choice: (index, token ids, text, finish reason, stop reason, logprobs); each
        prompt's ``prompt_logprobs`` when asked (null otherwise, as vLLM's: a chat's at the top, in a completion's
        choices)."""
        out = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": [],
               "usage": vllmanswer.usage(self.usage(sum(len(c[1]) for c in choices), final=True)),
               "system_fingerprint": self.fingerprint, **vllmanswer.RESPONSE}
        if self.chat:
            out.update(prompt_logprobs=prompt_logprobs[0] if prompt_logprobs else None, **vllmanswer.CHAT_RESPONSE)
        for index, ids, text, reason, stop_reason, logprobs in sorted(choices, key=lambda c: c[0]):
            choice = ({"index": index, "message": {"role": "assistant", "content": text, **vllmanswer.MESSAGE},
                       "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason} if self.chat else
                      {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                       "stop_reason": stop_reason})
            choice.update(vllmanswer.CHOICE)
            # where vLLM puts them (null unless asked): chat's prompt ids at the top, completions' in the choice
            (out if self.chat else choice)["prompt_token_ids"] = \
                self.prompts[index // self.n] if self.want_ids else None
            choice["token_ids"] = ids if self.want_ids else None
            if not self.chat:
                choice["prompt_logprobs"] = prompt_logprobs[index // self.n] if prompt_logprobs else None
            out["choices"].append(choice)
        return web.json_response(out, dumps=dumps)


async def shut_down(state: SimState, timeout_s: float) -> None:
    """vLLM's shutdown (SIGTERM): requests added from now on are aborted at once; those in flight run for up to
    ``timeout_s`` (``--shutdown-timeout``, 0 by default), then are aborted; returns once they have answered."""
    state.shutting_down = True
    deadline = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    n = state.abort()
    print(f"simulator: shutting down, {n} request(s) in flight aborted", flush=True)
    deadline = time.monotonic() + 5.0
    while state.inflight and time.monotonic() < deadline:   # (their ends written)
        await asyncio.sleep(0.01)
