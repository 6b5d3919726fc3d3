"""A model's ``gateway.fallbacks``: a request its model cannot take (no replica within its wait, its queue full)
goes to the first fallback with a READY replica that the key may use, then to the next when that one cannot take
it either; the client sees which."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import wait_for
from gateway_harness import Harness, Sim
from orchestrator.fleetfile import load_config_text
from orchestrator.yamlsrc import ConfigError

MODELS = """\
  - name: big
    engine: simulator
    container: {enabled: false}
    max_inflight_per_replica: 1
    gateway: {queue_timeout_s: 0.5, fallbacks: [tiny, small-alias]}
    lora_adapters: {big-sql: /adapters/sql}
  - name: tiny
    engine: simulator
    container: {enabled: false}
  - name: small
    engine: simulator
    container: {enabled: false}
    aliases: [small-alias]
"""
KEYS = """\
api_keys:
  - {name: alice, key: sk-alice}
  - {name: bob, key: sk-bob, models: [big]}
"""


def client(h: Harness, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0, timeout=30)


def test_a_request_its_model_cannot_take_goes_to_a_fallback(tmp_path):
    sims = {m: Sim(f"fb-{m}", "--ttft-s", "0.05", served=m) for m in ("big", "small")}
    h = Harness(tmp_path, MODELS, KEYS + "queue_timeout_s: 30")
    try:
        # big has no READY replica, nor tiny (its first fallback): small (named by its alias) takes it
        # each (model, fallback) series is there from 0, under the served names
        zero = [f'slurmfleet_request_fallbacks_total{{model="big",to="{to}"}} 0.0' for to in ("tiny", "small")]
        wait_for(lambda: all(z in h.metrics.render().decode() for z in zero), 10, "the fallbacks' series at 0")
        h.set_ready([sims["small"].backend(model="small")])
        alice = client(h, "sk-alice")
        t = time.monotonic()
        r = alice.completions.with_raw_response.create(model="big", prompt="x", max_tokens=3)
        waited = time.monotonic() - t
        answer = r.parse()
        assert answer.model == "small" and answer.usage.completion_tokens == 3
        assert r.headers["x-slurmfleet-fallback-from"] == "big"
        assert 0.5 <= waited < 10   # big's own wait (its queue_timeout_s, 0.5 s), not the gateway's 30 s
        # a stream too, charged to the key under the model that answered
        chunks = list(alice.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, stream=True))
        assert {c.model for c in chunks} == {"small"}
        # (a stream is counted as its handler ends, a moment after its client read its end)
        wait_for(lambda: h.gateway.tenants.by_name["alice"].usage["small"][2] == 3 + 4, 10, "the stream charged")
        assert "big" not in h.gateway.tenants.by_name["alice"].usage
        # a key that may not use the fallback gets big's own 503
        with pytest.raises(openai.InternalServerError) as e:
            client(h, "sk-bob").completions.create(model="big", prompt="x", max_tokens=3)
        assert e.value.status_code == 503 and e.value.body["code"] == "no_replica"
        # a request for big's LoRA adapter: its answer is the adapter's, or none
        with pytest.raises(openai.InternalServerError) as e:
            alice.completions.create(model="big-sql", prompt="x", max_tokens=3)
        assert e.value.status_code == 503 and "x-slurmfleet-fallback-from" not in e.value.response.headers
        assert h.metric("slurmfleet_request_fallbacks_total", model="big", to="small") == 2
        assert h.metric("slurmfleet_requests_total", model="small", code="200") == 2
        assert h.metric("slurmfleet_requests_total", model="big", code="503") == 2

        # big READY with its one slot taken and no queue (max_queue 0): the fallback takes the next request at once
        slow = Sim("fb-big-slow", "--ttft-s", "2", served="big")
        try:
            h.reload(h.text.replace("{queue_timeout_s: 0.5, fallbacks:", "{queue_timeout_s: 0.5, max_queue: 0, fallbacks:"))
            h.set_ready([slow.backend(model="big"), sims["small"].backend(model="small")])
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(alice.completions.create, model="big", prompt="x", max_tokens=1)
                time.sleep(0.5)   # (it holds big's one slot for 2 s)
                t = time.monotonic()
                second = alice.completions.create(model="big", prompt="y", max_tokens=1)
                assert second.model == "small" and time.monotonic() - t < 1.5
                assert first.result(30).model == "big"
        finally:
            slow.stop()
        h.reload(h.text)   # (big's queue back)

        # the batch runner's lines are the model they name, or its refusal: never another model's answer
        h.cfg.gateway._batch_key = "runner-secret"
        h.gateway.set_config(h.cfg)
        h.set_ready([sims["small"].backend(model="small")])
        with pytest.raises(openai.InternalServerError):
            client(h, "runner-secret").completions.create(model="big", prompt="x", max_tokens=1,
                                                          extra_headers={"x-slurmfleet-batch-owner": "alice"})
        # no fallback with a READY replica: big's own 503
        h.set_ready([])
        with pytest.raises(openai.InternalServerError) as e:
            alice.completions.create(model="big", prompt="x", max_tokens=1)
        assert "x-slurmfleet-fallback-from" not in e.value.response.headers
        assert h.metric("slurmfleet_request_fallbacks_total") == 3
    finally:
        h.close()
        for s in sims.values():
            s.stop()


CHAIN = """\
  - name: big
    engine: simulator
    container: {enabled: false}
    gateway: {queue_timeout_s: 0.3, fallbacks: [mid, small]}
  - name: mid
    engine: simulator
    container: {enabled: false}
    max_inflight_per_replica: 1
    gateway: {max_queue: 0, fallbacks: [big]}
  - name: small
    engine: simulator
    container: {enabled: false}
