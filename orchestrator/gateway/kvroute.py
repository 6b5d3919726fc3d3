"""What ``routing: kv_aware`` knows in one gateway process: every such replica's cached blocks (from its
engine's KV-cache events, or approximated from what this process sent it), the models' tokenizers, and the
one scoring function that picks a replica.

Each gateway process keeps its own index from the same events (no state is shared between processes):
:meth:`KvRouting.sync` follows the routing table, subscribing to the event publisher of every READY replica
of a ``kv_aware`` model and dropping the index of a replica that left it.

Scoring (:meth:`KvRouting.choose`): the request's prompt is tokenized with the model's own tokenizer and
chat template and cut into the engine's blocks; for each candidate replica the index gives the cached prefix,
as vLLM reads it: whole blocks before the prompt's last token, none with a cache salt, prompt logprobs or echo.
A replica's cost is prefill work, in prompt tokens:

    cost = prefill still ahead on it + 2 x (prompt tokens - cached tokens there)

where the prefill still ahead is the predicted uncached tokens of the requests this process sent it that
have not had their first byte yet (each lease carries its own charge and gives it back at its first byte).
An uncached token counts twice: this request waits for it, and so does every request queued behind it on
that replica (and its blocks evict others'); so a prefix is prefilled a second time elsewhere only when
the queue at home is longer than the prefix itself.
The cheapest wins, then the fewest in flight, then at random.  Replicas carrying more than ``LOAD_FACTOR`` x
the mean in flight (+2) are taken only when all are (bounded load: one hot prefix cannot pile every
request onto one replica).  A prompt that cannot be tokenized has no cached tokens anywhere: it goes where
the least prefill is ahead.  At the model's in-flight cap, :mod:`.kvqueue` decides which request waits and which
takes a replica with room, from :meth:`KvRouting.cached`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..config import ModelConfig
from ..configchecks import int_arg
from ..contract import RoutingTable
from ..kvrelay import server_key
from ..prompttokens import PromptTokenizer
from ..reqstats import RequestStats
from .genconfig import host_path, own_renderer
from .kvevents import FeedStats, FeedTarget
from .kvfeeds import Feeds
from .kvindex import KvIndex
from .metering import lax_true

log = logging.getLogger(__name__)

LOAD_FACTOR = 2.0      # bounded load: replicas above this multiple of the mean in flight (+2) only when all are
UNCACHED_WEIGHT = 2.0  # an uncached token delays this request once and, as work on that replica, the ones behind it
RECENT_S = 5.0         # blocks just sent to a replica count as cached there for this long, until its events store them
DEFAULT_BLOCK = 16
FEED_INCIDENTS = (("errors", "error"), ("restarts", "restart"), ("rebuilds", "rebuild"),
                  ("unknown_parents", "unknown_parent"), ("replay_failures", "replay_failure"))   # FeedStats -> kind
PROMPTS_KEPT = 64      # tokenized prompts kept by body (the queue's look-ahead, 32 waiters, reads them again;
                       # each entry keeps its body alive until its request ends (KvRouting.forget) or 64 newer


def _block_size(m: ModelConfig) -> int:
    """The engine's KV-cache block size (the index's unit; an engine block may be a multiple of it)."""
    if m.engine == "simulator":
        return m.simulator.block_size
    size = int_arg(m.vllm_args.get("block-size"))
    return DEFAULT_BLOCK if size is None else size


def tokenizer_dir(m: ModelConfig) -> Path | None:
    """Where this host finds the model's tokenizer: ``tokenizer_path``, else the engine's own (``vllm_args``
    ``tokenizer``, a directory) when set, else ``model_path`` if it is a directory."""
    engine_tok = m.vllm_args.get("tokenizer")   # the engine does not read model_path's then: neither may we
    for p in (m.tokenizer_path, host_path(m, m.model_path if engine_tok is None else engine_tok)):
        if isinstance(p, str) and p and os.path.isfile(os.path.join(p, "tokenizer.json")):
            return Path(p)
    return None


def _tokenizer_source(m: ModelConfig) -> tuple:
    """What the gateway's tokenizer of ``m`` is made from: a change makes a new one (and a new index)."""
    return m.tokenizer_path, m.model_path, m.vllm_args.get("tokenizer"), m.vllm_args.get("chat-template"), \
        _block_size(m)


