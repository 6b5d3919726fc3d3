"""The simulator's logprobs and a completion's echo, over real HTTP, in vLLM's shapes and with vLLM's 400s; and an
evaluation harness's loglikelihood request (``echo``, ``logprobs``, ``max_tokens: 0``) through the gateway with
the openai SDK."""

from __future__ import annotations

import math
import urllib.error

import pytest

from conftest import metric_sum
from gateway_harness import Harness, Sim
from orchestrator.devtools import simlogprobs, simtokens
from orchestrator.devtools.simvocab import SimVocab
from test_simulator_tokens import call, chat, complete

MSGS = [{"role": "user", "content": "what is a prefix cache"}]


@pytest.fixture(scope="module")
def sim():
    s = Sim("logprobs", "--ttft-s", "0", "--tokens-per-s", "5000")
    yield s
    s.stop()


def test_a_chats_logprobs_name_each_token_with_its_top_ranks(sim):
    a = chat(sim, messages=MSGS, max_tokens=12, logprobs=True, top_logprobs=3, ignore_eos=True,
             return_token_ids=True)
    choice = a["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == a["usage"]["completion_tokens"] == 12
    assert [e["token"] for e in content] == [simtokens.token_text(t) for t in choice["token_ids"]]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert e["bytes"] == list(e["token"].encode()) and e["logprob"] <= 0
        tops = e["top_logprobs"]
        assert len(tops) == 3 and len({t["token"] for t in tops}) == 3
        assert tops[0]["token"] == e["token"] and tops[0]["logprob"] == e["logprob"]   # greedy: its own rank 1
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    # the same numbers streamed, a token a chunk (the role chunk has none)
    chunks = chat(sim, messages=MSGS, max_tokens=12, logprobs=True, top_logprobs=3, ignore_eos=True, stream=True)
    assert chunks[0]["choices"][0]["logprobs"] is None
    assert [c["choices"][0]["logprobs"]["content"][0] for c in chunks[1:]] == content
    # top_logprobs 0 (its default): the tokens' own, no ranks; none asked: null
    zero = chat(sim, messages=MSGS, max_tokens=4, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in zero] == [e["logprob"] for e in content[:4]] and all(
        e["top_logprobs"] == [] for e in zero)
    assert chat(sim, messages=MSGS, max_tokens=4)["choices"][0]["logprobs"] is None


def test_a_completions_logprobs_and_text_offsets(sim):
    a = complete(sim, prompt="the cache holds blocks", max_tokens=10, logprobs=2, ignore_eos=True)
    choice = a["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 10
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(10)]
    for tok, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == own and max(top.values()) == own and 1 <= len(top) <= 3   # the token, then 2 ranks
    # streamed: per chunk, the offsets going on
    chunks = complete(sim, prompt="the cache holds blocks", max_tokens=10, logprobs=2, ignore_eos=True, stream=True)
    got = [c["choices"][0]["logprobs"] for c in chunks]
    assert [g["text_offset"][0] for g in got] == lp["text_offset"]
    assert [g["top_logprobs"][0] for g in got] == lp["top_logprobs"]


def test_echo_puts_the_prompt_first_and_scores_a_greedy_continuation_as_greedy(sim):
    """What an evaluation harness's loglikelihood asks: the prompt echoed with its logprobs, no generation."""
    prompt = "score this sentence please"
    gen = complete(sim, prompt=prompt, max_tokens=8, logprobs=1)["choices"][0]
    whole = complete(sim, prompt=prompt, max_tokens=8, logprobs=1, echo=True)["choices"][0]
    n_prompt = len(simtokens.encode(prompt))
    assert whole["text"] == prompt + gen["text"]
    assert whole["logprobs"]["token_logprobs"][0] is None and whole["logprobs"]["top_logprobs"][0] is None
    assert whole["logprobs"]["token_logprobs"][n_prompt:] == gen["logprobs"]["token_logprobs"]
    # the continuation sent back as the prompt, echoed without generating: the same logprobs, each the top one
    scored = complete(sim, prompt=prompt + gen["text"], max_tokens=0, logprobs=1, echo=True)
    s = scored["choices"][0]
    assert s["text"] == prompt + gen["text"] and scored["usage"]["completion_tokens"] == 1   # (vLLM generates one)
    tail = list(zip(s["logprobs"]["tokens"], s["logprobs"]["top_logprobs"]))[n_prompt:]
    assert s["logprobs"]["token_logprobs"][n_prompt:] == gen["logprobs"]["token_logprobs"]
    assert all(max(top, key=top.get) == tok for tok, top in tail)   # is_greedy at every position
    # streamed: the first chunk holds the prompt (and its logprobs) with the first token
    chunks = complete(sim, prompt=prompt, max_tokens=8, logprobs=1, echo=True, stream=True)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(prompt) and len(first["logprobs"]["tokens"]) == n_prompt + 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    only = complete(sim, prompt=prompt, max_tokens=0, echo=True, stream=True)
    assert len(only) == 1 and only[0]["choices"][0]["text"] == prompt and only[0]["choices"][0]["logprobs"] is None
    # without echo, max_tokens 0 is vLLM's 400
    with pytest.raises(urllib.error.HTTPError) as e:
        complete(sim, prompt=prompt, max_tokens=0)
    assert e.value.code == 400


@pytest.mark.parametrize("path,body,msg", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21},
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -2}, "`top_logprobs` must be a positive value or -1."),
    ("/v1/completions", {"logprobs": -1}, "Requested sample logprobs of 50000, which is greater than max allowed: 20"),
    ("/v1/completions", {"logprobs": "two"}, "`logprobs` must be an integer."),
    ("/v1/completions", {"prompt_logprobs": "two"}, "`prompt_logprobs` must be an integer."),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ("/v1/chat/completions", {"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ("/v1/completions", {"prompt_logprobs": 21}, "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt_logprobs": 1.5},
     "prompt_logprobs: Input should be a valid integer, got a number with a fractional part"),
])
def test_logprobs_vllm_refuses(sim, path, body, msg):
    base = {"messages": MSGS} if "chat" in path else {"prompt": "hello"}
    with pytest.raises(urllib.error.HTTPError) as e:
        call(sim, path, **base, **body)
    assert e.value.code == 400
    err = __import__("json").loads(e.value.read())["error"]
    assert err["message"] == msg and err["type"] == "BadRequestError"