"""


def test_a_fallback_that_cannot_take_it_either_passes_it_to_the_next(tmp_path):
    mid, small = Sim("fbc-mid", "--ttft-s", "2", served="mid"), Sim("fbc-small", "--ttft-s", "0.05", served="small")
    h = Harness(tmp_path, CHAIN, KEYS + "queue_timeout_s: 30")
    try:
        h.set_ready([mid.backend(model="mid"), small.backend(model="small")])
        alice = client(h, "sk-alice")
        # mid idle: it takes big's request, though it has no queue (max_queue 0) to wait in
        assert alice.completions.create(model="big", prompt="x", max_tokens=1).model == "mid"
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(alice.completions.create, model="mid", prompt="x", max_tokens=1)
            wait_for(lambda: h.gateway.pools.inflight_by_model().get("mid") == 1, 10, "mid's one slot taken")
            # big has no replica (0.3 s), mid's one slot is taken with no queue: small, the next, answers
            r = alice.completions.with_raw_response.create(model="big", prompt="x", max_tokens=2)
            assert r.parse().model == "small" and r.headers["x-slurmfleet-fallback-from"] == "big"
            assert busy.result(30).model == "mid"
        # each request once, under the model that took it (not mid, which could not take the second)
        assert h.metric("slurmfleet_request_fallbacks_total", model="big", to="mid") == 1
        assert h.metric("slurmfleet_request_fallbacks_total", model="big", to="small") == 1
        # with no fallback READY, big's own 503
        h.set_ready([])
        with pytest.raises(openai.InternalServerError) as e:
            alice.completions.create(model="big", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and "`big`" in e.value.message
    finally:
        h.close()
        mid.stop()
        small.stop()


def test_fallbacks_name_other_models_and_are_checked_at_their_line():
    base = f"fleet: f\nstate_dir: /tmp/x\nmodels:\n{MODELS}"
    assert load_config_text(base, "f.yaml", {}).models[0].gateway.fallbacks == ["tiny", "small-alias"]
    bad = base.replace("fallbacks: [tiny, small-alias]", "fallbacks: [nope, big, small, small-alias, sql]").replace(
        "    aliases: [small-alias]\n", "    aliases: [small-alias]\n    lora_adapters: {sql: /adapters/sql}\n")
    with pytest.raises(ConfigError) as e:
        load_config_text(bad, "f.yaml", {})
    assert str(e.value).splitlines() == [
        "f.yaml:8:49: models[0].gateway.fallbacks[0]: unknown model 'nope'; served names and aliases: big, small, "
        "small-alias, tiny",
        "f.yaml:8:55: models[0].gateway.fallbacks[1]: 'big' is this model itself",
        "f.yaml:8:67: models[0].gateway.fallbacks[3]: 'small-alias' names model 'small' again",
        "f.yaml:8:80: models[0].gateway.fallbacks[4]: 'sql' is a LoRA adapter of model 'small': name a model"]
    # a fallback serves the same kind of request: an embedding model is no chat model's
    pooled = base.replace("  - name: tiny\n    engine: simulator\n",
                          "  - name: tiny\n    engine: simulator\n    vllm_args: {runner: pooling}\n")
    with pytest.raises(ConfigError) as e:
        load_config_text(pooled, "f.yaml", {})
    assert str(e.value) == ("f.yaml:8:49: models[0].gateway.fallbacks[0]: 'tiny' serves pooling requests "
                            "(embeddings, scores) and this model does not (vllm_args runner, convert or task): a "
                            "fallback must take the same requests (a pooling model vLLM detects by itself: say "
                            "`runner: pooling` in its vllm_args)")