def chat_template(m: ModelConfig) -> str | None:
    """The engine's ``--chat-template`` (``vllm_args``), as vLLM reads it: a file, else the template itself when
    it looks like one; None when unset.  ``ValueError``: set, but not readable here (a built-in name)."""
    v = m.vllm_args.get("chat-template")
    if v is None:
        return None
    if not isinstance(v, str):
        raise ValueError(f"vllm_args chat-template must be a string, not {v!r}")
    if os.path.isfile(v):
        with open(v, encoding="utf-8") as f:
            return f.read()
    if any(c in v for c in "{}\n"):
        return v
    raise ValueError(f"vllm_args chat-template {v!r} is not a file readable on this host")


def load_tokenizer(m: ModelConfig) -> PromptTokenizer | None:
    # (tokenizer-mode hf makes the engine read the model's own files, but not for gpt-oss: harmony goes by its type)
    if (mode := own_renderer(m)) is not None and (mode.startswith("harmony") or
                                                  m.vllm_args.get("tokenizer-mode", "auto") == "auto"):
        log.warning("model %s routes kv_aware, but vLLM renders its prompts with its own %s tokenizer, not the chat "
                    "template and tokenizer.json the gateway reads (its token ids, and cache lookups, would never "
                    "match): its requests go to the least loaded replica", m.name, mode)
        return None
    path = tokenizer_dir(m)
    if path is None:
        log.warning("model %s routes kv_aware but no tokenizer.json is readable on this host (tokenizer_path, "
                    "vllm_args tokenizer, model_path): its requests go to the least loaded replica", m.name)
        return None
    try:
        tok = PromptTokenizer.from_dir(path)
        template = chat_template(m)
        if template is not None:   # the engine's --chat-template replaces the tokenizer's, for every request
            tok = tok.with_chat_template(template, f"{path} with vllm_args chat-template")
        if (context := int_arg(m.vllm_args.get("max-model-len"))) is not None and context > 0:
            tok.max_chars = min(tok.max_chars, 16 * context)   # (more is surely over the context: the engine's 400)
        return tok
    except Exception as exc:  # noqa: BLE001 - whatever its files say (a reload must apply whole): no tokenizer
        log.warning("model %s: cannot load its tokenizer from %s (%s: %s): its requests go to the least loaded "
                    "replica", m.name, path, type(exc).__name__, exc)
        return None


def reads_no_cache(body: dict) -> bool:
    """Whether vLLM computes the prompt whole, reading none of its prefix cache (``skip_reading_prefix_cache``):
    ``prompt_logprobs`` asked for, or ``echo`` (a chat's then asks for its ``top_logprobs``, 0 by default; a
    completion's for its ``logprobs``, if set)."""
    return body.get("prompt_logprobs") is not None or lax_true(body.get("echo")) and (
        "messages" in body or body.get("logprobs") is not None)


class ModelKv:
    """One kv_aware model's routing state in this process: its tokenizer, its replicas' index and feeds."""

    def __init__(self, model: ModelConfig):
        self.model = model
        self.tokenizer = load_tokenizer(model)
        self.index = KvIndex(block_size=_block_size(model), on_store=self._stored)
        self.feeds = Feeds(self.index)
        self.charge = 0                      # the last choice's uncached prompt tokens (taken by its lease)
        # the last requests' bodies and their (keys, tokens): a retry, or a request waiting in the queue, reuses them
        self.prompts: OrderedDict[int, tuple[dict, tuple[list[int], int]]] = OrderedDict()
        self.recent: dict[str, OrderedDict[int, float]] = {}   # per replica: keys just sent there -> when
        self.step = 1   # index keys per engine block (an engine caches whole blocks), learned from the events
        self.seen: dict[str, tuple[FeedStats, FeedStats]] = {}   # per feed: its counts as last exported

    def _stored(self, job_id: str, keys: tuple[int, ...]) -> None:
        """A replica's events stored ``keys``: from now on its index says whether they are cached (a later
        BlockRemoved included), not the memory of having sent them there."""
        r = self.recent.get(job_id)
        if r:
            for k in keys:
                r.pop(k, None)

    def prompt(self, body: dict) -> tuple[list[int], int]:
        """The request's block keys and prompt length in tokens (([], 0) when it cannot be tokenized)."""
        hit = self.prompts.get(id(body))
        if hit is not None and hit[0] is body:
            self.prompts.move_to_end(id(body))
            return hit[1]
        out: tuple[list[int], int] = ([], 0)
        # a salt changes the engine's block hashes; prompt logprobs make it read none of its cache
        if self.tokenizer is not None and not body.get("cache_salt") and not reads_no_cache(body):
            try:
                ids = self.tokenizer.prompt_ids(body, "messages" in body)
                out = (self.index.keys(ids), len(ids))
            except Exception as exc:  # noqa: BLE001 - whatever a client sent, routing needs no keys for it
                # (this runs for every waiter the queue's election reads: it must not fail theirs); the engine
                # answers the bad request
                log.debug("model %s: prompt not tokenized for routing: %s: %s", self.model.name,
                          type(exc).__name__, exc)
        self.prompts[id(body)] = (body, out)
        if len(self.prompts) > PROMPTS_KEPT:
            self.prompts.popitem(last=False)
        return out


