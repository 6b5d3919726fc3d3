"""One generation request in the simulator (``/v1/completions``, ``/v1/chat/completions``): its prompts and
choices through the simulated engine (:mod:`orchestrator.devtools.simengine`), answered in vLLM's shapes
(:mod:`orchestrator.devtools.simstream`).

Several prompts and ``n`` as vLLM 0.32 serves them: a completion's ``prompt`` may be a list of prompts (strings,
or lists of token ids); each prompt has ``n`` choices (vLLM's parallel sampling), and each choice is an engine
request of its own, queued, admitted, prefilled and decoded as a lone request is, choice ``i`` being prompt
``i // n``'s.  With a ``seed`` choice ``j`` samples with ``seed + j`` (vLLM's ``ParentRequest``); without one
the simulator's choices of a request without ``temperature`` use seeds 0, 1, ... (distinct, and deterministic);
``temperature: 0`` with ``n`` above 1 is vLLM's 400 (greedy sampling has one answer).  A stream's chunks carry
one choice each, in the order they are made (a chat's role chunks first, one per choice, and a completion
choice's first chunk its prompt's ids when asked); the usage counts each prompt's tokens once and every
choice's completion tokens, while ``vllm:prompt_tokens_total`` counts a prompt once per choice (each is an
engine request)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterator

from aiohttp import web

from orchestrator.devtools.simcache import CacheFull
from orchestrator.devtools import simlogprobs
from orchestrator.devtools.simengine import (Aborted, RequestError, SimState, max_tokens_of, pause, request_priority,
                                            usage_options)
from orchestrator.devtools.simlogprobs import Logprobs
from orchestrator.devtools.simstop import Stops
from orchestrator.devtools.simstream import Answer, error_response, json_object
from orchestrator.devtools.simvocab import Adapted

MAX_N = 16384   # vLLM's VLLM_MAX_N_SEQUENCES


class Died(Exception):
    """The ``die-mid-stream`` fault cut the connection: the request's other choices stop with it."""


@dataclasses.dataclass(eq=False)
class Seq:
    """One choice: an engine request of its own."""

    index: int
    prompt: list[int]
    max_tokens: int
    tokens: Iterator[int]
    stops: Stops
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)   # (the engine's key)
    n: int = 0                # tokens generated (a stream's, sent)
    reason: str = "length"
    ids: list[int] = dataclasses.field(default_factory=list)   # a whole answer's
    text: str = ""
    lp: Logprobs | None = None   # logprobs asked
    echo: str | None = None      # a completion's echo: its prompt's text
    only_echo: bool = False      # echo with max_tokens 0: the prompt alone (one token generated, not shown)
    logprobs: dict | None = None   # a whole answer's, rendered
    prompt_lp: int | None = None   # prompt logprobs asked (top per position): its prefix cache is not read


def choices_of(body: dict) -> int:
    """``n`` as vLLM reads it (lax integer, None: 1); RequestError (400) as vLLM's."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, (bool, float)) and float(n).is_integer():   # (pydantic's lax int: true is 1, 2.0 is 2)
        n = int(n)
    elif isinstance(n, str) and n.strip().lstrip("+-").isdecimal():
        n = int(n)
    if type(n) is not int:
        raise RequestError("n: Input should be a valid integer", param="n")
    if n < 1:
        raise RequestError(f"n must be at least 1, got {n}.", param="n")
    if n > MAX_N:
        raise RequestError(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
                           "VLLM_MAX_N_SEQUENCES environment variable.", param="n")
    temperature = body.get("temperature")
    if n > 1 and type(temperature) in (int, float) and 0 <= temperature < 1e-5:
        raise RequestError(f"n must be 1 when using greedy sampling, got {n}.", param="n")
    return n


def choice_body(body: dict, j: int, n: int) -> dict:
    """What choice ``j`` of ``n`` samples with (vLLM: ``seed + j``)."""
    if n == 1:
        return body
    seed = body.get("seed")
    if isinstance(seed, float) and seed.is_integer():   # (vLLM reads 7.0 as 7)
        seed = int(seed)
    out = dict(body) if body.get("temperature") else {**body, "temperature": 1.0}   # (no temperature: the
    if type(seed) is int:                                     # simulator's greedy, vLLM's 1.0: choices differ)
        out["seed"] = seed + j
    elif not body.get("temperature"):
        out["seed"] = j   # (deterministic all the same)
    return out


def echo_texts(state: SimState, body: dict, prompts: list[list[int]], want_ids: bool) -> list[str]:
    """What a completion's ``echo`` puts before each prompt's text: the prompt as sent (its ids' text; nothing
    where the ids are returned, as vLLM)."""
    p = body.get("prompt")
    if want_ids:
        return [""] * len(prompts)
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)
    return [state.vocab.text(ids) for ids in prompts]


def prompts_of(state: SimState, body: dict, chat: bool) -> list[list[int]]:
    """The request's prompts' ids: a completion's list of prompts, else its one prompt (ValueError: a 400)."""
    p = body.get("prompt")
    if not chat and isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        return [state.vocab.prompt({**body, "prompt": x}, False) for x in p]
    return [state.vocab.prompt(body, chat)]


