"""The simulated engine's state: vLLM's scheduling of sequences (slots of ``--max-num-seqs``, KV blocks of the
prefix cache, one prefill at a time), its KV-cache event batches, and its ``vllm:*`` metrics.  The HTTP
surface is :mod:`orchestrator.devtools.simulator`.

The waiting queue is vLLM's (``vllm/v1/core/sched/request_queue.py``): with ``--scheduling-policy fcfs`` (the
default) arrival order, a request's ``priority`` ignored; with ``priority`` the lowest ``priority`` first, ties
by arrival.  Only its head is admitted (when a slot and its blocks are free): like vLLM's scheduler, a waiting
request never preempts a running one.  vLLM preempts (lowest priority, latest arrival first) only when a
running sequence cannot get its next KV block; the simulator reserves a sequence's blocks at admission, so that
never happens here."""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import os
import time
from collections.abc import Mapping
from typing import Annotated

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import Field, TypeAdapter, ValidationError

from orchestrator.devtools.simcache import HASH_SEED, Admission, CacheFull, PrefixCache, root_hash
from orchestrator.devtools.simkvevents import KVEventPublisher
from orchestrator.devtools.simvocab import ModelVocab, SimVocab

MAX_MODEL_LEN = 4096  # the context length of a simulator with no model path and no --max-model-len
PRIORITY_HEADER = "X-Vllm-Priority"  # vLLM's: when it parses as an integer it overrides the body's `priority`
# the body's field as vLLM's request model declares it (pydantic, lax: "3" and 3.0 are 3)
PRIORITY = TypeAdapter(Annotated[int, Field(ge=-2**63, le=2**63 - 1)])


class Aborted(Exception):
    """The request was aborted while it waited (:meth:`SimState.abort`): vLLM's abort of the requests in flight."""


