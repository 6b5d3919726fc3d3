"""The gateway's index of cached blocks: our block keys, events applied, prefix matching, the routed fallback."""

from __future__ import annotations

import time

import pytest

from orchestrator.devtools.simcache import PrefixCache
from orchestrator.devtools.simkvevents import encode_batch
from orchestrator.gateway.kvevents import decode_batch
from orchestrator.gateway.kvindex import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvIndex,
    ReplicaIndex,
    RoutedKeys,
    block_keys,
)

TOKENS = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16, 4 left over


def stored(hashes, parent, tokens, bs=16, **kw) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, **kw)


@pytest.mark.parametrize("n_tokens, block_size, n_keys", [
    (0, 16, 0), (15, 16, 0), (16, 16, 1), (100, 16, 6), (100, 32, 3), (100, 1, 100), (4000, 16, 250),
])
def test_block_keys_one_per_full_block(n_tokens, block_size, n_keys):
    keys = block_keys(list(range(n_tokens)), block_size)
    assert len(keys) == n_keys
    assert all(0 <= k < 2**64 for k in keys)
    assert len(set(keys)) == n_keys


def test_block_keys_are_chained_prefix_keys():
    keys = block_keys(TOKENS, 16)
    assert block_keys(TOKENS[:32], 16) == keys[:2]  # a key names its whole prefix
    assert block_keys(TOKENS[:40], 16) == keys[:2]  # the partial tail block has none
    assert block_keys(TOKENS, 16) == keys  # deterministic
    changed = TOKENS[:20] + [7] + TOKENS[21:]  # a token of block 1 changed: block 0 same, the rest differ
    other = block_keys(changed, 16)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))
    repeated = block_keys(TOKENS[:16] * 2, 16)  # the same block at two positions: two keys
    assert repeated[0] != repeated[1]
    with pytest.raises(ValueError):
        block_keys(TOKENS, 0)


def test_stored_chain_and_prefix():
    idx = ReplicaIndex(16)
    keys = block_keys(TOKENS, 16)
    assert idx.apply(stored([b"h0", b"h1"], None, TOKENS[:32]))
    assert idx.apply(stored([b"h2"], b"h1", TOKENS[32:48]))  # continues the chain
    assert len(idx) == 3 and idx.engine_blocks == 3 and idx.engine_block_size == 16
    assert idx.apply(stored([b"p0"], None, [], bs=0))   # an offloading connector's placeholder store
    assert idx.engine_block_size == 16 and idx.unaligned == 1   # is not the engine's block size
    assert idx.prefix(keys) == 3
    assert idx.prefix(keys[:2]) == 2
    assert idx.prefix(block_keys([5] * 64, 16)) == 0
    assert idx.prefix([]) == 0


@pytest.mark.parametrize("removed, expect_prefix", [
    ([b"h2"], 2), ([b"h1"], 1), ([b"h0"], 0), ([b"h0", b"h1", b"h2"], 0), ([b"nope"], 3),
])
def test_removed_blocks_cut_the_prefix(removed, expect_prefix):
    idx = ReplicaIndex(16)
    idx.apply(stored([b"h0", b"h1", b"h2"], None, TOKENS[:48]))
    idx.apply(BlockRemoved(block_hashes=removed))
    assert idx.prefix(block_keys(TOKENS, 16)) == expect_prefix
    assert idx.unknown_removals == (1 if removed == [b"nope"] else 0)


def test_duplicate_physical_blocks_are_counted():
    """Two copies of one hash (a request that found h0 cached computed h1 again while another one did):
    evicting one keeps the block."""
    idx = ReplicaIndex(16)
    idx.apply(stored([b"h0"], None, TOKENS[:16]))
    idx.apply(stored([b"h1"], b"h0", TOKENS[16:32]))
    idx.apply(stored([b"h1"], b"h0", TOKENS[16:32]))
    idx.apply(BlockRemoved(block_hashes=[b"h1"]))
    assert idx.prefix(block_keys(TOKENS, 16)) == 2
    idx.apply(BlockRemoved(block_hashes=[b"h1"]))
    assert idx.prefix(block_keys(TOKENS, 16)) == 1 and len(idx) == 1


