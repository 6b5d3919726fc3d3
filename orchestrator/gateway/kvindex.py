"""Which prompt prefixes each replica holds in its KV cache, for cache-aware routing.

vLLM names a cached block by an opaque hash (sha256 over a per-deployment seed, its parent's hash and the
block's tokens), which the gateway cannot compute for an incoming prompt.  So the index keys blocks by
*our own* chained hash of the token ids (:func:`block_keys`), computed from the token ids every
``BlockStored`` event carries, and keeps a map engine hash -> our keys to apply ``BlockRemoved``.

The index has its own block granularity (``block_size``, e.g. 16 tokens).  An engine block must span a
whole number of index blocks (vLLM's block sizes are multiples of 16), so replicas whose engines use
different block sizes are still compared in the same unit: leading index blocks cached.

Blocks whose engine hash mixes in more than token ids (LoRA name, multimodal inputs, a cache salt: the
event's ``extra_keys``/``lora_name``) are remembered as present but never matched: a plain-token prompt
would not hit them in the engine either, and their descendants are excluded the same way.

Two sources per replica:
 * :class:`ReplicaIndex`, fed by the replica's event stream (exact while the feed is in sync);
 * :class:`RoutedKeys`, a bounded LRU of the keys the gateway routed there (approximate), consulted for
   replicas without a feed or whose feed lost events (``ReplicaIndex.approximate``).

Pure data structures: no I/O, no clocks, not thread-safe (the gateway's event loop owns them).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

EngineHash = bytes | int
"""vLLM's external block hash: sha256 bytes, or a 64-bit int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""

ROOT_KEY = 0
"""The chain's starting value: the 'parent' of a sequence's first block."""

DEFAULT_BLOCK_SIZE = 16
DEFAULT_ROUTED_LIMIT = 32_768
DEFAULT_GHOST_LIMIT = 4_096