class KvRouting:
    def __init__(self, stats: RequestStats, rng: random.Random):
        self.stats = stats
        self.rng = rng
        self.models: dict[str, ModelKv] = {}
        self._closing: list[ModelKv] = []   # models no longer kv_aware (or reloaded): closed at the next sync
        self._stopping: set[asyncio.Task] = set()

    def set_models(self, models: Sequence[ModelConfig]) -> None:
        keep: dict[str, ModelKv] = {}
        for m in models:
            if m.routing != "kv_aware":
                continue
            mk = self.models.get(m.name)
            if mk is None or _tokenizer_source(mk.model) != _tokenizer_source(m):
                if mk is not None:
                    self._closing.append(mk)
                mk = ModelKv(m)
            mk.model = m
            keep[m.name] = mk
        self._closing += [mk for name, mk in self.models.items() if name not in keep]
        self.models = keep

    def sync(self, table: RoutingTable) -> None:
        """Follow the routing table: a feed per READY replica of a kv_aware model that publishes events; the
        index of a replica that left it is dropped."""
        for mk in self._closing:
            self._retire(mk)
        self._closing.clear()
        for name, mk in self.models.items():
            ready = table.ready(name)
            # (a relayed job's CURVE key is derived from its secret: 14 us, once per replica and table)
            mk.feeds.sync({r.job_id: FeedTarget(r.endpoint.kv_events, r.endpoint.kv_replay or None, r.endpoint.kv_topic,
                                                server_key(r.endpoint.secret) if r.endpoint.kv_curve else b"")
                           for r in ready if r.endpoint.kv_events})
            live = {r.job_id for r in ready}
            for jid in mk.index.job_ids():
                if jid not in live:
                    mk.index.drop(jid)
            for jid in [j for j in mk.recent if j not in live]:
                del mk.recent[jid]

    def _retire(self, mk: ModelKv) -> None:
        """Stop a model's feeds now and close their ZMQ context (its I/O thread) once their tasks end."""
        mk.feeds.sync({})
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # no loop: no feed task ever ran, nothing to wait for
            asyncio.run(mk.feeds.close())
            return
        task = loop.create_task(mk.feeds.close(), name=f"kvclose:{mk.model.name}")
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        for mk in [*self.models.values(), *self._closing]:
            await mk.feeds.close()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    def export(self) -> None:
        """Copy the feeds' counters, the index sizes, the replicas approximate and the event lag into this
        process's statistics."""
        st = self.stats
        for gauge in (st.kv_blocks, st.kv_approximate):
            for name in [n for n in gauge if n not in self.models]:   # no longer kv_aware: no index
                del gauge[name]
        for name, mk in self.models.items():
            feeds = mk.feeds.stats()
            for jid in [j for j in mk.seen if j not in feeds]:
                del mk.seen[jid]
            for jid, fs in feeds.items():
                # what each feed added since the last export (the counters only grow: a feed made anew for a
                # job, or a model's index made anew by a reload, starts from 0)
                was, old = mk.seen.get(jid, (None, None))
                if was is not fs:
                    old = FeedStats()
                st.bump("kv_events", fs.events_applied - old.events_applied, name)
                st.bump("kv_gaps", fs.replayed - old.replayed, name, "replayed")
                st.bump("kv_gaps", fs.resets - old.resets, name, "reset")
                for attr, kind in FEED_INCIDENTS:
                    st.bump("kv_feed", getattr(fs, attr) - getattr(old, attr), name, kind)
                mk.seen[jid] = (fs, replace(fs, lags=[]))
                if fs.lags:   # every live batch's lag since the last export, each an observation
                    lag = st.hist("kv_lag", name)
                    for x in fs.lags:
                        lag.observe(max(0.0, x))
                    fs.lags.clear()
            st.kv_blocks[name] = sum(mk.index.size(j) for j in mk.index.job_ids())
            st.kv_approximate[name] = sum(mk.index.approximate(j) for j in feeds)
            sizes = [getattr(mk.index.held(j), "engine_block_size", None) or 0 for j in mk.index.job_ids()]
            mk.step = max(1, max(sizes, default=0) // mk.index.block_size)

    def take_charge(self, model: str) -> int:
        mk = self.models.get(model)
        if mk is None:
            return 0
        charge, mk.charge = mk.charge, 0
        return charge

    def forget(self, model: str, body: dict) -> None:
        """``body``'s request ended: its tokenized prompt (and the body it keeps alive) goes."""
        mk = self.models.get(model)
        if mk is not None and (hit := mk.prompts.get(id(body))) is not None and hit[0] is body:
            del mk.prompts[id(body)]

    def cached(self, model: str, body: dict, slots: Sequence) -> tuple[int, dict[str, int]]:
        """The prompt's length in tokens and, per replica of ``slots``, how many of them it holds cached (its
        events' index; what was sent there in the last ``RECENT_S`` counts too: it is being prefilled)."""
        _, _, ntok, hits = self._lookup(model, body, slots)
        return ntok, hits

    def _lookup(self, model: str, body: dict, slots: Sequence) -> tuple[ModelKv | None, list[int], int, dict[str, int]]:
        """The model's index, the prompt's block keys and length, and the cached tokens per replica of ``slots``."""
        mk = self.models.get(model)
        keys, ntok = mk.prompt(body) if mk else ([], 0)
        if not keys:
            return mk, keys, ntok, {}
        hits = mk.index.match(keys, [c.job_id for c in slots])
        now = time.monotonic()
        for c in slots:   # what was just sent to a replica is (being) prefilled there, before its events say so
            r = mk.recent.get(c.job_id)
            if r:
                while r and next(iter(r.values())) < now - RECENT_S:
                    r.popitem(last=False)
                idx = mk.index.held(c.job_id)   # (a key leaves `r` when its store arrives: then the index says)
                n = 0
                for k in keys:
                    if k not in r and (idx is None or k not in idx):
                        break
                    n += 1
                if n > hits.get(c.job_id, 0):
                    hits[c.job_id] = n
        bs, ebs = mk.index.block_size, mk.index.block_size * mk.step
        cap = (ntok - 1) // ebs * ebs   # vLLM computes the last prompt token: a hit stops a whole block before it
        # the engine holds whole blocks of its own size (what was sent, and what the fallback remembers, is in ours)
        return mk, keys, ntok, {j: min((n - n % mk.step) * bs, cap) for j, n in hits.items()}

    def choose(self, model: str, cands: Sequence, body: dict, rng: random.Random):
        """The cheapest candidate: cost = prefill still ahead there (predicted uncached tokens of its requests
        that have no first byte yet) + ``UNCACHED_WEIGHT`` x this prompt's uncached tokens there; ties to the fewest in flight, then at random; replicas above ``LOAD_FACTOR`` x the mean
        in flight (+2) only when all are."""
        mk, keys, ntok, hits = self._lookup(model, body, cands)
        now = time.monotonic()
        bound = LOAD_FACTOR * sum(c.inflight for c in cands) / len(cands) + 2
        best, best_key, cached_best = cands[0], None, 0
        for c in cands:
            cached = hits.get(c.job_id, 0)
            key = (c.inflight > bound, getattr(c, "prefill_pending", 0) + UNCACHED_WEIGHT * (ntok - cached), c.inflight,
                   rng.random())
            if best_key is None or key < best_key:
                best, best_key, cached_best = c, key, cached
        if mk is not None:
            mk.charge = ntok - cached_best
            if keys:
                mk.index.record(best.job_id, keys)
                r = mk.recent.setdefault(best.job_id, OrderedDict())
                for k in keys:
                    r[k] = now
                    r.move_to_end(k)
            if ntok:
                self.stats.bump("kv_prompt_tokens", ntok, model)
                self.stats.bump("kv_predicted_hits", cached_best, model)
        return best