def test_a_recomputed_first_block_is_a_second_copy():
    """A prompt of exactly one cached block computes it again (vLLM never serves the last prompt token from
    cache) and stores a second copy from the root: evicting one copy keeps the block (the store was taken for a
    kv_cache_report_mode=full re-announcement, and the first eviction erased a block the engine still held)."""
    idx = ReplicaIndex(16)
    idx.apply(stored([b"h0", b"h1"], None, TOKENS[:32]))
    idx.apply(stored([b"h0"], None, TOKENS[:16]))          # the one-block prompt's own copy
    idx.apply(BlockRemoved(block_hashes=[b"h0"]))          # one copy evicted
    assert idx.prefix(block_keys(TOKENS, 16)) == 2 and idx.engine_blocks == 2
    idx.apply(BlockRemoved(block_hashes=[b"h0"]))
    assert idx.prefix(block_keys(TOKENS, 16)) == 0


def test_an_evicted_root_duplicate_does_not_erase_the_hot_prefix():
    """The same through the simulator's block pool (vLLM's) and the wire format."""
    bs = 4
    cache = PrefixCache(block_size=bs, num_gpu_blocks=8)   # 7 usable blocks
    idx = ReplicaIndex(bs)

    def feed():
        events = cache.take_events()
        if events:
            for ev in decode_batch(encode_batch(events, 1.0))[1]:
                idx.apply(ev)
    doc = list(range(100, 112))           # 3 blocks: a hot document
    for rid, prompt in (("a", doc), ("b", doc[:bs]), ("c", doc)):   # b: exactly its first block, recomputed
        cache.admit(rid, prompt, 0)
        cache.release(rid)
        feed()
    for i in range(4):   # unrelated traffic evicts the least recently used blocks: b's copy of block 0 goes
        cache.admit(f"x{i}", [9000 + 10 * i + t for t in range(bs)], 0)
        cache.release(f"x{i}")
        feed()
    probe = doc + [7]
    engine = cache.hit_tokens(probe)
    assert engine >= bs
    assert min(idx.prefix(block_keys(probe, bs)) * bs, (len(probe) - 1) // bs * bs) == engine


def test_presence_mode():
    """count_copies=False: stores of one hash don't pile up; a removal forgets."""
    idx = ReplicaIndex(16, count_copies=False)
    for _ in range(3):
        idx.apply(stored([b"h0", b"h1"], None, TOKENS[:32]))
    idx.apply(BlockRemoved(block_hashes=[b"h1"]))
    assert idx.prefix(block_keys(TOKENS, 16)) == 1 and idx.engine_blocks == 1
    assert KvIndex(count_copies=False).replica("j").count_copies is False


def test_all_blocks_cleared_and_clear():
    idx = ReplicaIndex(16)
    idx.apply(stored([1, 2], None, TOKENS[:32]))  # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) work too
    assert len(idx) == 2
    assert idx.apply(AllBlocksCleared())
    assert len(idx) == 0 and idx.engine_blocks == 0
    idx.apply(stored([1], None, TOKENS[:16]))
    idx.clear()
    assert len(idx) == 0
    with pytest.raises(TypeError):
        idx.apply("not an event")


def test_unknown_parent_is_reported_and_skipped():
    idx = ReplicaIndex(16)
    assert idx.apply(stored([b"h5"], b"never-seen", TOKENS[80:96])) is False
    assert idx.unknown_parents == 1 and len(idx) == 0


def test_child_of_an_evicted_parent_still_chains():
    idx = ReplicaIndex(16)
    keys = block_keys(TOKENS, 16)
    idx.apply(stored([b"h0"], None, TOKENS[:16]))
    idx.apply(BlockRemoved(block_hashes=[b"h0"]))
    assert idx.apply(stored([b"h1"], b"h0", TOKENS[16:32]))  # the parent's keys are still remembered
    assert idx.prefix(keys) == 0 and keys[1] in idx
    idx.apply(stored([b"h0"], None, TOKENS[:16]))
    assert idx.prefix(keys) == 2


def test_engine_blocks_larger_than_ours():
    """An engine block of 64 tokens holds 4 index blocks of 16: replicas compare in one unit."""
    idx = ReplicaIndex(16)
    idx.apply(stored([b"big0"], None, TOKENS[:64], bs=64))
    keys = block_keys(TOKENS, 16)
    assert idx.prefix(keys) == 4 and len(idx) == 4 and idx.engine_blocks == 1
    idx.apply(BlockRemoved(block_hashes=[b"big0"]))
    assert idx.prefix(keys) == 0


def test_a_block_held_first_by_a_placeholder_store_is_matched_once_its_tokens_come():
    """A placeholder store (block_size 0, no tokens) held the hash with no keys; a later store of it with its
    tokens only counted a copy, so the block and every child of it were never matched."""
    idx = ReplicaIndex(16)
    keys = block_keys(TOKENS, 16)
    assert idx.apply(stored([b"a"], None, [], bs=0))
    assert idx.apply(stored([b"a"], None, TOKENS[:16]))
    assert idx.apply(stored([b"b"], b"a", TOKENS[16:32]))
    assert idx.prefix(keys) == 2 and len(idx) == 2
    idx.apply(BlockRemoved(block_hashes=[b"a", b"a", b"b"]))   # both copies of a go, and b
    assert len(idx) == 0 and idx.engine_blocks == 0
    presence = ReplicaIndex(16, count_copies=False)
    presence.apply(stored([b"a"], None, [], bs=0))
    presence.apply(stored([b"a"], None, TOKENS[:16]))
    assert presence.prefix(keys) == 1


def test_a_partial_block_store_is_skipped_not_taken_for_events_missed():
    """vLLM's cache_partial_block: a full-attention group of 64-token blocks over 16-token hash blocks stores a
    prompt's tail up to its last 16-token boundary as one 16-token store whose parent, the hash at the boundary
    before, no store named.  It was an unknown parent (the feed rebuilt from seq 0, the replica approximate)."""
    idx = ReplicaIndex(16)
    keys = block_keys(TOKENS, 16)
    assert idx.apply(stored([b"big0"], None, TOKENS[:64], bs=64))
    assert idx.apply(stored([b"tail96"], b"fine80", TOKENS[80:96], bs=16)) is True
    assert idx.unknown_parents == 0 and idx.partial == 1 and idx.engine_block_size == 64
    assert idx.apply(stored([b"tail80"], b"big0", TOKENS[64:80], bs=16))   # its parent known: skipped all the same
    assert idx.partial == 2 and idx.prefix(keys) == 4 and idx.engine_blocks == 1
    assert idx.apply(BlockRemoved(block_hashes=[b"tail80"])) and idx.prefix(keys) == 4


@pytest.mark.parametrize("event", [
    stored([b"u0"], None, TOKENS[:24], bs=24),  # not a multiple of our 16
    stored([b"u0"], None, TOKENS[:20], bs=16),  # tokens don't fit the blocks
    stored([b"u0"], None, TOKENS[:16], lora_name="adapter"),  # LoRA: a plain-token prompt would not hit it
    stored([b"u0"], None, TOKENS[:16], extra_keys=[("salt",)]),  # cache salt / multimodal
])
def test_unmatchable_blocks_are_known_but_never_matched(event):
    idx = ReplicaIndex(16)
    assert idx.apply(event)
    assert len(idx) == 0 and idx.engine_blocks == 1
    # a child of it is known too (no false "missed events"), and unmatchable as well
    assert idx.apply(stored([b"u1"], b"u0", TOKENS[16:32]))
    assert len(idx) == 0 and idx.unknown_parents == 0
    idx.apply(BlockRemoved(block_hashes=[b"u0", b"u1"]))
    assert idx.engine_blocks == 0 and idx.unknown_removals == 0


def test_extra_keys_taint_from_their_block_on():
    idx = ReplicaIndex(16)
    idx.apply(stored([b"a", b"b", b"c"], None, TOKENS[:48], extra_keys=[None, ("mm", 0), None]))
    assert idx.prefix(block_keys(TOKENS, 16)) == 1 and len(idx) == 1


def test_routed_keys_lru():
    lru = RoutedKeys(limit=4)
    a, b = block_keys(TOKENS[:48], 16), block_keys([9] * 48, 16)
    lru.add(a)
    assert lru.prefix(a) == 3
    lru.add(b)  # 6 keys > 4: a's two tail keys go, its first stays (a prefix outlives its tail)
    assert len(lru) == 4 and lru.prefix(b) == 3 and lru.prefix(a) == 1
    lru.add(a[:1])  # refreshed: now newest
    lru.add(block_keys([8] * 32, 16))
    assert lru.prefix(a) == 1
    with pytest.raises(ValueError):
        RoutedKeys(0)


def test_kvindex_match_exact_and_approximate():
    kv = KvIndex(block_size=16, routed_limit=100)
    keys = kv.keys(TOKENS)
    assert keys == block_keys(TOKENS, 16)
    exact = kv.replica("job-exact")
    exact.approximate = False
    exact.apply(stored([b"h0", b"h1"], None, TOKENS[:32]))
    kv.record("job-exact", keys)  # ignored: its events are trusted
    lagging = kv.replica("job-lagging")  # a feed that lost events: events and routed keys both count
    lagging.apply(stored([b"h0"], None, TOKENS[:16]))
    kv.record("job-lagging", keys[:4])
    kv.record("job-nofeed", keys[:3])
    assert kv.match(keys) == {"job-exact": 2, "job-lagging": 4, "job-nofeed": 3}
    assert kv.match(keys, ["job-exact", "unknown"]) == {"job-exact": 2, "unknown": 0}
    assert kv.approximate("job-lagging") and kv.approximate("job-nofeed") and not kv.approximate("job-exact")
    assert kv.size("job-exact") == 2 and kv.size("job-nofeed") == 3 and kv.size("unknown") == 0
    assert kv.job_ids() == ["job-exact", "job-lagging", "job-nofeed"]
    kv.drop("job-lagging")
    kv.drop("job-nofeed")
    kv.drop("never")
    assert kv.match(keys) == {"job-exact": 2}
    assert kv.replica("job-exact") is exact


def test_a_long_prompt_matches_every_replica_that_holds_it_whole():
    """A 4,000-token prompt (250 keys) against 8 replicas that all hold it (the worst case: no early miss).  Its
    time is printed for a look, not asserted (speed lives in bench/: routing_quality's gateway overhead)."""
    kv = KvIndex(block_size=16)
    tokens = list(range(5000, 9000))
    t0 = time.perf_counter()
    keys = kv.keys(tokens)
    key_s = time.perf_counter() - t0
    for r in range(8):
        idx = kv.replica(f"job-{r}")
        idx.approximate = False
        idx.apply(stored([f"b{i}".encode() for i in range(250)], None, tokens, bs=16))
    assert kv.match(keys) == {f"job-{r}": 250 for r in range(8)}
    rounds = 200
    t0 = time.perf_counter()
    for _ in range(rounds):
        kv.match(keys)
    per = (time.perf_counter() - t0) / rounds
    print(f"\nblock_keys(4000 tokens): {key_s * 1e3:.3f} ms; match(250 keys, 8 replicas): {per * 1e6:.0f} us")


def test_a_prefix_outlives_its_tail_in_the_routed_lru():
    # (keys were added in prompt order: the first block aged out first, and with it every match)
    lru = RoutedKeys(limit=4)
    doc = [1, 2, 3]                 # one prompt's three block keys
    lru.add(doc)
    lru.add([100])                  # another request: room left, nothing evicted
    lru.add([200])                  # one more: one key of `doc` must go
    assert len(lru) == 4
    # the engine (vLLM frees a request's blocks tail first) keeps the prefix longest; so should the stand-in
    assert lru.prefix(doc) == 2, f"prefix remembered: {lru.prefix(doc)} (the first block was evicted first)"


def test_kvindex_fallback_loses_a_whole_document_when_its_first_block_ages_out():
    kv = KvIndex(block_size=4, routed_limit=8)
    doc = list(range(1000, 1024))   # 6 blocks
    keys = block_keys(doc, 4)
    kv.record("job-a", keys)
    kv.record("job-a", block_keys(list(range(5000, 5008)), 4))   # 2 more keys: 8, the limit
    kv.record("job-a", block_keys(list(range(6000, 6004)), 4))   # 1 more: the oldest key goes
    # 5 of the document's 6 blocks are still remembered, but none can be matched
    assert kv.match(keys, ["job-a"])["job-a"] >= 5
