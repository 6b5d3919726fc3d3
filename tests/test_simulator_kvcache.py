"""The simulator's prefix cache and KV-cache events: the cache's rules (as vLLM v1's), the simulator over real
HTTP (TTFT, metrics), its ZMQ publisher and replay socket, and vLLM's own code agreeing on hashes and bytes."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

from conftest import ROOT, free_port, metric_sum, wait_for
from gateway_harness import Sim
from orchestrator.devtools import simtokens
from orchestrator.devtools.simcache import (AllBlocksCleared, BlockRemoved, BlockStored, CacheFull, PrefixCache,
                                            block_hashes, chain_hash, external_hash, root_hash)
from orchestrator.devtools.simkvevents import END_SEQ, KVEventsSettings, encode_batch, event_to_wire

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = Path(os.environ.get("SLURMFLEET_MODEL_DIR", "/tmp/slurmfleet-models/tiny-llama"))


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def ext(prompt: list[int], bs: int) -> list[int]:
    return [external_hash(h) for h in block_hashes(prompt, bs, root_hash())]


# -- the cache ---------------------------------------------------------------------------------------------

def test_block_hashes_chain_on_their_parent():
    a, b = toks(100, 4), toks(200, 4)
    root = root_hash()
    assert block_hashes(a + b, 4, root) == [chain_hash(root, a), chain_hash(chain_hash(root, a), b)]
    assert block_hashes(b + b, 4, root)[1] != block_hashes(a + b, 4, root)[1]  # same tokens, other parent
    assert block_hashes(a + b + [1, 2, 3], 4, root) == block_hashes(a + b, 4, root)  # full blocks only
    assert root_hash("42") != root  # PYTHONHASHSEED, as vLLM, gives other hashes
    assert all(0 <= h < 2 ** 64 for h in ext(a + b, 4)) and len(chain_hash(root, a)) == 32


def test_hits_leave_the_last_token_to_compute_and_are_counted_in_tokens():
    c = PrefixCache(block_size=4, num_gpu_blocks=64)
    p8, p9 = toks(100, 8), toks(100, 9)
    first = c.admit("a", p8, 0)
    assert first.hit_tokens == 0 and (c.queries, c.hits) == (8, 0)
    [stored] = c.take_events()
    assert stored == BlockStored(ext(p8, 4), None, p8, 4)
    c.release("a")
    again = c.admit("b", p8, 0)  # all 8 cached, but the last token is computed: 1 block of 4 served
    assert again.hit_tokens == 4 and (c.queries, c.hits) == (16, 4)
    # vLLM recomputes the capped block and stores (and announces) it again, its parent the hit block
    assert c.take_events() == [BlockStored(ext(p8, 4)[1:], ext(p8, 4)[0], p8[4:], 4)]
    c.release("b")
    longer = c.admit("c", p9, 0)
    assert longer.hit_tokens == 8 and (c.queries, c.hits) == (25, 12)
    assert c.take_events() == []  # nothing new is full
    assert c.hit_tokens(toks(100, 9)) == 8 and c.hit_tokens(toks(101, 9)) == 0


def test_lru_eviction_takes_the_least_recently_used_cached_block():
    c = PrefixCache(block_size=4, num_gpu_blocks=4)  # 3 usable (one is vLLM's null block)
    a, b, cc, d, e = (toks(100 * k, 4) for k in range(1, 6))
    for sid, p in (("a", a), ("b", b), ("c", cc)):
        c.admit(sid, p, 0)
        c.release(sid)
    c.take_events()
    assert c.cached_blocks == 3 and c.usage() == 0.0
    c.admit("a2", a + [7], 0)  # touches a (a hit), needs one more block: b, the least recently used, goes
    assert c.take_events() == [BlockRemoved(ext(b, 4))]
    c.release("a2")
    c.admit("d", d, 0)  # the block a2 never filled is reused first: no eviction
    assert c.take_events() == [BlockStored(ext(d, 4), None, d, 4)]
    c.release("d")
    c.admit("e", e, 0)  # then the oldest cached one: c (a was touched after it, d is newer)
    assert c.take_events() == [BlockRemoved(ext(cc, 4)), BlockStored(ext(e, 4), None, e, 4)]
    root = root_hash()
    assert c.is_cached(chain_hash(root, a)) and c.is_cached(chain_hash(root, d))
    assert not c.is_cached(chain_hash(root, b)) and not c.is_cached(chain_hash(root, cc))


def test_capacity_makes_sequences_wait_and_shared_blocks_are_reference_counted():
    c = PrefixCache(block_size=4, num_gpu_blocks=5)  # 4 usable
    shared = toks(100, 8)
    s1 = c.admit("s1", shared + [1], 3)  # 9 + 3 tokens: 3 blocks reserved, 3 allocated
    assert s1 is not None and c.used_blocks == 3 and c.usage() == 0.75
    s2 = c.admit("s2", shared + [2], 0)  # shares 2 blocks, needs 1 of its own
    assert s2.hit_tokens == 8 and c.used_blocks == 4
    assert c.admit("s3", toks(500, 4), 0) is None  # no room: waits, and its lookup is not counted
    assert c.queries == 18
    c.release("s1")  # the shared blocks stay held by s2
    assert c.used_blocks == 3
    c.take_events()
    s3 = c.admit("s3", toks(500, 4), 0)  # takes s1's uncached tail block, evicts nothing that s2 holds
    assert s3 is not None and not any(isinstance(e, BlockRemoved) for e in c.take_events())
    assert c.hit_tokens(shared + [9]) == 8
    with pytest.raises(CacheFull):
        c.admit("huge", toks(1000, 17), 0)


def test_reservation_covers_the_generation_and_decode_blocks_are_stored_as_they_fill():
    c = PrefixCache(block_size=4, num_gpu_blocks=6)  # 5 usable
    prompt = toks(100, 6)
    c.admit("g", prompt, 10)  # 16 tokens: 4 blocks reserved, 2 allocated
    assert c.used_blocks == 2 and c.admit("other", toks(900, 8), 0) is None  # 2 blocks don't fit: 1 left
    c.take_events()
    seq = list(prompt)
    for tok in (7, 8, 9):
        seq.append(tok)
        c.advance("g", seq, len(seq) - 1, len(seq))
    # after 3 generated tokens 8 are computed: the second block (tokens 4-7) is full and stored
    [ev] = c.take_events()
    assert ev == BlockStored(ext(seq[:8], 4)[1:], ext(seq[:8], 4)[0], seq[4:8], 4)
    assert c.used_blocks == 3
    c.release("g")
    assert c.used_blocks == 0 and c.hit_tokens(seq[:8] + [1]) == 8
    # past its reservation a sequence takes blocks nobody reserved, and goes on without them when there are none
    small = PrefixCache(block_size=4, num_gpu_blocks=3)  # 2 usable
    long = toks(700, 4)
    small.admit("x", long, 0)
    for n in range(5, 14):
        small.advance("x", toks(700, n), n - 1, n)
    assert small.used_blocks == 2
    small.release("x")
    assert small.used_blocks == 0


def test_reset_and_no_caching():
    c = PrefixCache(block_size=4, num_gpu_blocks=8)
    c.admit("a", toks(100, 8), 0)
    assert c.reset() is False  # blocks in use
    c.release("a")
    c.take_events()
    assert c.reset() is True and c.take_events() == [AllBlocksCleared()]
    assert c.hit_tokens(toks(100, 9)) == 0
    off = PrefixCache(block_size=4, num_gpu_blocks=8, enable_caching=False)
    off.admit("a", toks(100, 8), 0)
    off.release("a")
    off.admit("b", toks(100, 9), 0)
    assert off.take_events() == [] and (off.queries, off.hits) == (0, 0) and off.used_blocks == 3


def test_settings_are_vllms():
    s = KVEventsSettings.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:1234"}')
    assert s.publisher == "zmq" and s.active and s.replay_endpoint is None and s.topic == "" and s.buffer_steps == 10000
    assert not KVEventsSettings.from_json(None).active and KVEventsSettings().publisher == "null"
    for bad in ('{"enable_kv_cache_events": true, "bogus": 1}', "[1]", "{", '{"publisher": "kafka"}'):
        with pytest.raises(ValueError):
            KVEventsSettings.from_json(bad)


# -- the simulator over HTTP and ZMQ -----------------------------------------------------------------------

def post(sim: Sim, path: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(sim.url + path, data=json.dumps({"model": "m", **body}).encode(),
                                  headers={"Content-Type": "application/json", "Authorization": f"Bearer {sim.secret}"})


def ttft(sim: Sim, prompt: str) -> float:
    """Seconds to the first streamed chunk (the whole answer is read)."""
    t0 = time.monotonic()
    with urllib.request.urlopen(post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "stream": True,
                                                               "ignore_eos": True}), timeout=60) as r:
        r.readline()
        first = time.monotonic() - t0
        r.read()
    return first


def complete(sim: Sim, prompt: str | list[int], max_tokens: int = 4) -> dict:
    with urllib.request.urlopen(post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                               "ignore_eos": True, "return_token_ids": True}),
                                timeout=60) as r:
        return json.loads(r.read())


def test_a_cached_prompt_is_prefilled_faster_and_counted_as_vllm_counts():
    sim = Sim("kvttft", "--ttft-s", "0", "--tokens-per-s", "1000", "--prefill-s-per-token", "0.005")
    try:
        words = " ".join(f"w{i}" for i in range(400))  # 400 simtokens ids: 2 s of prefill when missed
        cold = ttft(sim, words)
        warm = ttft(sim, words)  # 384 of 400 tokens cached (the last block is recomputed): 0.08 s
        assert cold >= 2.0 and warm < 1.0, (cold, warm)
        text = sim.get("/metrics").decode()
        assert metric_sum(text, "vllm:prefix_cache_queries_total") == 800
        assert metric_sum(text, "vllm:prefix_cache_hits_total") == 384
        assert metric_sum(text, "vllm:kv_cache_usage_perc") == 0  # nothing running
        assert 'block_size="16"' in text and 'num_gpu_blocks="4096"' in text  # vllm:cache_config_info
    finally:
        sim.stop()


def test_a_prefill_holds_up_the_next_request_and_blocks_make_requests_wait():
    # 2 usable blocks of 16: a 20-token prompt + 4 tokens takes both, the second request waits for them
    sim = Sim("kvwait", "--ttft-s", "0", "--tokens-per-s", "1", "--num-gpu-blocks-override", "3")
    try:
        results = []
        first = threading.Thread(target=lambda: results.append(complete(sim, "a " * 20, 4)))
        first.start()
        wait_for(lambda: sim.metric("vllm:num_requests_running") == 1, 15, "the first request running")
        assert sim.metric("vllm:kv_cache_usage_perc") > 0
        second = threading.Thread(target=lambda: results.append(complete(sim, "b " * 20, 4)))
        second.start()
        wait_for(lambda: sim.metric("vllm:num_requests_waiting") == 1, 15, "the second request waiting for blocks")
        assert sim.metric("vllm:num_requests_running") == 1
        first.join(30)
        second.join(30)
        assert len(results) == 2 and sim.metric("vllm:num_requests_waiting") == 0
        with pytest.raises(urllib.error.HTTPError) as e:  # more than the whole cache
            complete(sim, "c " * 40, 1)
        assert e.value.code == 400
    finally:
        sim.stop()


class Subscriber:
    """A ZMQ SUB on the simulator's events (and a DEALER on its replay socket)."""

    def __init__(self, port: int, replay_port: int, topic: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_port = replay_port

    def recv(self, timeout: float = 10.0) -> tuple[bytes, int, bytes] | None:
        if not self.sub.poll(int(timeout * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), payload

    def drain(self, quiet: float = 1.0) -> list[tuple[bytes, int, bytes]]:
        out = []
        while (m := self.recv(quiet)) is not None:
            out.append(m)
        return out

    def replay(self, start: int) -> list[tuple[bytes, int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(15000), "no replay answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                break
            out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
        dealer.close(0)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)   # (its sockets closed first: term() alone waits for ever on one left open)


def events_sim(name: str, *extra: str) -> tuple[Sim, Subscriber]:
    port, replay = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
           "replay_endpoint": f"tcp://*:{replay}", "topic": f"kv.{name}"}
    sim = Sim(name, "--ttft-s", "0", "--tokens-per-s", "2000", "--kv-events-config", json.dumps(cfg), *extra)
    sub = Subscriber(port, replay, f"kv.{name}")
    # a SUB misses what is sent before its subscription reaches the publisher: warm up until one arrives
    n = 0
    while True:
        complete(sim, f"warm up {n} " + "x " * 16, 1)
        if sub.recv(1.0) is not None:
            break
        n += 1
        assert n < 30, "no KV event reached the subscriber"
    sub.drain(0.5)
    return sim, sub


def decode(payload: bytes) -> list:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def test_events_reach_a_subscriber_in_vllms_format_and_replay_from_a_sequence_number():
    # 9 usable blocks of 4 tokens: a few prompts evict each other
    sim, sub = events_sim("kvev", "--block-size", "4", "--num-gpu-blocks-override", "10")
    try:
        got = []
        prompts = [[1000 + 50 * k + i for i in range(10)] for k in range(5)]
        for p in prompts:
            out = complete(sim, p, 3)
            assert out["choices"][0]["prompt_token_ids"] == p
            got += sub.drain(1.0)
        seqs = [s for _, s, _ in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # consecutive, one a batch
        assert {t for t, _, _ in got} == {b"kv.kvev"}
        batches = [decode(pl) for _, _, pl in got]
        assert all(len(b) == 3 and isinstance(b[0], float) and b[2] == 0 for b in batches)
        events = [e for b in batches for e in b[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        # the first prompt's 2 full blocks, stored at admission, in vLLM's field order and values
        assert stored[0] == {"type": "BlockStored", "block_hashes": ext(prompts[0], 4), "parent_block_hash": None,
                             "token_ids": prompts[0][:8], "block_size": 4, "lora_id": None, "medium": "GPU",
                             "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                             "kv_cache_spec_kind": "full_attention"}
        assert list(stored[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                   "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
        # generated tokens fill the third block (10 + 3 tokens, 12 computed): stored, chained on the second
        gen = complete(sim, prompts[0], 3)["choices"][0]["token_ids"]
        assert stored[1]["parent_block_hash"] == ext(prompts[0], 4)[1]
        assert stored[1]["token_ids"] == prompts[0][8:] + gen[:2]
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        assert any(e["block_hashes"][0] in {h for s in stored for h in s["block_hashes"]} for e in removed)
        assert removed and all(e == {"type": "BlockRemoved", "block_hashes": e["block_hashes"], "medium": "GPU",
                                     "group_idx": 0} and len(e["block_hashes"]) == 1 for e in removed)
        # replay from the middle: the same frames again, then the end marker
        later = sub.replay(seqs[2])
        assert [(t, s, p) for t, s, p in later if s <= seqs[-1]] == got[2:]
        # a reset clears the cache: AllBlocksCleared
        sub.drain(0.5)
        with urllib.request.urlopen(post(sim, "/reset_prefix_cache", {}), timeout=10) as r:
            assert json.loads(r.read()) == {"success": True}
        [(_, _, payload)] = sub.drain(1.0)
        assert decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close()
        sim.stop()


# -- vLLM's own code agrees ------------------------------------------------------------------------------

VLLM_CHECK = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
import vllm.v1.core.kv_cache_utils as u
from vllm.utils.hashing import sha256
inp = json.load(open(sys.argv[1]))
u.init_none_hash(sha256)
hashes, parent = [], None
for b in range(len(inp["tokens"]) // inp["bs"]):
    parent = u.hash_block_tokens(sha256, parent, inp["tokens"][b * inp["bs"]:(b + 1) * inp["bs"]])
    hashes.append(u.maybe_convert_block_hash(parent))
sample = KVEventBatch(ts=1.25, events=[
    BlockStored(block_hashes=[2 ** 64 - 1, 3], parent_block_hash=None, token_ids=[1, 2], block_size=16,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                kv_cache_spec_kind="full_attention"),
    BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared()], data_parallel_rank=0)
dec = msgspec.msgpack.Decoder(KVEventBatch)
decoded = []
for hx in inp["payloads"]:
    batch = dec.decode(bytes.fromhex(hx))
    decoded.append([batch.ts, batch.data_parallel_rank,
                    [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events]])
print(json.dumps({"hashes": hashes, "sample": msgspec.msgpack.encode(sample).hex(), "decoded": decoded}))
"""


@pytest.mark.skipif(not VLLM_PY.exists(), reason="needs .venv-vllm (.ci/setup-vllm)")
def test_vllms_code_computes_the_same_hashes_encodes_the_same_bytes_and_decodes_the_stream(tmp_path):
    sim, sub = events_sim("kvvllm", "--block-size", "16")
    try:
        prompt = [int(t) for t in toks(300, 70)]
        complete(sim, prompt, 20)
        got = sub.drain(1.0)
    finally:
        sub.close()
        sim.stop()
    assert got
    tokens = [t * 7919 % 50000 for t in range(200)]
    payloads = [p.hex() for _, _, p in got]
    (tmp_path / "in.json").write_text(json.dumps({"tokens": tokens, "bs": 16, "payloads": payloads}))
    (tmp_path / "check.py").write_text(VLLM_CHECK)
    out = subprocess.run([str(VLLM_PY), str(tmp_path / "check.py"), str(tmp_path / "in.json")], capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["hashes"] == ext(tokens, 16)  # vLLM's default sha256 chain, published as 64-bit ints
    ours = encode_batch([BlockStored([2 ** 64 - 1, 3], None, [1, 2], 16), BlockRemoved([7]), AllBlocksCleared()],
                        1.25, 0)
    assert res["sample"] == ours.hex()  # byte for byte what msgspec makes of vLLM's KVEventBatch
    # what the simulator published, decoded by vLLM's own typed decoder, is what the simulator meant
    assert [d[1] for d in res["decoded"]] == [0] * len(got)
    theirs = [(name, {k: v for k, v in fields.items() if v is not None and k != "type"})
              for d in res["decoded"] for name, fields in d[2]]
    mine = [(e["type"], {k: v for k, v in e.items() if k != "type" and v is not None})
            for _, _, p in got for e in decode(p)[1]]
    assert theirs == mine and mine[0][1]["block_hashes"] == ext(prompt, 16)
    assert event_to_wire(BlockRemoved([5])) == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU",
                                                "group_idx": 0}


@pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").is_file(), reason="needs the tiny model's tokenizer")
def test_with_a_model_directory_prompts_are_the_models_tokens_and_resume_exactly():
    from orchestrator.prompttokens import PromptTokenizer
    tok = PromptTokenizer.from_dir(TINY_MODEL)
    sim = Sim("kvmodel", str(TINY_MODEL), "--ttft-s", "0", "--tokens-per-s", "2000")
    try:
        body = {"messages": [{"role": "user", "content": "Hello there, how are you?"}]}
        with urllib.request.urlopen(post(sim, "/v1/chat/completions", {**body, "max_tokens": 12, "ignore_eos": True,
                                                                       "return_token_ids": True}), timeout=30) as r:
            out = json.loads(r.read())
        assert out["prompt_token_ids"] == tok.prompt_ids({"model": "m", **body}, chat=True)
        ids = out["choices"][0]["token_ids"]
        assert len(ids) == 12 and all(0 <= t < tok.vocab_size for t in ids)
        assert out["choices"][0]["message"]["content"] == tok.decode(ids, skip_special_tokens=True)
        full = complete(sim, "Once upon a time", 10)["choices"][0]
        rest = complete(sim, full["prompt_token_ids"] + full["token_ids"][:4], 6)["choices"][0]
        assert rest["token_ids"] == full["token_ids"][4:]
        with pytest.raises(urllib.error.HTTPError) as e:
            complete(sim, [tok.vocab_size + 5], 1)
        assert e.value.code == 400
        # vLLM's /detokenize, which the gateway asks where a cut may end in half a character: an emoji's byte
        # tokens read whole, and without their last byte end in U+FFFD
        emoji = tok.encode("a \U0001f999", add_special_tokens=False)
        assert len(emoji) > 3   # (its bytes are tokens of their own)

        def detok(ids):
            with urllib.request.urlopen(post(sim, "/detokenize", {"model": "kvmodel", "tokens": ids}), timeout=30) as r:
                return json.loads(r.read())["prompt"]
        assert detok(emoji) == "a \U0001f999" and detok(emoji[:-1]).endswith("\ufffd")
        with pytest.raises(urllib.error.HTTPError) as e:
            detok([tok.vocab_size + 5])
        assert e.value.code == 400
    finally:
        sim.stop()
    assert simtokens.VOCAB != tok.vocab_size  # the ids above were the model's, not simtokens'
