"""The simulator's tokens, over real HTTP: deterministic, resumable from token ids, returned as vLLM does."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from conftest import present
from gateway_harness import Sim
from orchestrator.devtools import simtokens
from orchestrator.devtools.simengine import RequestError, max_tokens_of


@pytest.fixture(scope="module")
def sim():
    s = Sim("tokens", "--ttft-s", "0", "--tokens-per-s", "5000")
    yield s
    s.stop()


def call(sim: Sim, path: str, **body) -> dict | list[dict]:
    """POST to the simulator: the JSON answer, or for ``stream`` the list of SSE data objects (and a final "[DONE]")."""
    req = urllib.request.Request(sim.url + path, data=json.dumps({"model": "m", **body}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {sim.secret}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        if not body.get("stream"):
            return json.loads(r.read())
        events = [ln[6:] for ln in r.read().decode().split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def complete(sim: Sim, **body) -> dict:
    return call(sim, "/v1/completions", **body)


def chat(sim: Sim, **body) -> dict:
    return call(sim, "/v1/chat/completions", **body)


def test_greedy_is_deterministic_and_text_is_the_tokens(sim):
    a = complete(sim, prompt="tell me a story", max_tokens=20, return_token_ids=True)
    b = complete(sim, prompt="tell me a story", max_tokens=20, return_token_ids=True, temperature=0)
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["token_ids"] == cb["token_ids"] and ca["text"] == cb["text"]
    assert ca["prompt_token_ids"] == simtokens.encode("tell me a story") and len(ca["prompt_token_ids"]) == 4
    assert ca["text"] == "".join(f" t{t}" for t in ca["token_ids"])
    assert all(simtokens.FIRST_WORD <= t < simtokens.VOCAB for t in ca["token_ids"])
    assert present(a["usage"]) == {"prompt_tokens": 4, "completion_tokens": 20, "total_tokens": 24}
    assert ca["finish_reason"] == "length"
    other = complete(sim, prompt="tell me another story", max_tokens=20, return_token_ids=True)
    assert other["choices"][0]["token_ids"] != ca["token_ids"]
    # streamed: the same tokens, one a chunk
    chunks = complete(sim, prompt="tell me a story", max_tokens=20, stream=True, return_token_ids=True)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in ca["token_ids"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ca["text"]


@pytest.mark.parametrize("k", [0, 1, 7, 19])
def test_a_continuation_from_token_ids_goes_on_exactly(sim, k):
    full = complete(sim, prompt="resume me please", max_tokens=20, return_token_ids=True)["choices"][0]
    prompt, gen = full["prompt_token_ids"], full["token_ids"]
    rest = complete(sim, prompt=prompt + gen[:k], max_tokens=20 - k, return_token_ids=True)
    choice = rest["choices"][0]
    assert choice["prompt_token_ids"] == prompt + gen[:k]
    assert choice["token_ids"] == gen[k:]
    assert choice["text"] == simtokens.decode(gen[k:]) and full["text"] == simtokens.decode(gen[:k]) + choice["text"]
    assert present(rest["usage"]) == {"prompt_tokens": len(prompt) + k, "completion_tokens": 20 - k,
                             "total_tokens": len(prompt) + 20}
    # streamed the same way (what the gateway does on a resume)
    chunks = complete(sim, prompt=prompt + gen[:k], max_tokens=20 - k, stream=True, return_token_ids=True,
                      stream_options={"include_usage": True})
    assert [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]] == gen[k:]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20 - k


def test_prompt_forms_and_usage(sim):
    ids = simtokens.encode("hello big world")
    by_text = complete(sim, prompt="hello big world", max_tokens=5, return_token_ids=True)
    by_list = complete(sim, prompt=["hello big world"], max_tokens=5, return_token_ids=True)
    by_ids = complete(sim, prompt=ids, max_tokens=5, return_token_ids=True)
    by_ids_list = complete(sim, prompt=[ids], max_tokens=5, return_token_ids=True)
    for r in (by_list, by_ids, by_ids_list):
        assert r["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
        assert r["choices"][0]["prompt_token_ids"] == ids
        assert present(r["usage"]) == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    for bad in ([], [1, "x"], [simtokens.VOCAB], ["a", 7], [[1, 2], []], 7, None):
        with pytest.raises(urllib.error.HTTPError) as e:
            complete(sim, prompt=bad, max_tokens=2)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["code"] == 400


def test_several_prompts_and_n_choices_as_vllm_answers_them(sim):
    """vLLM serves a completion's list of prompts and n choices each (one engine request per choice, choice
    i being prompt i // n's, seeded seed + j); the simulator answered one choice of a single prompt (n ignored,
    a list of prompts refused), so a client or gateway path that depends on either could not be tested on it."""
    p0, p1 = simtokens.encode("hello big world"), simtokens.encode("a second prompt here")
    body = dict(prompt=["hello big world", p1], n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                return_token_ids=True)
    whole = complete(sim, **body)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [p0, p0, p1, p1]
    for c in whole["choices"]:   # choice j of a prompt samples as that prompt alone with seed 5 + j
        alone = complete(sim, prompt=c["prompt_token_ids"], temperature=1.0, seed=5 + c["index"] % 2, max_tokens=6,
                         ignore_eos=True, return_token_ids=True)
        assert c["token_ids"] == alone["choices"][0]["token_ids"] and c["text"] == alone["choices"][0]["text"]
    assert whole["choices"][0]["token_ids"] != whole["choices"][1]["token_ids"]
    assert present(whole["usage"]) == {"prompt_tokens": len(p0) + len(p1), "completion_tokens": 24,
                              "total_tokens": len(p0) + len(p1) + 24}
    chunks = complete(sim, **body, stream=True, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == present(whole["usage"])
    by_index: dict[int, list[dict]] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, cs in by_index.items():   # each choice streamed whole: its prompt's ids first, its end last
        assert [t for c in cs for t in c["token_ids"]] == whole["choices"][i]["token_ids"]
        assert cs[0]["prompt_token_ids"] == whole["choices"][i]["prompt_token_ids"]
        assert [c["finish_reason"] for c in cs] == [None] * 5 + ["length"]
    # a chat: one prompt, its n choices' role chunks first; without a temperature the choices still differ
    chunks = chat(sim, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, ignore_eos=True,
                  stream=True, stream_options={"include_usage": True})
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"].get("role")) for c in chunks[:3]] == [
        (0, "assistant"), (1, "assistant"), (2, "assistant")]
    texts = {i: "".join(c["choices"][0]["delta"]["content"] for c in chunks[3:-1] if c["choices"][0]["index"] == i)
             for i in range(3)}
    assert len(set(texts.values())) == 3 and chunks[-1]["usage"]["completion_tokens"] == 12
    again = chat(sim, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, ignore_eos=True)
    assert [c["message"]["content"] for c in again["choices"]] == [texts[i] for i in range(3)]
    seeded = [complete(sim, prompt="hello there", n=3, seed=7.0, max_tokens=6, ignore_eos=True) for _ in range(2)]
    assert seeded[0]["choices"] == seeded[1]["choices"] and len({c["text"] for c in seeded[0]["choices"]}) == 3
    for bad, msg in (({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
                     ({"n": 0}, "n must be at least 1, got 0."), ({"n": "many"}, "n: Input should be a valid integer")):
        with pytest.raises(urllib.error.HTTPError) as e:
            complete(sim, prompt="x", max_tokens=2, **bad)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["message"] == msg


def test_without_the_flag_the_token_fields_are_null_where_vllm_sets_them(sim):
    # vLLM 0.32's own answers (captured from `vllm serve` on the tiny model): the fields it sets, null
    r = complete(sim, prompt="x", max_tokens=3)
    assert {k: r["choices"][0][k] for k in ("stop_reason", "token_ids", "prompt_token_ids")} == dict.fromkeys(
        ("stop_reason", "token_ids", "prompt_token_ids"))
    r = chat(sim, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert r["prompt_token_ids"] is None and r["choices"][0]["token_ids"] is None
    assert "stop_reason" in r["choices"][0] and r["choices"][0]["stop_reason"] is None
    chunks = call(sim, "/v1/completions", prompt="x", max_tokens=3, stream=True)
    assert all(c["choices"][0] | {"text": ""} == {"index": 0, "text": "", "logprobs": None, "finish_reason":
                                                  c["choices"][0]["finish_reason"], "stop_reason": None,
                                                  "prompt_token_ids": None, "token_ids": None} for c in chunks)
    head, *toks = call(sim, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                       stream=True)
    assert head["prompt_token_ids"] is None and head["prompt_text"] is None and "token_ids" not in head["choices"][0]
    assert all("prompt_token_ids" not in c and c["choices"][0]["token_ids"] is None for c in toks)
    assert ["stop_reason" in c["choices"][0] for c in toks] == [False, False, True]   # (the last chunk's only)


def test_return_token_ids_shapes_streamed(sim):
    chunks = complete(sim, prompt="a b c", max_tokens=4, stream=True, return_token_ids=True)
    assert len(chunks) == 4
    assert chunks[0]["choices"][0]["prompt_token_ids"] == simtokens.encode("a b c")
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert all(len(c["choices"][0]["token_ids"]) == 1 and "prompt_token_ids" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
    chunks = chat(sim, messages=msgs, max_tokens=4, stream=True, return_token_ids=True)
    head, toks = chunks[0], chunks[1:]  # vLLM: the role alone first, with the prompt's ids at the top level
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert head["prompt_token_ids"] == simtokens.encode(simtokens.render_chat(msgs))
    assert "token_ids" not in head["choices"][0] and len(toks) == 4
    assert all("prompt_token_ids" not in c and len(c["choices"][0]["token_ids"]) == 1 for c in toks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    whole = chat(sim, messages=msgs, max_tokens=4, return_token_ids=True)
    assert [t for c in toks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in toks) == whole["choices"][0]["message"]["content"]


def test_chat_prompt_ids_and_continue_final_message(sim):
    msgs = [{"role": "user", "content": "write a poem"}]
    r = chat(sim, messages=msgs, max_tokens=12, return_token_ids=True)
    prompt, gen = r["prompt_token_ids"], r["choices"][0]["token_ids"]  # chat: prompt ids at the top level
    assert "prompt_token_ids" not in r["choices"][0]
    assert prompt == simtokens.encode("<|user|> write a poem <|end|> <|assistant|>")
    assert prompt[0] == simtokens.SPECIAL["<|user|>"] and prompt[-1] == simtokens.SPECIAL["<|assistant|>"]
    assert present(r["usage"]) == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12}
    text = r["choices"][0]["message"]["content"]
    assert text == simtokens.decode(gen) and r["choices"][0]["message"]["role"] == "assistant"
    # continue the assistant's message after 5 tokens: the prompt is the first one's plus those tokens
    part = simtokens.decode(gen[:5])
    more = chat(sim, messages=[*msgs, {"role": "assistant", "content": part}], max_tokens=7, return_token_ids=True,
                continue_final_message=True, add_generation_prompt=False)
    assert more["prompt_token_ids"] == prompt + gen[:5]
    assert more["choices"][0]["token_ids"] == gen[5:] and part + more["choices"][0]["message"]["content"] == text
    # the same through /v1/completions with the token ids
    same = complete(sim, prompt=prompt + gen[:5], max_tokens=7, return_token_ids=True)
    assert same["choices"][0]["token_ids"] == gen[5:]
    # without continue_final_message the assistant turn is closed and a new one opened
    closed = chat(sim, messages=[*msgs, {"role": "assistant", "content": part}], max_tokens=3, return_token_ids=True)
    assert closed["prompt_token_ids"][-2:] == [simtokens.SPECIAL["<|end|>"], simtokens.SPECIAL["<|assistant|>"]]
    with pytest.raises(urllib.error.HTTPError) as e:
        chat(sim, messages=msgs, continue_final_message=True, add_generation_prompt=True)
    assert e.value.code == 400


def test_eos_ends_with_stop_unless_ignored(sim):
    # find a prompt whose greedy generation samples EOS early (about one step in 500)
    prompt = next(p for p in (f"eos probe {i}" for i in range(5000))
                  if simtokens.EOS in list(simtokens.generate(simtokens.encode(p), 30, {})))
    r = complete(sim, prompt=prompt, max_tokens=30, return_token_ids=True)
    ids = r["choices"][0]["token_ids"]
    assert ids[-1] == simtokens.EOS and simtokens.EOS not in ids[:-1] and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == len(ids) < 30 and r["choices"][0]["text"] == simtokens.decode(ids)
    chunks = complete(sim, prompt=prompt, max_tokens=30, stream=True, return_token_ids=True)
    assert chunks[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop",
                                        "stop_reason": None, "prompt_token_ids": None, "token_ids": [simtokens.EOS]}
    assert len(chunks) == len(ids)
    r = complete(sim, prompt=prompt, max_tokens=30, return_token_ids=True, ignore_eos=True)
    assert len(r["choices"][0]["token_ids"]) == 30 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["token_ids"][:len(ids) - 1] == ids[:-1]


def test_sampling_with_a_seed_repeats_and_without_varies(sim):
    body = {"prompt": "roll the dice", "max_tokens": 16, "return_token_ids": True, "temperature": 0.8}
    greedy = complete(sim, **{**body, "temperature": 0})["choices"][0]["token_ids"]
    s1 = complete(sim, **body, seed=7)["choices"][0]["token_ids"]
    assert complete(sim, **body, seed=7)["choices"][0]["token_ids"] == s1
    assert complete(sim, **body, seed=8)["choices"][0]["token_ids"] != s1 and s1 != greedy
    free = [tuple(complete(sim, **body)["choices"][0]["token_ids"]) for _ in range(3)]
    assert len(set(free)) == 3


M = 4096


@pytest.mark.parametrize("chat, body, want", [
    (False, {}, 16),                                   # a completion's default
    (False, {"max_tokens": None}, 16),                 # null too (vLLM 0.32's normalize_null_max_tokens)
    (False, {"max_tokens": 5000 - 4096 + 100}, 1004),
    (False, {"max_tokens": 4090}, M - 10),             # up to max_model_len: clamped to the context left
    (True, {}, M - 10),                                # a chat's default: the context left
    (True, {"max_tokens": 9, "max_completion_tokens": 20}, 20),   # max_completion_tokens first
    (True, {"max_tokens": 9, "max_completion_tokens": None}, 9),
    (True, {"max_tokens": 9.0}, 9),
])
def test_max_tokens_as_vllm_reads_them(chat, body, want):
    assert max_tokens_of(body, chat, 10, M) == want


@pytest.mark.parametrize("chat, body, msg", [
    (False, {"max_tokens": M + 1}, "max_tokens=4097 cannot be greater than max_model_len=4096"),
    (True, {"max_completion_tokens": 1 << 30}, "max_completion_tokens=1073741824 cannot be greater than"),
    (False, {"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
    (True, {"max_tokens": "x"}, "max_tokens: Input should be a valid integer"),
])
def test_max_tokens_vllm_refuses(chat, body, msg):
    with pytest.raises(RequestError, match=re.escape(msg)):
        max_tokens_of(body, chat, 10, M)


def test_a_max_tokens_above_the_context_is_a_400_over_http(sim):
    with pytest.raises(urllib.error.HTTPError) as e:
        complete(sim, prompt="x", max_tokens=1 << 30)
    assert e.value.code == 400 and "cannot be greater than max_model_len" in json.loads(e.value.read())["error"]["message"]


def test_stop_token_ids_wait_for_min_tokens_and_the_eos_is_no_stop_token():
    """vLLM's sampler never picks a stop token id within ``min_tokens`` (the simulator's tokens are fixed: it goes
    on over one), and it checks its EOS before the stop ids, so an EOS among them ends with stop_reason null."""
    from orchestrator.devtools.simstop import Stops
    s = Stops({"stop_token_ids": [7], "min_tokens": 2})
    assert [s.step(7, "x"), s.step(7, "y"), s.step(7, "z")] == [False, False, True]
    assert (s.reason, s.delta(True)) == (7, "xy")
    s = Stops({"stop_token_ids": [0, 7]}, eos=0)
    assert not s.step(0, "") and s.reason is None
    s = Stops({"stop": ["bcd", "ab"], "include_stop_str_in_output": True})   # the earliest completed string
    assert [s.step(0, "xa"), s.step(1, "bcd")] == [False, True] and (s.reason, s.text) == ("ab", "xab")