async def generate(state: SimState, request: web.Request, chat: bool) -> web.StreamResponse:
    body = await json_object(request)
    if isinstance(body, web.Response):
        return body
    adapter = body.get("model") if body.get("model") in state.adapters else ""   # a LoRA adapter's request
    if body.get("model") and body["model"] not in state.names and not adapter:   # (vLLM serves one without any)
        return error_response(404, f"The model `{body['model']}` does not exist. Valid aliases: "
                              f"{', '.join(state.names)}.", "NotFoundError", "model")
    vocab = Adapted(state.vocab, adapter) if adapter else state.vocab
    try:
        prompts = prompts_of(state, body, chat)
        n = choices_of(body)
        top = simlogprobs.asked(body, chat, state.vocab.size)
        prompt_top = simlogprobs.prompt_asked(body, chat, state.vocab.size)
        echo = not chat and body.get("echo") in simlogprobs.TRUE
        only_echo = echo and body.get("max_tokens") == 0   # (vLLM generates one token for it)
        texts = echo_texts(state, body, prompts, bool(body.get("return_token_ids"))) if echo else None
        seqs = []
        for k, prompt_ids in enumerate(prompts):
            if not prompt_ids and not chat:
                raise RequestError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
            if len(prompt_ids) >= state.max_model_len:
                raise ValueError(f"Input length ({len(prompt_ids)}) exceeds model's maximum context length "
                                 f"({state.max_model_len}).")
            max_tokens = max_tokens_of({**body, "max_tokens": 1} if only_echo else body, chat, len(prompt_ids),
                                       state.max_model_len)
            if type(body.get("min_tokens")) in (int, float) and body["min_tokens"] > max_tokens:
                raise ValueError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                                 f"got {body['min_tokens']}.")
            state.check_fits(prompt_ids)   # (CacheFull, a 400: before a stream's headers)
            seqs += [Seq(k * n + j, prompt_ids, max_tokens,
                         vocab.generate(prompt_ids, max_tokens, choice_body(body, j, n)),
                         Stops(body, state.vocab.eos), lp=None if top is None else Logprobs(vocab, top, chat),
                         echo=texts[k] if texts else None, only_echo=only_echo, prompt_lp=prompt_top)
                     for j in range(n)]
        priority = request_priority(body, request.headers)
        include_usage, continuous_usage = usage_options(body, state.args.enable_force_include_usage)
    except (ValueError, TypeError) as e:
        return error_response(400, str(e), getattr(e, "etype", "BadRequestError"), getattr(e, "param", None))
    state.last_body = body
    t_arrive = time.monotonic()
    ans = Answer(request, body, chat, prompts, include_usage, continuous_usage,
                 state.args.sse_keep_alive_interval, adapter or state.names[0], n)   # (vLLM names the adapter)
    ans.details = state.args.enable_prompt_tokens_details
    stream = bool(body.get("stream"))
    if stream:   # vLLM sends a stream's headers once it is rendered: its queue, prefill or a hang come after
        await ans.open()
    if state.fault == "hang" or not state.cluster_ok:   # a whole answer: no byte at all
        await asyncio.sleep(3600)
    run = Run(state, request, ans, stream, priority, t_arrive, adapter)
    try:
        if len(seqs) == 1:
            await run.seq(seqs[0])
        else:
            try:
                async with asyncio.TaskGroup() as tg:
                    for s in seqs:
                        tg.create_task(run.seq(s))
            except BaseExceptionGroup as eg:   # (the first that says why)
                raise next((e for e in eg.exceptions if isinstance(e, (CacheFull, Died))), eg) from None
    except CacheFull as e:
        return error_response(400, str(e))
    except Died:
        return ans.resp if stream else web.Response(status=500)
    if stream:
        return await ans.end(sum(s.n for s in seqs))
    return ans.whole([(s.index, s.ids, s.text, s.reason, s.stops.reason if s.reason == "stop" else None, s.logprobs)
                      for s in seqs], prompt_logprobs(vocab, prompts, prompt_top))


