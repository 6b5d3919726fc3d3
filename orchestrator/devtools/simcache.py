"""The simulator's paged prefix cache, with the block identity, accounting and events of vLLM v1's.

A sequence's KV cache lives in blocks of ``block_size`` tokens out of a pool of ``num_gpu_blocks``, of which,
as in vLLM, one is a reserved null block (so ``num_gpu_blocks - 1`` are usable and are the denominator of
``usage``).  A *full* block is cached under a chained hash: SHA-256 of the pickled
``(parent_hash, tuple(token_ids), None)``, the first block's parent being the hash of the seed
``"vllm-none-hash"`` (``PYTHONHASHSEED`` when the engine has it); this is vLLM's default ``sha256`` algorithm,
so the simulator's hashes are the ones vLLM computes for the same token ids.  Events carry, as vLLM publishes
them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), the low 64 bits of the digest read big-endian, an
unsigned ``int``.

Blocks held by running sequences are reference counted; a freed block keeps its hash and joins the tail of
the free queue (a sequence's blocks tail first), so eviction, which takes blocks from the head when room is
needed, is least recently used; a freed block that was never cached goes to the head.  Evicting a cached block
emits ``BlockRemoved``.  A lookup matches the longest run of cached leading blocks but, as vLLM, never serves a
prompt's last token from cache (at most ``(len - 1) // block_size`` blocks).  Storing a block emits
``BlockStored`` (vLLM stores a block again, and says so, when a capped lookup made a sequence recompute it).

Admission differs from vLLM in one documented way: vLLM admits on the prompt's blocks and preempts when decode
runs out, the simulator reserves a sequence's whole length (prompt + ``max_tokens``) at admission, so it never
preempts, while allocating blocks only as tokens arrive, so ``usage`` grows as vLLM's does.

Pure: no I/O and no clock; the caller takes the events and publishes them.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

HASH_SEED = "vllm-none-hash"  # vLLM's default seed of the first block's parent (PYTHONHASHSEED overrides it)
MEDIUM_GPU = "GPU"
PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL of the Pythons vLLM runs on (3.10-3.13)


def sha256_pickle(obj: object) -> bytes:
    """vLLM's default prefix-caching hash: SHA-256 of the object pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(obj, protocol=PICKLE_PROTOCOL)).digest()