def test_prompt_logprobs_score_every_prompt_token_and_skip_reading_the_prefix_cache(sim):
    """vLLM's ``prompt_logprobs``: per prompt position (the first none) the prompt token's logprob, rank and text,
    with the top K ranks'; a request that asks computes its prompt whole (``skip_reading_prefix_cache``: no
    lookup counted, no hit), a chat's ``echo`` asking for K = its ``top_logprobs`` (0)."""
    prompt = " ".join(f"the shared context of document part {i}" for i in range(8))   # (whole blocks of 16)
    ids = simtokens.encode(prompt)

    def counters():
        text = sim.get("/metrics").decode()
        return metric_sum(text, "vllm:prefix_cache_queries_total"), metric_sum(text, "vllm:prefix_cache_hits_total")
    complete(sim, prompt=prompt, max_tokens=2)   # (cached now)
    q0, h0 = counters()
    plain = complete(sim, prompt=prompt, max_tokens=2)["choices"][0]
    q1, h1 = counters()
    assert plain["prompt_logprobs"] is None and q1 - q0 == len(ids) and h1 > h0   # (read from the cache)
    for k in (0, 2):
        got = complete(sim, prompt=prompt, max_tokens=2, prompt_logprobs=k, n=2)
        q2, h2 = counters()
        assert (q2, h2) == (q1, h1)   # the cache not read, nothing counted
        lps = got["choices"][0]["prompt_logprobs"]
        assert got["choices"][1]["prompt_logprobs"] == lps and len(lps) == len(ids) and lps[0] is None
        for i, pos in enumerate(lps[1:], 1):
            own = pos[str(ids[i])]
            assert next(iter(pos)) == str(ids[i])   # the prompt's token first, as vLLM's (clients read it so)
            assert own["decoded_token"] == simtokens.token_text(ids[i]) and own["logprob"] < 0
            assert k <= len(pos) <= k + 1 and sorted(e["rank"] for e in pos.values())[:k] == list(range(1, k + 1))
            assert (own["rank"] <= k) == (len(pos) == k) and (k > 0 or own["rank"] >= 1)
    # a chat's echo asks for its top_logprobs' worth: 0 by default, the token's own entry
    for extra in ({}, {"top_logprobs": None}):   # (null is vLLM's 0)
        c = chat(sim, messages=MSGS, max_tokens=2, echo=True, **extra)
        assert c["prompt_logprobs"][0] is None and all(len(p) == 1 for p in c["prompt_logprobs"][1:])
    assert chat(sim, messages=MSGS, max_tokens=2)["prompt_logprobs"] is None


