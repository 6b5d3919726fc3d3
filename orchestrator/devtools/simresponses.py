"""vLLM's Responses API in the simulator (``/v1/responses``), with its store as vLLM keeps it.

A request's ``input`` (a string, or messages whose content is a string or ``input_text``/``output_text`` parts)
after its ``instructions`` (a system message) is a chat prompt, generated through the same engine as a chat
completion (``max_output_tokens`` its ``max_tokens``), answered as vLLM answers it: a ``response`` object, or
with ``stream`` its events (``response.created`` ... ``response.output_text.delta`` per token ...
``response.completed``), each with its ``sequence_number``.  The response's id is the body's ``request_id``
when it names one (vLLM's extension), else ``resp_`` and 16 hex digits.

The store, vLLM's (``VLLM_ENABLE_RESPONSES_API_STORE=1`` in the server's environment, read at start), lives in
the server's memory: with it, a response with ``store`` (true by default) is kept with its conversation, so
``GET /v1/responses/{id}`` returns it, ``previous_response_id`` continues it, and ``background`` answers at
once (``queued``) and generates meanwhile, cancelled by ``POST /v1/responses/{id}/cancel``.  A background
response asked as a stream keeps its events: ``GET /v1/responses/{id}?stream=true[&starting_after=N]`` replays
them from the one after sequence number ``N`` and follows the rest until ``response.completed`` (vLLM's event
store; a response that was no background stream: vLLM's stream fails after its 200, the simulator's ends at
once).  Without the store ``store`` is quietly false and ``background`` a 400, as there.  An unknown id is
vLLM's 404.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from aiohttp import web

from orchestrator.devtools.simengine import RequestError, SimState, max_tokens_of, request_priority
from orchestrator.devtools.simstop import Stops
from orchestrator.devtools.simstream import Answer, dumps, error_response, json_object

NO_STORE_BACKGROUND = ("This vLLM engine does not support `store=True` and therefore does not support the background "
                       "mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` "
                       "when launching the vLLM server.")


def lax_true(v) -> bool:
    """pydantic's lax bool, as vLLM's request models read ``background`` and ``stream``."""
    return v is True or (type(v) in (int, float) and v == 1) or (
        isinstance(v, str) and v.lower() in ("1", "true", "t", "yes", "y", "on"))


def store_enabled() -> bool:
    """vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE`` (an integer; 0 by default)."""
    try:
        return bool(int(os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0")))
    except ValueError:
        return False


def not_found(rid: str) -> web.Response:
    return error_response(404, f"Response with id '{rid}' not found.", "invalid_request_error", "response_id")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError("input: content must be a string or a list of parts", param="input")


def messages_of(body: dict) -> list[dict]:
    """The request's own messages: its instructions (a system message) and its input."""
    out = [{"role": "system", "content": body["instructions"]}] if isinstance(body.get("instructions"), str) else []
    inp = body.get("input")
    if isinstance(inp, str):
        return out + [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise RequestError("input: must be a string or a list of input items", param="input")
    for item in inp:
        if not isinstance(item, dict) or item.get("role") not in ("user", "assistant", "system", "developer"):
            raise RequestError("input: each item must be a message with a role", param="input")
        out.append({"role": "system" if item["role"] == "developer" else item["role"],
                    "content": _text(item.get("content"))})
    return out


def usage(prompt: int, n: int, cached: int | None) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0,
                                                             "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                                          "output_tokens_per_turn": [],
                                                          "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + n}


def message(mid: str, text: str | None, done: bool) -> dict:
    content = [] if text is None else [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
    return {"id": mid, "content": content, "role": "assistant", "status": "completed" if done else "in_progress",
            "type": "message", "phase": None}


class Responses:
    """The store and the routes."""

    def __init__(self, state: SimState):
        self.state, self.enabled = state, store_enabled()
        self.stored: dict[str, dict] = {}          # id -> the response object
        self.conversations: dict[str, list] = {}   # id -> its messages, its answer last (previous_response_id)
        self.background: dict[str, asyncio.Task] = {}
        self.events: dict[str, tuple[list[tuple[str, bytes]], asyncio.Event]] = {}   # a background stream's

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{rid}", self.retrieve)
        app.router.add_post("/v1/responses/{rid}/cancel", self.cancel)

    def _object(self, rid: str, body: dict, status: str, output: list, use: dict | None, reason: str | None) -> dict:
        return {"id": rid, "created_at": int(time.time()),
                "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": self.state.names[0],
                "object": "response", "output": output, "parallel_tool_calls": True,
                "temperature": body.get("temperature", 1.0), "tool_choice": "none", "tools": [],
                "top_p": body.get("top_p", 1.0), "background": bool(body.get("background")),
                "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
                "previous_response_id": body.get("previous_response_id"), "prompt": None, "reasoning": None,
                "service_tier": "auto", "status": status, "text": None, "top_logprobs": None, "truncation": "disabled",
                "usage": use, "user": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
                "output_messages": None}

    async def create(self, request: web.Request) -> web.StreamResponse:
        state = self.state
        body = await json_object(request)
        if isinstance(body, web.Response):
            return body
        if body.get("model") and body["model"] not in state.names:
            return error_response(404, f"The model `{body['model']}` does not exist.", "NotFoundError", "model")
        background, stream = lax_true(body.get("background")), lax_true(body.get("stream"))
        if background and body.get("store", True) is False:
            return error_response(400, "background can only be used when `store` is true", "invalid_request_error",
                                  "background")
        store = body.get("store", True) is not False and self.enabled
        if body.get("store", True) is not False and background and not self.enabled:
            return error_response(400, NO_STORE_BACKGROUND, "invalid_request_error", "background")
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.stored:
            return not_found(str(prev))
        try:
            msgs = [*(self.conversations.get(prev, []) if prev else []), *messages_of(body)]
            prompt = state.vocab.prompt({"messages": msgs}, True)
            max_tokens = max_tokens_of({"max_tokens": body.get("max_output_tokens")}, True, len(prompt),
                                       state.max_model_len)
            priority = request_priority(body, request.headers)
            gen = state.vocab.generate(prompt, max_tokens, body)
            stops = Stops({}, state.vocab.eos)
        except (ValueError, TypeError) as e:
            return error_response(400, str(e), getattr(e, "etype", "BadRequestError"), getattr(e, "param", None))
        rid = body["request_id"] if isinstance(body.get("request_id"), str) else f"resp_{uuid.uuid4().hex[:16]}"
        from orchestrator.devtools.simgen import Run, Seq   # (simgen serves the chat routes: it imports no route)
        seq = Seq(0, prompt, max_tokens, gen, stops)
        ans = (ResponseEvents if stream else Answer)(request, {}, True, [prompt], False, False, 0, state.names[0])
        mid = f"msg_{uuid.uuid4().hex[:16]}"

        def final(text: str, reason: str, n: int) -> dict:
            status = "incomplete" if reason == "length" else "completed"
            out = self._object(rid, body, status, [message(mid, text, True)], usage(len(prompt), n, ans.cached), reason)
            if store and self.stored.get(rid, {}).get("status") != "cancelled":
                self.stored[rid], self.conversations[rid] = out, [*msgs, {"role": "assistant", "content": text}]
            return out

        async def run() -> None:
            state.inflight += 1
            try:
                await Run(state, request, ans, stream, priority, time.monotonic()).seq(seq)
            finally:
                state.inflight -= 1

        async def whole() -> dict:
            await run()
            return final(seq.text, seq.reason, len(seq.ids))

        async def streamed() -> web.StreamResponse:
            await run()
            return await ans.end(seq.n)

        if background:   # stored at once, queued until it ends (vLLM's); its client leaving does not stop it
            self.stored[rid] = self._object(rid, body, "queued", [], None, None)
        if stream:
            ans.setup(self._object(rid, body, "in_progress", [], None, None), mid, final)   # (vLLM's, background too)
            if background:
                ans.log = self.events[rid] = ([], asyncio.Event())
            await ans.open()
            if not background:
                return await streamed()
        elif not background:
            return web.json_response(await whole(), dumps=dumps)
        self.background[rid] = task = asyncio.get_running_loop().create_task(streamed() if stream else whole())
        task.add_done_callback(lambda _: self.background.pop(rid, None))
        if stream:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():   # (its client left)
                    raise
                await asyncio.Event().wait()   # vLLM's: a cancelled background response's stream never ends
        return web.json_response(self.stored[rid], dumps=dumps)

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["rid"]
        if rid not in self.stored:
            return not_found(rid)
        if not lax_true(request.query.get("stream", False)):
            return web.json_response(self.stored[rid], dumps=dumps)
        try:
            after = request.query.get("starting_after")
            i = 0 if after is None else int(after) + 1
        except ValueError:
            return error_response(422, "starting_after: Input should be a valid integer", "Bad Request",
                                  "starting_after")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        log, signal = self.events.get(rid, ([("response.completed", b"")], asyncio.Event()))
        while True:   # (vLLM's replay: the events after ``starting_after``, then each new one, to the end)
            signal.clear()
            while i < len(log):
                kind, data = log[i]
                await resp.write(data)
                if kind == "response.completed":
                    await resp.write_eof()
                    return resp
                i += 1
            await signal.wait()

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        got = self.stored.get(rid)
        if got is None:
            return not_found(rid)
        if got["status"] not in ("queued", "in_progress"):
            return error_response(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
        self.stored[rid] = got = {**got, "status": "cancelled"}
        if task := self.background.get(rid):
            task.cancel()
        return web.json_response(got, dumps=dumps)


class ResponseEvents(Answer):
    """A streamed response: the chat generation's chunks as the Responses API's events."""

    def setup(self, created: dict, mid: str, final) -> None:
        self.created_obj, self.mid, self.final = created, mid, final
        self.seqno, self.text, self.reason, self.begun, self.gone = 0, "", "length", False, False
        self.log: tuple[list[tuple[str, bytes]], asyncio.Event] | None = None   # a background stream's events

    async def write(self, data: bytes) -> None:
        """A background response's stream goes on without its client (vLLM's): writes after it left are dropped."""
        if self.gone:
            return
        try:
            await super().write(data)
        except (ConnectionError, RuntimeError):
            self.gone = True

    async def event(self, kind: str, **fields) -> None:
        data = {**fields, "sequence_number": self.seqno, "type": kind}
        self.seqno += 1
        raw = f"event: {kind}\ndata: {dumps(data)}\n\n".encode()
        if self.log is not None:
            self.log[0].append((kind, raw))
            self.log[1].set()
        await self.write(raw)

    async def first(self) -> None:
        if self.begun:
            return
        self.begun = True
        await self.event("response.created", response=self.created_obj)
        await self.event("response.in_progress", response=self.created_obj)
        await self.event("response.output_item.added", item=message(self.mid, None, False), output_index=0)
        await self.event("response.content_part.added", content_index=0, item_id=self.mid, output_index=0,
                         part={"annotations": [], "text": "", "type": "output_text", "logprobs": []})

    def chunk(self, text: str, ids, finish, role: bool = False, stop_reason=None, index: int = 0) -> dict:
        if finish is not None:
            self.reason = finish
        return {"delta": text, "choices": [{}]}

    async def send(self, obj: dict) -> None:
        if obj["delta"]:
            self.text += obj["delta"]
            await self.event("response.output_text.delta", content_index=0, delta=obj["delta"], item_id=self.mid,
                             logprobs=[], output_index=0)

    async def aborted(self, index: int, n: int) -> None:
        await self.first()
        self.reason = "abort"

    async def end(self, n: int) -> web.StreamResponse:
        await self.first()
        self.ticker.cancel() if self.ticker else None
        part = {"annotations": [], "text": self.text, "type": "output_text", "logprobs": None}
        await self.event("response.output_text.done", content_index=0, item_id=self.mid, logprobs=[], output_index=0,
                         text=self.text)
        await self.event("response.content_part.done", content_index=0, item_id=self.mid, output_index=0, part=part)
        await self.event("response.output_item.done", item=message(self.mid, self.text, True), output_index=0)
        await self.event("response.completed", response=self.final(self.text, self.reason, n))
        if not self.gone:
            await self.resp.write_eof()
        return self.resp
