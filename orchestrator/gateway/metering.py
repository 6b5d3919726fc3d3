"""Metering a replica's answer for the request's key: the usage the gateway asks a stream for (and takes out
again when the client did not ask), the usage of a whole answer, of a stream's events, and what a request whose
count never came is charged (a token per event it was sent, its prompt as the replica's ``/tokenize`` counts it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import orjson

from .enginecall import call_engine

if TYPE_CHECKING:
    from .parsing import Parsed

log = logging.getLogger("orchestrator.gateway.server")
USAGE = b'"usage"'
FINISH = b'"finish_reason":"'   # (vLLM's compact JSON: a choice's end, not its null before)

TRUE_WORDS = frozenset({"1", "true", "t", "yes", "y", "on"})


def lax_true(v) -> bool:
    """Whether vLLM's request models (pydantic's lax bool) read ``v`` as true: ``"false"``, ``0``, ``"no"`` are false."""
    return v is True or (type(v) in (int, float) and v == 1) or (isinstance(v, str) and v.lower() in TRUE_WORDS)


STREAM_USAGE = ("/v1/completions", "/v1/chat/completions")   # (resume's COMPLETIONS and CHAT)


def ask_usage(path: str, body: dict, dirty: bool) -> tuple[bool, bool]:
    """Have the replica tell the usage the key is charged even where the client did not ask for it: a stream's
    usage chunk (``stream_options.include_usage``, a real true: vLLM reads "false", 0, "no" as false) or, for
    ``encoding_format: "bytes_only"`` embeddings, the ``metadata`` header of ``"bytes"`` (the same vectors).
    Whether the body changed (was ``dirty`` or is now) and whether that usage is to be taken out of the client's
    answer (the client sees the usage chunk if it asked for it)."""
    if body.get("encoding_format") == "bytes_only":
        body["encoding_format"] = "bytes"
        return True, True
    opts = body.get("stream_options")
    asked = opts.get("include_usage") if isinstance(opts, dict) else None
    if body.get("stream") is True and path in STREAM_USAGE and asked is not True and (opts is None or
                                                                                     isinstance(opts, dict)):
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        if strip := not lax_true(asked):   # (vLLM's continuous usage comes only with include_usage: not asked for)
            body["stream_options"].pop("continuous_usage_stats", None)
        return True, strip
    return dirty, False


WHOLE_PARSE_BYTES = 65536   # a longer answer (embeddings, prompt_logprobs) is not parsed whole on the event loop


def usage_in_body(p: "Parsed", data: bytes) -> None:
    """The top-level ``usage`` of a whole JSON response: a short one parsed whole; in a long one (a 40 MB batch of
    embeddings took 0.2 s to parse, every stream of the process stalled meanwhile) the last ``"usage"`` that is a
    key (``"usage":{``; a prompt token's text ``"usage"`` in ``prompt_logprobs`` after it is a value, and quotes
    inside a text are escaped), and only its object is decoded."""
    if USAGE not in data:
        return
    if len(data) <= WHOLE_PARSE_BYTES:
        try:
            obj = orjson.loads(data)
        except ValueError:
            return
        return take_usage(p, obj.get("usage")) if isinstance(obj, dict) else None
    end = len(data)
    while (at := data.rfind(USAGE, 0, end)) >= 0:
        rest = data[at + 7:at + 4096].decode("utf-8", "replace").lstrip()
        if rest[:1] == ":" and rest[1:].lstrip()[:1] == "{":
            try:
                return take_usage(p, json.JSONDecoder().raw_decode(rest[1:].lstrip())[0])
            except ValueError:
                return
        end = at


def usage_in_metadata(p: "Parsed", meta: str) -> None:
    """The usage in the ``metadata`` header of vLLM's ``encoding_format: "bytes"`` embeddings (their body is the
    vectors): JSON whose ``usage`` comes last, after the layout of every vector; only that object is decoded."""
    at = meta.rfind('"usage"')
    rest = meta[at + 7:].lstrip() if at >= 0 else ""
    if rest[:1] == ":":
        try:
            take_usage(p, json.JSONDecoder().raw_decode(rest[1:].lstrip())[0])
        except ValueError:
            pass


def take_usage(p: "Parsed", usage) -> None:
    """Count a replica's ``usage`` object for the request's key: OpenAI's ``prompt/completion_tokens``, or the
    Responses and Anthropic Messages APIs' ``input/output_tokens``; a number it leaves out stays as it was (a
    Messages stream tells the input tokens first, the output tokens later)."""
    if isinstance(usage, dict):
        pt = usage.get("prompt_tokens", usage.get("input_tokens"))
        ct = usage.get("completion_tokens", usage.get("output_tokens"))
        p.usage = (pt if type(pt) is int else p.usage[0], ct if type(ct) is int else p.usage[1])


def _event_usage(obj: dict):
    """The usage an SSE event's object carries: its own (chat, completions, a Messages ``message_delta``), a
    Responses ``response.completed``'s response's, or a Messages ``message_start``'s message's."""
    usage = obj.get("usage")
    for inner in ("response", "message"):
        if not usage and isinstance(obj.get(inner), dict):
            usage = obj[inner].get("usage")
    return usage


LAST_COUNT = (None, "response.completed", "response.incomplete", "response.failed", "message_delta")
"""The ``type`` of an event whose usage is the request's last count: an OpenAI usage chunk (no type, no choices),
a Responses stream's end (completed, incomplete or failed), a Messages ``message_delta``."""