def root_hash(seed: str = HASH_SEED) -> bytes:
    """The parent hash of every sequence's first block."""
    return sha256_pickle(seed)


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its parent's hash, its token ids, and no extra keys (no LoRA, salt, media)."""
    return sha256_pickle((parent, tuple(token_ids), None))


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes, start: int = 0,
                 parent: bytes | None = None) -> list[bytes]:
    """The hashes of the full blocks of ``token_ids`` from block ``start`` (whose parent hash is ``parent``)."""
    out: list[bytes] = []
    prev = parent if parent is not None else root
    for b in range(start, len(token_ids) // block_size):
        prev = chain_hash(prev, token_ids[b * block_size:(b + 1) * block_size])
        out.append(prev)
    return out


def external_hash(digest: bytes) -> int:
    """A hash as vLLM publishes it by default: the digest's low 64 bits, big-endian, unsigned."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


@dataclass(frozen=True)
class BlockStored:
    """Blocks newly cached, in chain order; ``parent_block_hash`` is the first one's parent (None: the root).
    The other fields are what vLLM publishes for a plain request on a full-attention model."""
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"

    @property
    def extra_keys(self) -> list[None]:
        """No LoRA, salt or media: vLLM still sends one (empty) entry per block."""
        return [None] * len(self.block_hashes)


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block evicted (vLLM emits one event per block)."""
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class Admission:
    """A running sequence's hold on the cache."""
    seq_id: str
    prompt_tokens: int
    hit_tokens: int  # prompt tokens served from cache (vLLM's num_computed_tokens after lookup)
    blocks: list[int] = field(default_factory=list)  # physical blocks, in token order
    hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full blocks, stored or hit
    stored: int = 0  # how many leading blocks are cached (hit or stored by this sequence)
    reserved: int = 0  # blocks reserved at admission and not yet allocated
    root: bytes = b""  # its chain's root (a LoRA adapter's: its blocks are its own, as vLLM's extra keys make them)


class CacheFull(ValueError):
    """A sequence that could not fit even in an empty cache."""


class PrefixCache:
    """vLLM v1's block pool and prefix cache, reduced to one KV-cache group of full attention."""

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 4096, enable_caching: bool = True,
                 hash_seed: str = HASH_SEED, medium: str = MEDIUM_GPU):
        if block_size < 1 or num_gpu_blocks < 2:
            raise ValueError("block_size must be >= 1 and num_gpu_blocks >= 2 (one is vLLM's null block)")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.usable = num_gpu_blocks - 1
        self.enable_caching = enable_caching
        self.medium = medium
        self.root = root_hash(hash_seed)
        self.queries = 0  # tokens looked up (vLLM's vllm:prefix_cache_queries)
        self.hits = 0  # tokens found (vLLM's vllm:prefix_cache_hits)
        self._ref = [0] * num_gpu_blocks
        self._hash: list[bytes | None] = [None] * num_gpu_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_gpu_blocks))
        self._cached: dict[bytes, list[int]] = {}  # hash -> blocks holding it, first found first
        self._reserved = 0  # sum of the running sequences' reservations
        self._seqs: dict[str, Admission] = {}
        self._events: list[KVEvent] = []

    # -- queries ---------------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running sequences."""
        return self.usable - len(self._free)

    def usage(self) -> float:
        """vLLM's ``vllm:kv_cache_usage_perc``: 1 - free / (num_gpu_blocks - 1); cached idle blocks count free."""
        return self.used_blocks / self.usable

    @property
    def cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def is_cached(self, digest: bytes) -> bool:
        return digest in self._cached

    def _lookup(self, hashes: list[bytes], prompt_len: int) -> list[int]:
        limit = max(0, prompt_len - 1) // self.block_size  # the last prompt token is always computed
        hit: list[int] = []
        for h in hashes[:limit]:
            holders = self._cached.get(h)
            if not holders:
                break
            hit.append(holders[0])
        return hit

    def hit_tokens(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's tokens a lookup now would serve from cache (no side effects)."""
        if not self.enable_caching:
            return 0
        return len(self._lookup(block_hashes(prompt, self.block_size, self.root), len(prompt))) * self.block_size

    # -- sequences -------------------------------------------------------------------------------------
    def admit(self, seq_id: str, prompt: Sequence[int], max_tokens: int, read: bool = True,
              root: bytes = b"") -> Admission | None:
        """Admit a sequence if its prompt plus ``max_tokens`` fit now: look the prompt up (counting queries
        and hits as vLLM does at admission), take the hit blocks, allocate the rest of the prompt's, store its
        full blocks.  None (and nothing counted) when it must wait; CacheFull when it never fits.  ``read``
        False: vLLM's ``skip_reading_prefix_cache`` (prompt logprobs asked): no lookup, nothing counted, the
        prompt computed whole, and its blocks stored all the same."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already admitted")
        n = len(prompt)
        prompt_blocks = self.blocks_for(n)
        if prompt_blocks > self.usable:
            raise CacheFull(f"the prompt's {n} tokens need {prompt_blocks} KV-cache blocks, "
                            f"more than the {self.usable} there are")
        total = min(self.usable, max(prompt_blocks, self.blocks_for(n + max(0, max_tokens))))
        root = root or self.root
        hashes = block_hashes(prompt, self.block_size, root) if self.enable_caching else []
        hit = self._lookup(hashes, n) if self.enable_caching and read else []
        idle_hits = sum(1 for b in hit if self._ref[b] == 0)  # these leave the free queue too
        if total - len(hit) + idle_hits > len(self._free) - self._reserved:
            return None
        if self.enable_caching and read:
            self.queries += n
            self.hits += len(hit) * self.block_size
        for b in hit:
            self._take(b)
        seq = Admission(seq_id, n, len(hit) * self.block_size, blocks=list(hit), hashes=hashes,
                        stored=len(hit), reserved=total - len(hit), root=root)
        self._seqs[seq_id] = seq
        self._reserved += seq.reserved
        self._allocate(seq, n)
        self._store(seq, prompt, n)
        return seq

    def advance(self, seq_id: str, token_ids: Sequence[int], computed: int, allocate: int) -> None:
        """The sequence (``token_ids``: prompt + generated so far) has the KV of its first ``computed``
        tokens and needs room for ``allocate``: allocate, then cache the blocks that became full."""
        seq = self._seqs[seq_id]
        self._allocate(seq, allocate)
        self._store(seq, token_ids, min(computed, len(token_ids)))

    def release(self, seq_id: str) -> None:
        """A sequence finished (or was aborted): unreference its blocks, tail first; return its reservation."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._reserved -= seq.reserved
        idle_uncached: list[int] = []
        for b in reversed(seq.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    idle_uncached.append(b)
                else:
                    self._free[b] = None  # the tail: evicted last
        for b in reversed(idle_uncached):  # the head, first of them first: reused first
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def reset(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); refused while sequences hold blocks."""
        if self.used_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_gpu_blocks
        if self.enable_caching:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # -- internals -------------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _allocate(self, seq: Admission, tokens: int) -> None:
        want = self.blocks_for(tokens) - len(seq.blocks)
        while want > 0:
            if seq.reserved > 0:
                seq.reserved -= 1
                self._reserved -= 1
            elif len(self._free) <= self._reserved:
                return  # past its reservation and out of room: it goes on without caching more
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            seq.blocks.append(block)
            want -= 1

    def _evict(self, block: int) -> None:
        digest = self._hash[block]
        if digest is None:
            return
        self._hash[block] = None
        holders = self._cached[digest]
        holders.remove(block)
        if not holders:
            del self._cached[digest]
        self._events.append(BlockRemoved([external_hash(digest)], self.medium))

    def _store(self, seq: Admission, token_ids: Sequence[int], computed: int) -> None:
        if not self.enable_caching:
            return
        full = min(computed // self.block_size, len(seq.blocks))
        if full <= seq.stored:
            return
        if len(seq.hashes) < full:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += block_hashes(token_ids[:full * self.block_size], self.block_size, seq.root or self.root,
                                       start=len(seq.hashes), parent=parent)
        first = seq.stored
        for i in range(first, full):
            block, digest = seq.blocks[i], seq.hashes[i]
            self._hash[block] = digest
            self._cached.setdefault(digest, []).append(block)
        seq.stored = full
        bs = self.block_size
        self._events.append(BlockStored(
            [external_hash(h) for h in seq.hashes[first:full]],
            external_hash(seq.hashes[first - 1]) if first else None,
            list(token_ids[first * bs:full * bs]), bs, medium=self.medium))
