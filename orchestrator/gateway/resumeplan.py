"""Which requests a replica's death can be continued from (see :mod:`.resume`), what the replica is asked for so
that they can be (the request's :class:`~.stitch.Spec` and the body sent upstream), and where they may go on."""

from __future__ import annotations

from ..config import ModelConfig
from .metering import lax_true, stream_interval
from .stitch import Spec, output_penalised, resumable_fields

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETIONS_MAX_TOKENS = 16   # vLLM's max_tokens of a /v1/completions request without one


def _text_only(messages) -> bool:
    """Every message's content is text (a string, or parts of type ``text``)."""
    return isinstance(messages, list) and not any(
        isinstance(c := m.get("content") if isinstance(m, dict) else None, list)
        and any(not isinstance(x, dict) or x.get("type") != "text" for x in c) for m in messages)


def plan(path: str, body: dict, model: ModelConfig,
         limits: tuple[int | None, int | None] | None = (None, None)) -> tuple[Spec, dict] | None:
    """A resumable request's spec and the body to send the replica, or None to proxy it as it is.  ``limits``:
    the model's generation config's default max_tokens and cap, None for a model whose generations are not
    continued (:func:`.genconfig.generation_limits`)."""
    r = model.resume
    if not r.enabled or (path != COMPLETIONS and path != CHAT) or limits is None:
        return None
    chat = path == CHAT
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or not resumable_fields(body, chat):
        return None
    if output_penalised(body):
        return None
    seed, least = body.get("seed"), body.get("min_tokens")   # (vLLM reads 7.0 and "7" as 7: what a continuation
    if seed is not None and type(seed) is not int or least is not None and not (   # carries of them is worked out
            type(least) is int or type(least) is float and least.is_integer()):   # on numbers, its seed on ints)
        return None
    if stream_interval(body, model.vllm_args) > 1:   # an event of several tokens may end in half a character (its
        return None   # text held back, its id not): a cut there would hand the next replica a prompt that ends mid-way
    if chat and not _text_only(body.get("messages")):
        return None   # (an image's or audio's placeholder tokens are in the prompt's ids, not the data behind them)
    if not chat:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
                all(type(t) is int for t in prompt) or (len(prompt) == 1 and isinstance(prompt[0], str))))):
            return None
    stream = bool(body.get("stream"))
    if not stream and (not r.unstreamed or body.get("stream_options") is not None):
        return None   # (stream_options without stream: the engine's own 400, as without resume)
    opts = body.get("stream_options")
    opts = opts if isinstance(opts, dict) else {}
    limit = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else \
        body.get("max_tokens")
    if limit is None:   # a chat's: the generation config's, else the context left; a completion's (null too): 16
        limit = limits[0] if chat else COMPLETIONS_MAX_TOKENS
    if type(limit) is float and limit.is_integer():
        limit = int(limit)   # (the engine takes 50.0 as 50)
    if limit is not None and type(limit) is not int:
        return None
    if limits[1] is not None:   # the engine caps every request's at the generation config's (in total: so here)
        limit = limits[1] if limit is None else min(limit, limits[1])
    usage = stream and lax_true(opts.get("include_usage"))
    spec = Spec(chat, stream, lax_true(body.get("return_token_ids")), usage,
                usage and lax_true(opts.get("continuous_usage_stats")), limit, body)
    return spec, {**body, "stream": True, "return_token_ids": True, "stream_options": {**opts, "include_usage": True}}


class Elsewhere(set):
    """The replicas a generation may not go on on: those it was on (the set's own job ids), and, live, those
    whose engine is not the one it began on (:attr:`~orchestrator.contract.Replica.engine`): during a roll that
    changes the model, its weights or engine arguments, the new replicas would read its token ids as other text,
    or another model would finish it.  A replica whose engine is not known ("") is no other."""

    def __init__(self, pool, engine: str, tried: set[str]):
        super().__init__(tried)
        self.pool, self.engine = pool, engine

    def __contains__(self, job_id) -> bool:
        if set.__contains__(self, job_id):
            return True
        slot = self.pool.slots.get(job_id) if self.engine else None
        return slot is not None and bool(slot.replica.engine) and slot.replica.engine != self.engine

    def __bool__(self) -> bool:   # (the pool looks only when a request excludes any)
        return True
