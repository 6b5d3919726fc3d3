"""A model's own gateway limits (``models[].gateway``): timeouts and its queue, over ``gateway``'s for its
requests, so a reasoning model's long answers and an embedding model's short ones each get theirs."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from .keys import GatewayConfig, Strict
from .yamlsrc import Problem, Source


class ModelGateway(Strict):
    """Each unset (the default) is ``gateway``'s setting of the same name; a reload applies them to the next
    request (a request already waiting in the queue keeps reading its model's ``queue_timeout_s``)."""

    request_timeout_s: float | None = Field(None, gt=0)
    """A replica's whole answer is due within this long, except a stream's after its first bytes."""
    first_byte_timeout_s: float | None = Field(None, gt=0)
    """A replica that sends no response headers within this long is treated as hung (retried elsewhere)."""
    stream_idle_timeout_s: float | None = Field(None, gt=0)
    """A stream fails after this long without a byte from its replica (while its client keeps up)."""
    queue_timeout_s: float | None = Field(None, ge=0)
    """How long a request waits in the gateway for a replica with room (a cold start: ``cold_start_hold_s``)."""
    max_queue: int | None = Field(None, ge=0)
    """Requests waiting in each gateway process for a replica, at most (``gateway.max_queue_per_model``)."""
    fallbacks: list[str] = Field(default_factory=list)
    """Other models (served names or aliases), in order, that take a request this model cannot: its wait for a
    replica ended without one (``queue_timeout_s``; a cold start's ``cold_start_hold_s``), its queue is full, or
    none will come (blocked, pinned at 0).  The first with a READY replica that the key may use takes it; when
    it cannot either (its own wait, its queue full), the next one (not a fallback's own fallbacks); not for
    batch lines nor multipart (audio) requests.  Each serves the same kind of request as this model
    (generations, or pooling: ``vllm_args`` ``runner: pooling``, a ``convert``, a pooling ``task``)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What holds for one model's requests: its own setting, else the gateway's."""

    request_timeout_s: float
    first_byte_timeout_s: float
    stream_idle_timeout_s: float
    queue_timeout_s: float
    max_queue: int


def limits(gw: GatewayConfig, own: ModelGateway) -> Limits:
    def pick(mine, theirs):
        return theirs if mine is None else mine
    return Limits(pick(own.request_timeout_s, gw.request_timeout_s),
                  pick(own.first_byte_timeout_s, gw.first_byte_timeout_s),
                  pick(own.stream_idle_timeout_s, gw.stream_idle_timeout_s),
                  pick(own.queue_timeout_s, gw.queue_timeout_s), pick(own.max_queue, gw.max_queue_per_model))


POOLING = {"runner": {"pooling"}, "convert": {"embed", "classify", "reward"},
           "task": {"embed", "embedding", "classify", "score", "reward"}}   # vllm_args that make a pooling model


def pools(m) -> bool:
    """Whether the model's engine serves pooling requests (embeddings, scores, rewards), not generations, by its
    ``vllm_args`` (vLLM's ``--runner pooling``, a ``--convert``, the older ``--task``)."""
    return any(str(m.vllm_args.get(k)).lower() in v for k, v in POOLING.items())


def fallback_problems(models, src: Source) -> list[Problem]:
    """Each model's ``gateway.fallbacks`` name other models of the fleet (a served name or an alias, not a LoRA
    adapter), each once, not the model itself, that serve the same kind of request (generations or pooling)."""
    by_name = {m.name: m for m in models}
    owner = {n: m.name for m in models for n in m.served_names}
    adapters = {a: m.name for m in models for a in m.lora_adapters}
    problems = []
    for i, m in enumerate(models):
        seen: set[str] = set()
        for j, name in enumerate(m.gateway.fallbacks):
            at = ("models", i, "gateway", "fallbacks", j)
            target = owner.get(name)
            if name in adapters:
                why = f"{name!r} is a LoRA adapter of model {adapters[name]!r}: name a model"
            elif target is None:
                why = f"unknown model {name!r}; served names and aliases: {', '.join(sorted(owner))}"
            elif target == m.name:
                why = f"{name!r} is this model itself"
            elif target in seen:
                why = f"{name!r} names model {target!r} again"
            elif pools(m) != pools(other := by_name[target]):
                kind = "pooling requests (embeddings, scores)" if pools(other) else "generations"
                why = (f"{name!r} serves {kind} and this model does not (vllm_args runner, convert or task): a "
                       "fallback must take the same requests (a pooling model vLLM detects by itself: say "
                       "`runner: pooling` in its vllm_args)")
            else:
                seen.add(target)
                continue
            problems.append(src.problem(at, why))
    return problems

