"""A resumable generation's state and its client-facing rendering: the events a replica sent (text, token
ids, usage), turned into the chunks and the whole answer the client expects, and the ``/v1/completions`` body
that asks another replica for the rest (:mod:`.resume` runs the moves)."""

from __future__ import annotations

import dataclasses
import hashlib
import time

from .. import vllmanswer

# options a continuation keeps; everything else (messages, stream settings, ...) is rebuilt
CARRY = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "seed",
         "skip_special_tokens", "spaces_between_special_tokens", "repetition_penalty", "presence_penalty",
         "frequency_penalty", "priority", "include_stop_str_in_output", "allowed_token_ids",
         "logit_bias", "user", "cache_salt", "vllm_xargs", "logits_processors", "watermarking", "stream_interval")
# options whose answer a continuation cannot rebuild (what the client gets beyond text and token ids, or a
# constraint the seam would break: a stop string across it, a grammar's state, a repetition window)
NOT_RESUMABLE = ("stop", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "logprob_token_ids", "tools",
                 "functions", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs", "suffix", "use_beam_search", "prompt_embeds", "mm_processor_kwargs",
                 "multi_modal_data", "mm_payload", "return_mm_kwargs", "bad_words", "return_prompt_text",
                 "return_token_offsets", "routed_experts_prompt_start", "kv_transfer_params", "ec_transfer_params",
                 "repetition_detection", "thinking_token_budget")
# those of them typed bool by vLLM, so that false is off; the others' false reads as 0 (``logprobs: false`` on
# /v1/completions asks for the sampled token's logprob, ``prompt_logprobs: false`` for the prompt's)
OFF_WHEN_FALSE = frozenset({"echo", "use_beam_search", "return_prompt_text", "return_token_offsets",
                            "return_mm_kwargs"})


NOT_RESUMABLE_SET = frozenset(NOT_RESUMABLE)


def output_penalised(d) -> bool:
    """A presence or frequency penalty other than 0 in ``d`` (a request, or a generation config's defaults for every
    request): vLLM counts them on the output alone, and a continuation's output starts empty at the cut."""
    return d.get("presence_penalty") not in (None, 0) or d.get("frequency_penalty") not in (None, 0)


def resumable_fields(body: dict, chat: bool) -> bool:
    """No option of the request asks for what a continuation cannot rebuild (a chat's ``logprobs`` is a bool)."""
    asked = NOT_RESUMABLE_SET.intersection(body)   # (the body's few keys, not all thirty; mostly none)
    return not asked or not any(body[k] is not None and not (body[k] is False and (k in OFF_WHEN_FALSE or chat and
                                                                                 k == "logprobs")) for k in asked)


@dataclasses.dataclass(slots=True)
class Spec:
    """How one request is resumed: what the client asked, and what the replica is asked instead."""

    chat: bool
    stream: bool            # the client asked for a stream
    want_ids: bool          # the client asked for return_token_ids itself
    want_usage: bool        # the client asked for the usage chunk
    continuous: bool        # ... and for the usage so far in every chunk (continuous_usage_stats)
    max_tokens: int | None
    body: dict              # the original request


ABORT = "abort"   # vLLM's finish_reason for a request its engine aborted (shutting down: SIGTERM, --shutdown-timeout 0)


class Break(Exception):
    """The replica's stream ended before its generation did: ``cause`` labels the migration metric (reset, eof,
    timeout, engine_error, drain, abort)."""

    def __init__(self, cause: str, nxt=None):
        self.cause = cause
        self.nxt = nxt   # (lease, response) the rest already continues on (a drain moves only then)


class Refused(Exception):
    """The engine answered the request with a client error event (``obj``): no replica failed, nothing moves."""

    def __init__(self, obj: dict):
        self.obj = obj