def meter_events(p: "Parsed", events: bytes) -> bytes:
    """Whole SSE events: take the usage chunk's numbers; drop that chunk when only the gateway wanted it."""
    kept = []
    for ev in events.split(b"\n\n"):
        at = ev.find(b"data:") if USAGE in ev else -1   # (after an `event:` line, in the Responses and Messages APIs)
        if at >= 0 and (at == 0 or ev[at - 1:at] == b"\n"):
            try:
                obj = orjson.loads(ev[at + 5:])
            except ValueError:
                obj = None
            usage = _event_usage(obj) if isinstance(obj, dict) else None
            if usage and obj.get("choices"):   # continuous usage: one prompt's and choice's so far, a floor
                ct = usage.get("completion_tokens") if isinstance(usage, dict) else None
                p.usage = (p.usage[0], max(p.usage[1], ct)) if type(ct) is int else p.usage
            elif usage:
                take_usage(p, usage)
                if not obj.get("choices") and obj.get("type") in LAST_COUNT:
                    p.metered, p.fingerprint = True, obj.get("system_fingerprint") or ""
                if p.strip_usage and obj.get("usage") and not obj.get("choices"):
                    continue
        kept.append(ev)
    return b"\n\n".join(kept)


def finish_held(p: "Parsed", events: bytes, passing: int = 0) -> tuple[bytes, bytes, int]:
    """A stream's whole events to send now, those to hold back, and ``passing`` less the finish events let go:
    vLLM puts its ``system_fingerprint`` on a stream's last chunk when the stream did not ask for usage, else on
    the usage chunk; the gateway asked for it and drops that chunk, so the last chunk waits for it (it comes at
    once) and gets its fingerprint.  ``passing``: the finish events of other choices before the last one (n of
    each prompt of a list end apart: each goes at once, only the last choice's end waits)."""
    if p.fingerprint is not None:   # the usage chunk came (with no fingerprint: vLLM's --fingerprint-mode off)
        return b"\n\n".join(stamp(ev, p.fingerprint) if p.fingerprint and FINISH in ev else ev
                            for ev in events.split(b"\n\n")), b"", passing
    at = events.find(FINISH)
    while at >= 0 and passing:
        at, passing = events.find(FINISH, at + 1), passing - 1
    if at < 0:
        return events, b"", passing
    start = events.rfind(b"\n\n", 0, at) + 2   # where the finish event begins (1: the first one)
    return (events[:start], events[start:], passing) if start > 1 else (b"", events, passing)


def choices(body: dict) -> int | None:
    """How many choices a completion or chat request streams (``n`` of each prompt of a list), None if unsure."""
    n, prompt = body.get("n"), body.get("prompt")
    n = 1 if n is None else n
    prompts = len(prompt) if isinstance(prompt, list) and len(prompt) > 1 and type(prompt[0]) is not int else 1
    return n * prompts if type(n) is int and n >= 1 else None


def stamp(event: bytes, fingerprint: str) -> bytes:
    at = event.find(b"data:")
    try:
        obj = orjson.loads(event[at + 5:])
    except ValueError:
        return event
    return event[:at] + b"data: " + orjson.dumps({**obj, "system_fingerprint": fingerprint}) if isinstance(
        obj, dict) else event