def test_a_positions_numbers_are_the_contexts_and_rank_one_is_greedy():
    v = SimVocab()
    ctx = simtokens.encode("a b c d")
    greedy = v.predict(ctx)
    pos = simlogprobs.position(v, ctx, greedy, 5)
    assert pos[0][0] == greedy and len(pos) == 5 and len({t for t, _ in pos}) == 5
    assert [lp for _, lp in pos] == sorted((lp for _, lp in pos), reverse=True)
    assert sum(math.exp(lp) for _, lp in simlogprobs.position(v, ctx, greedy, 20)) <= 1.0
    others = [t for t in range(200, 400) if t not in {x for x, _ in simlogprobs.position(v, ctx, greedy, 20)}]
    for other in others:   # not a rank: below every rank listed, even the 20th
        below = simlogprobs.position(v, ctx, other, 5)
        assert below[0][0] == other and below[1:] == pos and below[0][1] < pos[-1][1]
        assert below[0][1] < simlogprobs.position(v, ctx, other, 20)[-1][1]
    assert simlogprobs.position(v, ctx, greedy, 5) == pos   # the same context, the same numbers
    assert simlogprobs.position(v, [*ctx, 7], greedy, 5) != pos


def test_where_greedy_decoding_ends_eos_is_rank_one_and_ignore_eos_s_token_rank_two():
    """vLLM's logprobs are the model's, whatever ignore_eos: where the generator would end, EOS is rank 1 and the
    token an ignore_eos request writes there rank 2 (it scored as an unlikely token)."""
    v = SimVocab()
    ctx = next([100, i] for i in range(100, 100_000) if v.predict([100, i]) == simtokens.EOS)
    written = next(simtokens.generate(ctx, 1, {"ignore_eos": True}))
    assert written != simtokens.EOS and v.predict(ctx, ignore_eos=True) == written
    pos = simlogprobs.position(v, ctx, written, 2)
    assert [t for t, _ in pos] == [written, simtokens.EOS] and pos[0][1] < pos[1][1]
    assert simlogprobs.position(v, ctx, written, 0)[0] == pos[0]   # (its number, listed or not)


def test_an_evaluation_harness_loglikelihood_through_the_gateway(tmp_path):
    """The openai SDK's completions with echo, logprobs and max_tokens 0 pass through the gateway as they are."""
    import openai
    s = Sim("logprobs-gw", "--ttft-s", "0", "--tokens-per-s", "2000")
    h = Harness(tmp_path, "  - name: m\n    engine: simulator\n    container: {enabled: false}\n",
                "api_keys:\n  - {name: bob, key: sk-bob}")
    try:
        h.set_ready([s.backend()])
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="sk-bob", max_retries=0)
        r = c.completions.create(model="m", prompt="context t123 t456 t789", max_tokens=0, echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == "context t123 t456 t789" and lp.token_logprobs[0] is None
        assert len(lp.tokens) == 4 and all(x < 0 for x in lp.token_logprobs[1:])
        direct = complete(s, prompt="context t123 t456 t789", max_tokens=0, echo=True, logprobs=1)
        assert lp.token_logprobs == direct["choices"][0]["logprobs"]["token_logprobs"]
        chat_r = c.chat.completions.create(model="m", messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2,
                                             extra_body={"ignore_eos": True})
        assert [len(e.top_logprobs) for e in chat_r.choices[0].logprobs.content] == [2, 2, 2]
    finally:
        h.close()
        s.stop()