def prompt_logprobs(vocab, prompts: list[list[int]], k: int | None) -> list[list | None] | None:
    """vLLM's ``prompt_logprobs`` of each prompt (the first position none), when asked."""
    if k is None:
        return None
    return [[None, *(simlogprobs.prompt_position(vocab, ids[:i], ids[i], k) for i in range(1, len(ids)))]
            for ids in prompts]


class Run:
    """The choices of one request through the engine (each as vLLM runs one request)."""

    def __init__(self, state: SimState, request: web.Request, ans: Answer, stream: bool, priority: int,
                 t_arrive: float, adapter: str = ""):
        self.state, self.request, self.ans, self.stream, self.priority = state, request, ans, stream, priority
        self.adapter = adapter   # a LoRA adapter's request: its own blocks in the prefix cache
        self.t_arrive = t_arrive   # (the queue, TTFT and end-to-end times count from the request's arrival)
        self.aborted = state.aborts   # set when the requests in flight are aborted (a shutdown, the abort fault)

    async def seq(self, s: Seq) -> None:
        state, lab, t_arrive = self.state, self.state.labels, self.t_arrive
        state.waiting += 1
        state._sync()
        try:
            if state.shutting_down:   # vLLM's engine aborts a request added during its shutdown at once
                raise Aborted
            adm = await state.admit(s.rid, s.prompt, s.max_tokens, self.priority, self.aborted, s.prompt_lp is None,
                                    self.adapter)
        except Aborted:
            state.c_success.labels(**lab, finished_reason="abort").inc()
            s.reason = "abort"
            if self.stream:
                await self.ans.aborted(s.index, 0)
            return
        finally:
            state.waiting -= 1
            state._sync()
        state.h_queue.labels(**lab).observe(time.monotonic() - t_arrive)
        if self.ans.cached is None:   # (vLLM's num_cached_tokens: the request's first output's)
            self.ans.cached = adm.hit_tokens
        ctx = list(s.prompt)  # prompt + generated so far: what the KV cache holds blocks of
        try:
            if await state.prefill(adm, self.aborted) or await pause(self.aborted, state.args.ttft_s):
                s.reason = "abort"
                if self.stream:
                    await self.ans.aborted(s.index, 0)
                return
            state.h_ttft.labels(**lab).observe(time.monotonic() - t_arrive)
            state.c_prompt.labels(**lab).inc(len(s.prompt))
            await (self._stream(s, ctx) if self.stream else self._whole(s, ctx))
        except (ConnectionResetError, asyncio.CancelledError):
            s.reason = "abort"
            raise
        finally:
            state.release(s.rid)
            state.c_success.labels(**lab, finished_reason=s.reason).inc()
            state.h_e2e.labels(**lab).observe(time.monotonic() - t_arrive)
            state._sync()

    def _generated(self, s: Seq, ctx: list[int], tok: int) -> None:
        """The engine has computed all but the newest token's KV."""
        ctx.append(tok)
        self.state.cache.advance(s.rid, ctx, len(ctx) - 1, len(ctx))
        self.state.publish()

    def _die(self, s: Seq) -> None:
        """The die-mid-stream fault: vanish like a killed process (no final chunk, the socket just closes)."""
        if self.request.transport:
            self.request.transport.abort()
        s.reason = "abort"
        raise Died

    async def _stream(self, s: Seq, ctx: list[int]) -> None:
        state, ans = self.state, self.ans
        delay = 1.0 / state.args.tokens_per_s
        for i, tok in enumerate(s.tokens):
            if state.fault == "die-mid-stream" and i == max(1, s.max_tokens // 2):
                self._die(s)
            await ans.first()
            stopped = s.stops.step(tok, state.vocab.piece(ctx, tok))
            finish = "stop" if tok == state.vocab.eos or stopped else "length" if i == s.max_tokens - 1 else None
            c = ans.chunk(s.stops.delta(finish is not None), [tok], finish, stop_reason=s.stops.reason, index=s.index)
            if s.lp or s.echo is not None:
                self._dress(s, c["choices"][0], ctx, tok, i == 0)
            self._generated(s, ctx, tok)
            if i == 0 and ans.want_ids and not ans.chat:  # completions: in each choice's first chunk
                c["choices"][0]["prompt_token_ids"] = s.prompt
            if ans.continuous_usage:  # usage so far in every chunk
                c["usage"] = ans.usage(i + 1, len(s.prompt))
            await ans.send(c)
            state.c_gen.labels(**state.labels).inc()
            s.n, s.reason = i + 1, finish or s.reason
            if stopped:
                return
            if finish is None:
                await asyncio.sleep(delay)
                if self.aborted.is_set():   # at the engine's next step: its end, a chunk of no text
                    s.reason = "abort"
                    await ans.aborted(s.index, s.n)
                    return
                state.h_itl.labels(**state.labels).observe(delay)

    @staticmethod
    def _dress(s: Seq, choice: dict, ctx: list[int], tok: int, first: bool) -> None:
        """A stream chunk's echo (a completion choice's first chunk: its prompt before its first token, or alone)
        and logprobs."""
        ids = [] if s.only_echo else [tok]
        positions = [s.lp.at(ctx, tok)] if s.lp and ids else []
        if first and s.echo is not None:
            choice["text"] = s.echo + ("" if s.only_echo else choice["text"])
            ids = [*s.prompt, *ids]
            positions = [*(s.lp.prompt(s.prompt) if s.lp else ()), *positions]
        if s.lp:
            choice["logprobs"] = s.lp.render(ids, positions)

    async def _whole(self, s: Seq, ctx: list[int]) -> None:
        state = self.state
        delay = 1.0 / state.args.tokens_per_s
        if state.fault == "die-mid-stream" and self.request.transport:
            self._die(s)
        ids, positions = [], []
        for tok in s.stops.upto(s.tokens, lambda t: state.vocab.piece(ctx, t)):
            if s.lp:
                positions.append(s.lp.at(ctx, tok))
            ids.append(tok)
            self._generated(s, ctx, tok)
        s.reason = "stop" if ids and (ids[-1] == state.vocab.eos or s.stops.reason is not None) else "length"
        t_first = time.monotonic()
        if await pause(self.aborted, delay * max(0, len(ids) - 1)):   # aborted: a 200 all the same, with what
            ids, s.reason = ids[:1 + int((time.monotonic() - t_first) / delay)], "abort"   # it has generated
        state.c_gen.labels(**state.labels).inc(len(ids))
        s.ids = ids
        s.text = s.stops.text if s.stops.active and s.reason != "abort" else state.vocab.text(ids)
        shown, positions = ([], []) if s.only_echo else (ids, positions[:len(ids)])
        if s.echo is not None:   # a completion's echo: the prompt before the text (alone with max_tokens 0)
            s.text = s.echo + ("" if s.only_echo else s.text)
            shown, positions = [*s.prompt, *shown], [*(s.lp.prompt(s.prompt) if s.lp else ()), *positions]
        s.logprobs = s.lp.render(shown, positions) if s.lp else None