TOKENIZE_CHAT = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                 "chat_template_kwargs", "documents", "add_special_tokens", "mm_processor_kwargs")


def stream_interval(body: dict, vllm_args: Mapping) -> int:
    """The tokens per stream event vLLM sends a request after its first: the larger of the request's
    ``stream_interval`` and its engine's ``--stream-interval`` (1 by default)."""
    k = [body.get("stream_interval"), vllm_args.get("stream-interval")]   # (2.0 is 2 to vLLM)
    if k[0] is None and k[1] is None:   # (nearly every request: the hot path's)
        return 1
    return max([1] + [int(x) for x in k if type(x) in (int, str) and str(x).isdecimal()
                      or type(x) is float and x.is_integer()])


def charge_sent(gw, p: "Parsed", sent: int, slot) -> None:
    """A stream that ended before the replica's count (its client left, its replica failed): its key pays at least
    a token per event it was sent, and its prompt as ``slot``'s replica counts it, once that is known.  With a
    ``stream_interval`` of k (the request's, or its engine's ``--stream-interval``), vLLM sends the first token
    alone (after a chat's role chunk) and k in each event after it, up to the request's ``max_tokens`` a choice."""
    if p.unmetered:   # (a background response's stream: charged when it ends, .stored.follow)
        return
    body = p.body
    k = stream_interval(body, p.pool.model.vllm_args)
    tokens = sent if k == 1 else max(sent, 1 + (sent - 1 - (p.path == "/v1/chat/completions")) * k)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if k > 1 and type(limit) is int:   # (choices: n of each prompt of a list)
        prompt = body.get("prompt")
        many = len(prompt) if isinstance(prompt, list) and prompt and type(prompt[0]) is not int else 1
        tokens = min(tokens, limit * (body.get("n") if type(body.get("n")) is int else 1) * many)
    p.usage = (p.usage[0], max(p.usage[1], tokens))
    if p.usage[0] == 0:
        gw.later(charge_prompt(gw, p, slot))


async def charge_prompt(gw, p: "Parsed", slot) -> None:
    """The prompt tokens of a request its client left before the usage came, counted by the replica's own
    ``/tokenize`` (vLLM's, on by default: a chat's messages, the first 16 texts of a prompt or input) or from the
    token ids it was given, and charged to the request's key after the request ended (what was counted, if the
    gateway stops meanwhile).  What cannot be counted so (a Responses input of items, texts past the 16th, a
    replica that does not answer) is charged a token per 4 bytes of its JSON: a prompt is never free for a
    client that leaves early."""
    b = p.body
    if isinstance(b.get("messages"), list):   # (part, its /tokenize query or None): a chat is its own query
        chat = {"model": p.model, **{k: b[k] for k in TOKENIZE_CHAT if k in b}}
        items: list = [(chat, chat)]
    else:
        whole = b.get("prompt", b.get("input"))   # (a completion's prompt; an embedding's or a response's input)
        parts = [whole] if isinstance(whole, str) or _ids(whole) else whole if isinstance(whole, list) else []
        items = [(x, {"model": p.model, "prompt": x} if isinstance(x, str) and i < 16 else None)
                 for i, x in enumerate(parts)]
    total, guess, done = 0, 0, 0   # (guess: bytes of what is estimated, divided once)
    try:
        for part, query in items:
            count = len(part) if _ids(part) else await tokenized(gw, slot, query) if query is not None else None
            if count is None:
                guess += len(orjson.dumps(part))
            else:
                total += count
            done += 1
    finally:   # (cancelled, at a stop's end: the parts not counted yet are estimated, never free)
        guess += sum(len(orjson.dumps(part)) for part, _ in items[done:])
        if total + guess > 0:
            p.tenant.charge_prompt(p.model, total + -(-guess // 4))


def _ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)


async def tokenized(gw, slot, query: dict) -> int | None:
    """The token count of ``query`` (``/tokenize``'s body) by the slot's engine; None when it cannot say."""
    try:
        _, data = await call_engine(gw.upstream, slot, "/tokenize", query, 10.0)
        count = data.get("count") if isinstance(data, dict) else None
    except BaseException as exc:  # noqa: BLE001 - a replica gone or an engine without it: estimated
        if not isinstance(exc, Exception):
            raise
        log.info("could not count tokens on %s/%s: %s", query.get("model"), slot.label, exc)
        return None
    return count if type(count) is int and count >= 0 else None