async def pause(ev: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``, cut short when ``ev`` (a request's abort) is set: whether it was."""
    if not ev.is_set():
        try:
            async with asyncio.timeout(seconds):
                await ev.wait()
        except TimeoutError:
            pass
    return ev.is_set()


class RequestError(ValueError):
    """A request vLLM answers 400, with its error's ``type`` and ``param``."""

    def __init__(self, message: str, etype: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.etype, self.param = etype, param


def request_priority(body: dict, headers: Mapping[str, str]) -> int:
    """A request's ``priority`` as vLLM reads it (``_get_priority``); RequestError (400) as vLLM's if invalid."""
    try:
        return int(headers.get(PRIORITY_HEADER, ""))
    except ValueError:
        pass
    try:
        return PRIORITY.validate_python(body.get("priority", 0))
    except ValidationError as e:
        err = {k: e.errors()[0][k] for k in ("type", "msg", "input")}
        detail = {"type": err["type"], "loc": "body.priority", "msg": err["msg"], "input": err["input"]}
        raise RequestError(f"1 validation error:\n  {detail}", "Bad Request", "body.priority") from None


def usage_options(body: dict, force: bool) -> tuple[bool, bool]:
    """(the final usage chunk, usage in every chunk) for a stream, as vLLM's ``should_include_usage``; ValueError
    (HTTP 400) for ``stream_options`` without ``stream``, as vLLM's request validation."""
    opts = body.get("stream_options")
    if opts and not body.get("stream"):
        raise RequestError("Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                           param="stream_options")
    if force:  # --enable-force-include-usage
        return True, True
    if opts is not None and not isinstance(opts, dict):
        raise ValueError("stream_options: Input should be a valid dictionary")
    include = bool((opts or {}).get("include_usage"))
    return include, include and bool((opts or {}).get("continuous_usage_stats"))


COMPLETIONS_MAX_TOKENS = 16   # a /v1/completions request's max_tokens when it has none, or null (vLLM's default)


def max_tokens_of(body: dict, chat: bool, prompt_len: int, max_model_len: int) -> int:
    """The tokens a request may generate, as vLLM 0.32 reads them: a chat's ``max_completion_tokens`` before its
    ``max_tokens``, none (or null) the context left; a completion's ``max_tokens`` 16 when absent or null
    (``normalize_null_max_tokens``); more than ``max_model_len`` asked is a 400 (not cut down), less than 1
    too; the rest is clamped to the context left."""
    if chat and body.get("max_completion_tokens") is not None:
        asked, param = body["max_completion_tokens"], "max_completion_tokens"
    else:
        asked = body.get("max_tokens")
        param = "max_tokens"
        if asked is None and not chat:
            asked = COMPLETIONS_MAX_TOKENS
    left = max_model_len - prompt_len
    if asked is None:
        return left
    if isinstance(asked, float) and asked.is_integer():
        asked = int(asked)
    if type(asked) is not int:
        raise RequestError(f"{param}: Input should be a valid integer", param=param)
    if asked > max_model_len:
        raise RequestError(f"{param}={asked} cannot be greater than max_model_len={max_model_len}. "
                           "Please request fewer output tokens.", param=param)
    if asked < 1:
        raise RequestError(f"max_tokens must be at least 1, got {asked}.", param=param)
    return min(asked, left)


def model_len(model: str | None) -> int | None:
    """The context length vLLM derives for a model folder: its ``config.json``'s ``max_position_embeddings``."""
    if not model:
        return None
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            n = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return n if type(n) is int and n > 0 else None


class SimState:
    """Everything one simulator process holds (no module globals)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.names = args.served_model_name or ["sim-model"]
        self.adapters = dict(args.lora_modules or ()) if args.enable_lora else {}   # LoRA name -> path
        self.api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
        # vLLM's key check guards /v1 only; with slurmfleet's engine middleware every path asks for the key
        self.guard_all = any(m.endswith(".RequireSecret") for m in args.middleware)
        self.fault = args.fault
        self.vocab = ModelVocab.load(args.model) or SimVocab()
        self.max_model_len = args.max_model_len or model_len(args.model) or MAX_MODEL_LEN   # (/v1/models says it)
        seed = os.environ.get("PYTHONHASHSEED", HASH_SEED)   # vLLM's seed of its block hashes
        self.cache = PrefixCache(args.block_size, args.num_gpu_blocks_override, args.enable_prefix_caching, seed)
        # each adapter's root of its block hashes: vLLM hashes a LoRA request's blocks with the adapter's name and
        # path as extra keys, so they never match the base model's or another adapter's
        self.lora_roots = {n: root_hash(f"{seed}:lora:{n}:{p}") for n, p in self.adapters.items()}
        self.publisher: KVEventPublisher | None = None  # started on the event loop (_serve)
        self.priority_policy = args.scheduling_policy == "priority"
        self.queue: list[tuple[int, int, str]] = []  # the waiting requests' heap of (priority, arrival, id)
        self.arrivals = itertools.count()
        self.prefill_lock = asyncio.Lock()  # FIFO
        self.changed = asyncio.Event()  # set when a slot or blocks are freed or the queue's head changes
        self.running = 0
        self.waiting = 0
        self.workers_expected = max(0, args.nnodes - 1)
        self.workers: set[asyncio.StreamWriter] = set()
        self.started = time.time()
        self.last_headers: dict[str, str] = {}
        self.aborts = asyncio.Event()  # set to abort the requests in flight (each holds the one of its arrival)
        self.inflight = 0              # generation requests being answered
        self.shutting_down = False     # vLLM's engine aborts a request added during its shutdown at once
        self.last_body: dict = {}
        reg = self.registry = CollectorRegistry()
        lab = ["model_name", "engine"]
        self.labels = {"model_name": self.names[0], "engine": "0"}
        self.g_running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", lab, registry=reg)
        self.g_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", lab, registry=reg)
        self.g_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lab, registry=reg)
        self.c_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", lab, registry=reg)
        self.c_gen = Counter("vllm:generation_tokens", "Generation tokens processed.", lab, registry=reg)
        self.c_success = Counter("vllm:request_success", "Successfully processed requests.",
                                 [*lab, "finished_reason"], registry=reg)
        self.c_preempt = Counter("vllm:num_preemptions", "Cumulative preemptions.", lab, registry=reg)
        self.c_pq = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            lab, registry=reg)
        self.c_ph = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            lab, registry=reg)
        blocks = str(args.num_gpu_blocks_override)  # vLLM's CacheConfig fields a router may read
        info = {"block_size": str(args.block_size), "num_gpu_blocks": blocks, "num_gpu_blocks_override": blocks,
                "enable_prefix_caching": str(args.enable_prefix_caching), "prefix_caching_hash_algo": "sha256"}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*info, "engine"],
              registry=reg).labels(**info, engine="0").set(1)
        buckets = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab, buckets=buckets, registry=reg)
        self.h_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", lab, buckets=buckets, registry=reg)
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency.", lab, registry=reg)
        self.h_queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting.", lab, registry=reg)
        for reason in ("stop", "length", "abort", "error"):
            self.c_success.labels(**self.labels, finished_reason=reason)
        self._sync()

    def _sync(self) -> None:
        self.g_running.labels(**self.labels).set(self.running)
        self.g_waiting.labels(**self.labels).set(self.waiting)
        self.g_kv.labels(**self.labels).set(self.cache.usage())

    def publish(self) -> None:
        """Send the cache's new events as one batch (as vLLM sends one a scheduler step)."""
        events = self.cache.take_events()
        self.publisher.publish(events) if self.publisher else None

    def abort(self) -> int:
        """Abort the requests in flight, as vLLM's engine does at its shutdown (``--shutdown-timeout`` 0, or once
        it is spent): each ends with ``finish_reason`` "abort" now; later ones are not; how many there were."""
        ev, self.aborts = self.aborts, asyncio.Event()
        ev.set()
        self.changed.set()  # (the queue's waiters see it)
        return self.inflight

    async def admit(self, seq_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
                    aborted: asyncio.Event | None = None, read: bool = True, adapter: str = "") -> Admission:
        """Wait in the queue until this request is its head and has a slot and room for its blocks; CacheFull if
        it never can, Aborted when ``aborted`` is set first."""
        entry = (priority if self.priority_policy else 0, next(self.arrivals), seq_id)
        heapq.heappush(self.queue, entry)
        self.changed.set()
        adm = None
        try:
            while adm is None:
                if aborted is not None and aborted.is_set():
                    raise Aborted
                if self.queue[0] == entry and self.running < self.args.max_num_seqs:
                    adm = self.cache.admit(seq_id, prompt, max_tokens, read, self.lora_roots.get(adapter, b""))
                if adm is None:
                    self.changed.clear()
                    await self.changed.wait()
            self.running += 1
        finally:  # admitted, refused or cancelled: out of the queue, and the next head gets its turn
            self.queue.remove(entry)
            heapq.heapify(self.queue)
            self.changed.set()
        if self.cache.enable_caching and read:  # vLLM counts a lookup, in tokens, when it admits the request
            self.c_pq.labels(**self.labels).inc(adm.prompt_tokens)
            self.c_ph.labels(**self.labels).inc(adm.hit_tokens)
        self.publish()
        return adm

    def release(self, seq_id: str) -> None:
        self.cache.release(seq_id)
        self.running -= 1
        self.publish()
        self.changed.set()

    async def prefill(self, adm: Admission, aborted: asyncio.Event) -> bool:
        """The uncached prompt tokens' compute, serialized as an engine step is; whether ``aborted`` cut it."""
        seconds = self.args.prefill_s_per_token * (adm.prompt_tokens - adm.hit_tokens)
        if seconds > 0 and not aborted.is_set():
            async with self.prefill_lock:
                await pause(aborted, seconds)
        return aborted.is_set()

    def check_fits(self, prompt: list[int]) -> None:
        """CacheFull when the prompt's blocks are more than the whole cache (it could never be admitted)."""
        n = self.cache.blocks_for(len(prompt))
        if n > self.cache.usable:
            raise CacheFull(f"the prompt's {len(prompt)} tokens need {n} KV-cache blocks, "
                            f"more than the {self.cache.usable} there are")

    @property
    def cluster_ok(self) -> bool:
        return len(self.workers) >= self.workers_expected
