"""The gateway's per-request token histograms: prompt and completion tokens as the replica counted them, and the
time per output token of a streamed answer (decode speed, the serving SLO besides the time to first token)."""

from __future__ import annotations

import openai
import pytest

from conftest import wait_for
from gateway_harness import Harness, Sim
from orchestrator.reqstats import RequestStats

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
    resume: {enabled: false}
"""


def test_a_requests_end_records_its_tokens_and_time_per_output_token():
    st = RequestStats()
    st.ended("m", 200, "0", 1.5, 0.5, (30, 11))   # 10 tokens after the first in 1 s
    st.ended("m", 200, "0", 2.0, None, (7, 5))    # not streamed: no first token time
    st.ended("m", 200, "0", 1.0, 0.2, (7, 4), 2)  # two choices (n 2, or two prompts): their tokens interleave
    st.ended("m", 200, "0", 0.3, 0.2, (7, 1))     # one token: no gap between tokens
    st.ended("m", 502, "0", 0.3, 0.1, (7, 3))     # cut mid-way: not an answer's
    st.ended("m", 429, "none", 0.0, None, None)   # the gateway's own refusal
    st.ended("m", 200, "0", 0.1, None, (12, 0))   # an embedding: prompt tokens only
    st.ended("m", 200, "0", 1.0, 0.2, (7, 4), None)   # choices unsure (n not a number): no time per token
    assert st.requests == {("m", "200", "0"): 6, ("m", "502", "0"): 1, ("m", "429", "none"): 1}
    assert sum(st.duration["m"].counts) == 8
    tpot = st.tpot["m"]
    assert sum(tpot.counts) == 1 and tpot.sum == pytest.approx(0.1)
    assert tpot.counts[tpot.bounds.index(0.1)] == 1   # le 0.1 holds it (and 0.075 does not)
    assert sum(st.prompt_tokens["m"].counts) == 6 and st.prompt_tokens["m"].sum == 30 + 7 + 7 + 7 + 12 + 7
    assert sum(st.output_tokens["m"].counts) == 5 and st.output_tokens["m"].sum == 11 + 5 + 4 + 1 + 4
    # the snapshot a gateway process reports adds up in the daemon, buckets and all
    total = RequestStats()
    total.add(st.snapshot())
    total.add(st.snapshot())
    assert total.tpot["m"].counts == [2 * n for n in tpot.counts] and total.tpot["m"].bounds == tpot.bounds


def test_the_histograms_come_from_the_replicas_usage_through_the_gateway(tmp_path):
    sim = Sim("tok", "--ttft-s", "0.05", "--tokens-per-s", "50")   # a token every 20 ms
    h = Harness(tmp_path, MODELS)
    try:
        h.route_to([sim])
        c = openai.OpenAI(base_url=h.base + "/v1", api_key="none", max_retries=0, timeout=30)
        usage = None
        for chunk in c.chat.completions.create(model="m", messages=[{"role": "user", "content": "count to ten"}],
                                               max_tokens=16, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
        whole = c.completions.create(model="m", prompt="one two three", max_tokens=5)
        # a stream whose client asked no usage: the gateway asks for it and meters it all the same
        for _ in c.completions.create(model="m", prompt="four five", max_tokens=6, stream=True):
            pass
        assert usage.completion_tokens == 16 and whole.usage.completion_tokens == 5
        prompt = usage.prompt_tokens + whole.usage.prompt_tokens
        # (a request is counted as its handler ends, a moment after its client read the end of its answer)
        wait_for(lambda: h.metric("slurmfleet_requests_total", model="m") == 3, 10, "the three requests counted")
        assert h.metric("slurmfleet_request_output_tokens_count", model="m") == 3
        assert h.metric("slurmfleet_request_output_tokens_sum", model="m") == 16 + 5 + 6
        assert h.metric("slurmfleet_request_prompt_tokens_count", model="m") == 3
        assert h.metric("slurmfleet_request_prompt_tokens_sum", model="m") > prompt
        # the two streams: 15 and 5 gaps of about 20 ms (a loaded machine only adds: at most 0.1 s a token)
        assert h.metric("slurmfleet_time_per_output_token_seconds_count", model="m") == 2
        mean = h.metric("slurmfleet_time_per_output_token_seconds_sum", model="m") / 2
        assert 0.015 <= mean <= 0.1, mean
        assert h.metric("slurmfleet_time_per_output_token_seconds_bucket", model="m", le="0.01") == 0
        assert h.metric("slurmfleet_time_per_output_token_seconds_bucket", model="m", le="+Inf") == 2
        assert h.metric("slurmfleet_request_output_tokens_bucket", model="m", le="4.0") == 0
        assert h.metric("slurmfleet_request_output_tokens_bucket", model="m", le="16.0") == 3
    finally:
        h.close()
        sim.stop()