def _chain(prev: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of the full ``block_size`` blocks of ``token_ids``, chained on from ``prev``.

    Each key is a 64-bit blake2b digest of (previous key, the block's token ids as uint32), so a key names
    the whole prefix up to and including its block.  Native byte order: keys are compared within one
    process (the gateway), never exchanged.
    """
    n = len(token_ids) // block_size
    if n == 0:
        return []
    ids = array("I", token_ids[: n * block_size])
    width = block_size * ids.itemsize
    packed = ids.tobytes()
    out: list[int] = []
    digest = prev.to_bytes(8, "little")
    for i in range(n):
        digest = hashlib.blake2b(digest + packed[i * width:(i + 1) * width], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
    return out


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One key per FULL block of ``token_ids`` (a trailing partial block has none), chained from the start."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return _chain(ROOT_KEY, token_ids, block_size)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine cached ``block_hashes`` (in chain order) holding ``token_ids``, after ``parent_block_hash``."""
    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: Sequence[Any] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine evicted ``block_hashes``."""
    block_hashes: Sequence[EngineHash]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (vLLM's reset_prefix_cache)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class ReplicaIndex:
    """One replica's cached blocks, as its KV events describe them.

    With ``count_copies`` (the default) stores are reference counted per engine hash: vLLM emits one
    ``BlockStored`` per physical block made cacheable and one ``BlockRemoved`` per physical block evicted, and
    two physical blocks may carry the same hash (a request that looked the cache up before another cached the
    rest of their common prefix computes that rest again), so a hash leaves the index only when its last copy
    does.  That holds from the root too: a prompt of exactly one cached block computes that block again (vLLM
    never serves the last prompt token from cache) and stores a second copy, parent None.  The one store that
    is no copy, vLLM's re-announcement of a cached prefix for a request with ``vllm_xargs:
    {kv_cache_report_mode: full}``, never reaches a ``kv_aware`` model's engine: the gateway takes that key out
    of the request.  With ``count_copies=False`` every store marks presence and any removal forgets the hash.

    A store whose ``block_size`` is below the engine's (that of the full blocks stored before it) is a prompt's
    partial last block: a full-attention group whose blocks span several hash blocks (a hybrid model's) caches a
    prompt up to its last hash-block boundary, in one store of that last hash block alone, its parent the hash of
    the one before, which no store names unless it ends an engine block (vLLM's ``cache_partial_block``).  Read as
    events missed, it made the feed rebuild and the replica approximate for good; it is skipped (its removal, when
    that block is evicted or filled, is then one of a hash not held).

    ``approximate`` is the feed's verdict (set by the subscriber, not here): True while the index may lack
    blocks the engine holds (no feed yet, or events were lost), so matching also consults routed keys.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, ghost_limit: int = DEFAULT_GHOST_LIMIT,
                 count_copies: bool = True, on_store: Callable[[tuple[int, ...]], None] | None = None):
        self.block_size = block_size
        self.count_copies = count_copies
        self.on_store = on_store  # told the keys of each block stored (the engine computed them: confirmed)
        self.approximate = True
        self.engine_block_size: int | None = None
        self.unknown_parents = 0  # stores skipped: their parent was never seen (missed events)
        self.unknown_removals = 0  # removals of hashes not held (normal after a reset)
        self.unaligned = 0  # stores whose block size is not a multiple of ours, or whose tokens don't fit
        self.partial = 0  # stores of a partial block, skipped (see the class doc)
        self._ghost_limit = ghost_limit
        self._refs: dict[EngineHash, int] = {}
        self._keys_of: dict[EngineHash, tuple[int, ...] | None] = {}  # None: present but never matched
        self._held: dict[int, int] = {}  # our key -> how many held engine blocks contain it
        # recently evicted engine hashes -> their keys, so a later child of an evicted parent still chains
        self._ghosts: OrderedDict[EngineHash, tuple[int, ...] | None] = OrderedDict()

    def __len__(self) -> int:
        """Index blocks held (our keys), the unit :meth:`prefix` counts in."""
        return len(self._held)

    @property
    def engine_blocks(self) -> int:
        """Distinct engine block hashes held."""
        return len(self._refs)

    def __contains__(self, key: int) -> bool:
        return key in self._held

    def clear(self) -> None:
        """Forget every block (the approximate flag is left to the caller)."""
        self._refs.clear()
        self._keys_of.clear()
        self._held.clear()
        self._ghosts.clear()

    def prefix(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are held (stops at the first miss)."""
        held = self._held
        for i, key in enumerate(keys):
            if key not in held:
                return i
        return len(keys)

    def apply(self, event: KvEvent) -> bool:
        """Apply one event.  False when a ``BlockStored``'s parent is unknown: events were missed (the
        blocks are skipped, as their keys cannot be computed), so the subscriber should ask for a replay."""
        if isinstance(event, BlockStored):
            return self._store(event)
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._remove(h)
            return True
        if isinstance(event, AllBlocksCleared):
            self.clear()
            return True
        raise TypeError(f"not a KV event: {event!r}")

    def _parent_keys(self, parent: EngineHash | None) -> tuple[int, ...] | None | bool:
        """The parent's keys (``()`` for a first block, None when excluded), or False when unknown."""
        if parent is None:
            return ()
        if parent in self._keys_of:
            return self._keys_of[parent]
        if parent in self._ghosts:
            return self._ghosts[parent]
        return False

    def _store(self, ev: BlockStored) -> bool:
        n = len(ev.block_hashes)
        if n == 0:
            return True
        bs = ev.block_size
        if 0 < bs < (self.engine_block_size or 0):   # a prompt's partial last block: see the class doc
            self.partial += 1
            return True
        parent = self._parent_keys(ev.parent_block_hash)
        if parent is False:
            self.unknown_parents += 1
            return False
        keyable = parent is not None and ev.lora_name is None
        if bs <= 0 or bs % self.block_size or len(ev.token_ids) != n * bs:
            self.unaligned += 1
            keyable = False
        else:   # (an offloading connector's placeholder store says block_size 0: not the engine's size)
            self.engine_block_size = bs
        extra = ev.extra_keys
        prev = parent[-1] if parent else ROOT_KEY
        for i, h in enumerate(ev.block_hashes):
            if keyable and extra is not None and i < len(extra) and extra[i] is not None:
                keyable = False
            keys: tuple[int, ...] | None = None
            if keyable:
                keys = tuple(_chain(prev, ev.token_ids[i * bs:(i + 1) * bs], self.block_size))
                prev = keys[-1]
            self._hold(h, keys, self.count_copies)
        return True

    def _hold(self, h: EngineHash, keys: tuple[int, ...] | None, copy: bool) -> None:
        if keys and self.on_store is not None:
            self.on_store(keys)
        refs = self._refs.get(h, 0)
        if refs:
            if copy:
                self._refs[h] = refs + 1
            if not keys or self._keys_of[h] is not None:
                return
            # held with no keys (a placeholder store, block_size 0, came first): a store with tokens makes it
            # matchable, and its descendants with it
        else:
            self._refs[h] = 1
            self._ghosts.pop(h, None)
        self._keys_of[h] = keys
        if keys:
            held = self._held
            for key in keys:
                held[key] = held.get(key, 0) + 1

    def _remove(self, h: EngineHash) -> None:
        refs = self._refs.get(h)
        if refs is None:
            self.unknown_removals += 1
            return
        if refs > 1:
            self._refs[h] = refs - 1
            return
        del self._refs[h]
        keys = self._keys_of.pop(h)
        if keys:
            held = self._held
            for key in keys:
                left = held[key] - 1
                if left:
                    held[key] = left
                else:
                    del held[key]
        self._ghosts[h] = keys
        if len(self._ghosts) > self._ghost_limit:
            self._ghosts.popitem(last=False)


class RoutedKeys:
    """The keys the gateway sent to one replica, most recent last, at most ``limit`` of them.

    A stand-in for the replica's cache when its events are unavailable: what was routed there was computed
    there, so it is probably still cached unless evicted (the LRU bound mimics that eviction, roughly).
    """

    def __init__(self, limit: int = DEFAULT_ROUTED_LIMIT):
        if limit <= 0:
            raise ValueError("limit must be positive")
        self.limit = limit
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[int]) -> None:
        """Remember ``keys`` as the most recently used, the first most (a prefix outlives its tail, as in
        vLLM, which frees a request's blocks tail first)."""
        od = self._keys
        for key in reversed(keys):
            od[key] = None
            od.move_to_end(key)
        while len(od) > self.limit:
            od.popitem(last=False)

    def prefix(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are remembered (stops at the first miss)."""
        od = self._keys
        for i, key in enumerate(keys):
            if key not in od:
                return i
        return len(keys)


class KvIndex:
    """Per replica (job id): the event-fed :class:`ReplicaIndex` and the :class:`RoutedKeys` fallback.

    ``block_size`` is the granularity of the keys callers pass to :meth:`match` (:func:`block_keys` with the
    same size).  A replica with no event index, or one marked approximate, is matched against both and
    scores the larger prefix.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, routed_limit: int = DEFAULT_ROUTED_LIMIT,
                 ghost_limit: int = DEFAULT_GHOST_LIMIT, count_copies: bool = True,
                 on_store: Callable[[str, tuple[int, ...]], None] | None = None):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.routed_limit = routed_limit
        self.ghost_limit = ghost_limit
        self.count_copies = count_copies
        self.on_store = on_store  # (job id, keys) of each block a replica's events store
        self._events: dict[str, ReplicaIndex] = {}
        self._routed: dict[str, RoutedKeys] = {}

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """:func:`block_keys` at this index's block size."""
        return _chain(ROOT_KEY, token_ids, self.block_size)

    def replica(self, job_id: str) -> ReplicaIndex:
        """The event index of ``job_id``, made (approximate, empty) on first use."""
        idx = self._events.get(job_id)
        if idx is None:
            hook = self.on_store
            idx = self._events[job_id] = ReplicaIndex(self.block_size, self.ghost_limit, self.count_copies,
                                                      None if hook is None else lambda keys: hook(job_id, keys))
        return idx

    def held(self, job_id: str) -> "ReplicaIndex | None":
        """The event index of ``job_id`` if it has one (none is made)."""
        return self._events.get(job_id)

    def record(self, job_id: str, keys: Sequence[int]) -> None:
        """Remember that the request with ``keys`` was routed to ``job_id``."""
        routed = self._routed.get(job_id)
        if routed is None:
            routed = self._routed[job_id] = RoutedKeys(self.routed_limit)
        routed.add(keys)

    def approximate(self, job_id: str) -> bool:
        """Whether ``job_id`` is matched approximately (no event index, or the feed says it is incomplete)."""
        idx = self._events.get(job_id)
        return idx is None or idx.approximate

    def match(self, keys: Sequence[int], job_ids: Iterable[str] | None = None) -> dict[str, int]:
        """For each replica (``job_ids``, default every known one) the number of leading ``keys`` it holds."""
        events, routed = self._events, self._routed
        if job_ids is None:
            job_ids = events.keys() | routed.keys()
        out: dict[str, int] = {}
        for job in job_ids:
            idx = events.get(job)
            n = idx.prefix(keys) if idx is not None else 0
            if (idx is None or idx.approximate) and n < len(keys):
                lru = routed.get(job)
                if lru is not None:
                    n = max(n, lru.prefix(keys))
            out[job] = n
        return out

    def drop(self, job_id: str) -> None:
        """Forget ``job_id`` entirely (its replica is gone)."""
        self._events.pop(job_id, None)
        self._routed.pop(job_id, None)

    def job_ids(self) -> list[str]:
        return sorted(self._events.keys() | self._routed.keys())

    def size(self, job_id: str) -> int:
        """Blocks known for ``job_id``, in index blocks: its event index's, or its routed keys' without one."""
        idx = self._events.get(job_id)
        if idx is not None:
            return len(idx)
        lru = self._routed.get(job_id)
        return len(lru) if lru is not None else 0