class Stitch:
    """What a resumable generation produced so far, and its client-facing rendering."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.id = self.model = None
        self.created = 0
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.text: list[str] = []
        self.finish: str | None = None
        self.stop_reason = None
        self.prompt_tokens: int | None = None
        self.sent_role = False
        self.role = "assistant"   # a chat's, as its replica said it (vLLM's --response-role, or the last message's)
        self.ids_seen = True   # every chunk carried its token ids (else the engine hides them: no resume)
        self.aborted = False   # the last event's choice ended "abort": the engine stopped it, the rest must move
        self.fingerprint = None   # vLLM's system_fingerprint (on its usage chunk: the gateway always asks for it)
        self.held: dict | None = None   # the client's last chunk, until the fingerprint it carries is known
        self.pending: list[int] = []    # token ids whose text has not come yet (see take)
        self.pending_fields: dict = {}  # ... and what else their chunks carried for the client (the prompt's ids)
        self.sent_prompt_ids = False    # the client (which asked for token ids) has the prompt's
        self.details: dict | None = None   # the final usage's prompt_tokens_details (--enable-prompt-tokens-details)
        self.late = False   # its answer, not streamed, was not whole within the request's time (see resume._due)
        self.merged = 0     # ids of the last event if it carried several and text (vLLM merges events under load)
        self.back = 0       # the last ids that are half a character: the next replica makes them again (.seam)
        self.resent: list[int] = []   # ... which the client already has (its token_ids skip them when made again)
        self.last: list[dict] = []   # a finish chunk the gateway made (ran_out), sent before the ending's
        self.reasoning: dict[str, list[str]] = {}   # a chat's reasoning deltas by their field (see _thought)

    # -- reading the replica's events --------------------------------------------------------------------
    def take(self, obj: dict, continuation: bool) -> list[dict]:
        """One event from the replica; the events to show the client (already in the client's shape)."""
        if "error" in obj and not obj.get("choices"):
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            if type(err.get("code")) is int and 400 <= err["code"] < 500:
                raise Refused(obj)   # the engine refused the request (a bad prompt): the client's error
            raise Break("engine_error")
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created", int(time.time())), obj.get("model")
        if obj.get("system_fingerprint"):
            self.fingerprint = obj["system_fingerprint"]
        usage = obj.get("usage")
        if usage and not continuation and usage.get("prompt_tokens") is not None:
            self.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") if usage else None
        if isinstance(details, dict) and (not continuation or self.details is None):
            self.details = self._details(details, continuation)
        if self.prompt_ids is None and obj.get("prompt_token_ids") is not None:
            self.prompt_ids = list(obj["prompt_token_ids"])
        out = []
        for ch in obj.get("choices") or ():
            if self.prompt_ids is None and ch.get("prompt_token_ids") is not None:
                self.prompt_ids = list(ch["prompt_token_ids"])
            ids, thought = ch.get("token_ids"), False
            if "text" in ch:
                piece = ch.get("text")
            else:
                delta = ch.get("delta") or {}
                piece = delta.get("content")
                if "reasoning" in delta or "reasoning_content" in delta:
                    thought = self._thought(delta)
            if ids and piece:   # (a cut is looked at again after new tokens with text; those without wait, and go
                self.merged, self.back = len(ids) if len(ids) > 1 else 0, 0   # at a cut: .seam looks behind them)
            if ids and not (piece or thought) and (ch.get("finish_reason") is None or ch["finish_reason"] == ABORT):
                # tokens of half a character (an emoji's bytes): shown with the text that completes them; a break
                # before it cuts the continuation before them (a prompt ending in half a character makes vLLM's
                # detokenizer answer with the whole prompt's text)
                if ch.get("finish_reason") is None:
                    self.pending += ids
                    self.pending_fields.update((k, ch[k]) for k in ("prompt_token_ids",) if k in ch)   # (the first
                    if "role" in (ch.get("delta") or {}):                                           # chunk's)
                        self.pending_fields["delta"] = {"role": ch["delta"]["role"]}
                    continue
                ids, ch = [], {**ch, "token_ids": []}
            if self.pending:
                if ch.get("finish_reason") == ABORT and not piece:
                    self.pending = []
                elif ids is not None:
                    ids, self.pending = self.pending + list(ids), []
                    held, self.pending_fields = self.pending_fields, {}
                    delta = {**held.pop("delta", {}), **(ch.get("delta") or {})} if "delta" in ch or "delta" in held \
                        else None
                    ch = {**held, **ch, "token_ids": ids, **({"delta": delta} if delta is not None else {})}
            if ids:
                self.ids += ids
                if self.resent:
                    ids = self._not_resent(ids)
            elif ids is None and piece:
                self.ids_seen = False
            if piece:
                self.text.append(piece)
            if ch.get("finish_reason") == ABORT:   # not the generation's end: the client sees what it carried, if
                self.aborted = True                # anything, without that finish_reason (the caller moves the rest)
                if piece or ids or thought or "role" in (ch.get("delta") or {}):
                    ch = {k: v for k, v in ch.items() if k != "stop_reason"}
                    out.append(self._client_chunk({**ch, "finish_reason": None}, ids, piece, continuation))
                continue
            chunk = self._client_chunk(ch, ids, piece, continuation)
            if ch.get("finish_reason"):
                self.finish, self.stop_reason = ch["finish_reason"], ch.get("stop_reason")
                if not self.spec.want_usage:   # vLLM puts its fingerprint on the last chunk then (and on the
                    self.held = chunk          # usage chunk when that is asked): it comes in the usage chunk after
                    continue
            out.append(chunk)
        return out   # a usage chunk shows nothing now: the client's comes at the end, with every token counted

    def _client_chunk(self, ch: dict, ids, piece, continuation: bool) -> dict:
        spec = self.spec
        if spec.chat and not continuation:
            choice = {k: v for k, v in ch.items() if k != "token_ids" or spec.want_ids}
            if "role" in (ch.get("delta") or {}):
                self.sent_role, self.role = True, ch["delta"]["role"] or self.role
        elif spec.chat:
            delta = {"content": piece or ""}
            if not self.sent_role:
                delta = {"role": self.role, **delta}
                self.sent_role = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": ch.get("finish_reason")}
            if ch.get("stop_reason") is not None:   # (as vLLM's own chat chunks carry it)
                choice["stop_reason"] = ch["stop_reason"]
            if spec.want_ids:
                choice["token_ids"] = ids
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": ch.get("finish_reason")}
            if ch.get("stop_reason") is not None:
                choice["stop_reason"] = ch["stop_reason"]
            if spec.want_ids:
                choice["token_ids"] = ids
                if self.prompt_ids is not None and not self.sent_prompt_ids:   # (its first chunk's, as vLLM's; one
                    choice["prompt_token_ids"] = self.prompt_ids               # held, then cut: the next one's)
                    self.sent_prompt_ids = True
        chunk = {"id": self.id, "object": "chat.completion.chunk" if spec.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice]}
        if spec.want_ids and spec.chat and self.prompt_ids is not None and not self.sent_prompt_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
            self.sent_prompt_ids = True
        if spec.continuous:   # (as vLLM's chunks carry it)
            chunk["usage"] = self.usage(final=False)
        return chunk

    def _thought(self, delta: dict) -> bool:
        """A reasoning delta (vLLM's reasoning parser: ``reasoning``, older vLLM's ``reasoning_content``) of a
        model whose config did not show one (:func:`.genconfig.generation_limits`): the client gets it as it came
        (a whole answer too), and the generation is no longer continued (a continuation's text would come without
        its split: a break ends it with the error of a stream that cannot go on).  Whether it had any text."""
        got = False
        for k in ("reasoning", "reasoning_content"):
            if delta.get(k):
                self.reasoning.setdefault(k, []).append(delta[k])
                got = True
        return got

    def _not_resent(self, ids: list[int]) -> list[int]:
        """The ids of a continuation's event that the client does not have yet: the ones made again after a cut
        that went back (``resent``), the same as before (greedy), are not shown twice; one made otherwise (a
        sample) ends the skipping (the client then has the ids it got before too)."""
        j = 0
        while j < len(ids) and j < len(self.resent) and ids[j] == self.resent[j]:
            j += 1
        self.resent = self.resent[j:] if j == len(ids) else []
        return ids[j:]

    def cut(self) -> None:
        """A break: the tokens of half a character the last replica sent go (the next replica makes them again),
        with what their chunks carried for the client, and so do the last ``back`` ids (the client has those)."""
        self.pending.clear()
        self.pending_fields.clear()
        if self.back:
            self.resent = self.ids[-self.back:]
            del self.ids[-self.back:]
        self.merged = self.back = 0

    # -- what the client gets at the end -----------------------------------------------------------------
    def usage(self, final: bool = True) -> dict:
        """The client's usage: every generated token, against its own prompt; the final one (not a chunk's
        continuous stats) with the engine's ``prompt_tokens_details`` when it sent them."""
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt_ids or ())
        out = {"prompt_tokens": prompt, "completion_tokens": len(self.ids), "total_tokens": prompt + len(self.ids)}
        if final and self.details is not None:
            out["prompt_tokens_details"] = self.details
        return out

    def _details(self, details: dict, continuation: bool) -> dict:
        """The prompt's details as the first replica counted them; a continuation's (its prompt holds the tokens
        generated before the cut) only when the first replica's never came, its cached tokens at most the client's
        prompt's."""
        if not continuation:
            return details
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt_ids or ())
        cached = details.get("cached_tokens")
        return {**details, "cached_tokens": min(cached, prompt)} if type(cached) is int else details

    def ran_out(self, max_model_len: int = 0) -> bool:
        """Every token the request asked for came, or its context (``max_model_len``, its replica's) is full, and
        then the stream broke before its end (vLLM aborted it on its last token, at its shutdown): the generation
        is complete, as vLLM ends it, with ``length``."""
        left = self.left()
        if max_model_len and self.prompt_ids is not None:   # (the context's end, under a larger max_tokens too: vLLM
            room = max_model_len - len(self.prompt_ids) - len(self.ids)   # lowers that to fit, and a continuation
            left = room if left is None else min(left, room)              # asking for 0 tokens is a 400)
        if self.finish is not None or not self.ids or left is None or left > 0:
            return False
        self.finish = "length"
        chunk = self._client_chunk({"finish_reason": "length"}, [], "", True)
        if self.spec.want_usage:
            self.last.append(chunk)
        else:
            self.held = chunk
        return True

    def ending(self) -> list[dict]:
        """A stream's last chunks: its finish chunk, or the usage chunk the client asked for, with the fingerprint."""
        if self.held is not None:
            last = self.held
        elif self.spec.want_usage:
            last = {"id": self.id, "object": "chat.completion.chunk" if self.spec.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}
        else:
            return []
        return [*self.last, {**last, "system_fingerprint": self.fingerprint} if self.fingerprint else last]

    def whole(self) -> dict:
        """The non-streamed response, as vLLM writes one (its model, dumped whole: every field, null or not)."""
        text, ids = "".join(self.text), self.ids if self.spec.want_ids else None
        prompt_ids = self.prompt_ids if self.spec.want_ids else None
        if self.spec.chat:
            choice = {"index": 0, "message": {"role": self.role, "content": text, **vllmanswer.MESSAGE,
                                              **{k: "".join(v) for k, v in self.reasoning.items()}},
                      "logprobs": None, "finish_reason": self.finish, "stop_reason": self.stop_reason,
                      "token_ids": ids, **vllmanswer.CHOICE}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish,
                      "stop_reason": self.stop_reason, "token_ids": ids, "prompt_logprobs": None,
                      "prompt_token_ids": prompt_ids, **vllmanswer.CHOICE}
        out = {"id": self.id, "object": "chat.completion" if self.spec.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice],
               "system_fingerprint": self.fingerprint or None, "usage": vllmanswer.usage(self.usage()),
               **vllmanswer.RESPONSE}
        if self.spec.chat:
            out.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, **vllmanswer.CHAT_RESPONSE)
        return out

    # -- the continuation --------------------------------------------------------------------------------
    def continuation_body(self, model: str) -> dict | None:
        """The /v1/completions body that produces the rest, or None when it cannot (no token ids)."""
        if self.prompt_ids is None or not self.ids_seen or self.reasoning:
            return None
        body = {k: self.spec.body[k] for k in CARRY if k in self.spec.body}
        # what is left of the client's max_tokens; a chat without one runs to the end of the context, as on the
        # first replica: None here, the replica's max_model_len once it is chosen (vLLM clamps that to the context
        # left; a larger number is a 400, and a completion without max_tokens, or with null, stops at 16)
        ids = self.ids[:len(self.ids) - self.back]   # (from before half a character: see .seam)
        body["max_tokens"] = None if self.spec.max_tokens is None else self.spec.max_tokens - len(ids)
        min_tokens = self.spec.body.get("min_tokens")
        if type(min_tokens) in (int, float) and min_tokens > 0 and float(min_tokens).is_integer():   # (5.0 too,
            body["min_tokens"] = max(0, int(min_tokens) - len(ids))                     # as vLLM reads it)
        seed = self.spec.body.get("seed")
        if type(seed) is int:   # vLLM draws a seeded request's noise from a generator seeded when it starts: the
            # same seed again would replay the answer's first draws after the seam (a sample pulled towards its
            # opening); one of its own per cut point, the same again for the same cut
            digest = hashlib.sha256(f"{seed}:{len(ids)}".encode()).digest()
            body["seed"] = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
        asked = self.spec.body.get("model")   # (the served name for an alias, as renamed; a LoRA adapter's own)
        body.update(model=asked if type(asked) is str and asked else model, prompt=self.prompt_ids + ids,
                    stream=True, return_token_ids=True, stream_options={"include_usage": True})
        return body

    def left(self) -> int | None:
        return None if self.spec.max_tokens is None else self.spec.max_tokens - len(self.ids)
