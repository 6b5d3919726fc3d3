"""A model's own gateway limits (``models[].gateway``): timeouts and its queue over the gateway's, for its requests
only; a reload applies them without touching the model's jobs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway_harness import Harness, Sim
from orchestrator import jobshape
from orchestrator.fleetfile import load_config_text
from orchestrator.yamlsrc import ConfigError

MODELS = """\
  - name: quick
    engine: simulator
    container: {enabled: false}
    resume: {enabled: false}
    gateway: {request_timeout_s: 1, stream_idle_timeout_s: 0.5, max_queue: 0}
    max_inflight_per_replica: 1
  - name: patient
    engine: simulator
    container: {enabled: false}
    resume: {enabled: false}
    max_inflight_per_replica: 1
"""


def client(h: Harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base + "/v1", api_key="none", max_retries=0, timeout=60)


def test_each_model_has_its_own_timeouts_and_queue(tmp_path):
    # two simulators 1.5 s to their first token, one per model, a token every 0.8 s after it
    sims = {m: Sim(f"mg-{m}", "--ttft-s", "1.5", "--tokens-per-s", "1.25", served=m) for m in ("quick", "patient")}
    h = Harness(tmp_path, MODELS, "queue_timeout_s: 30\nstream_idle_timeout_s: 30")
    try:
        h.set_ready([s.backend(model=m) for m, s in sims.items()])
        c = client(h)
        # a whole answer: quick's is due within its 1 s, patient's within the gateway's 600 s
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model="quick", prompt="x", max_tokens=1)
        assert e.value.status_code == 504 and e.value.body["code"] == "upstream_timeout"
        assert c.completions.create(model="patient", prompt="x", max_tokens=1).usage.completion_tokens == 1
        # a stream: patient's goes on through 0.8 s gaps between tokens; quick's, from a replica that sends its
        # first token at once, breaks at its first gap (0.5 s idle), long before its 1 s request timeout could
        assert len(list(c.completions.create(model="patient", prompt="x", max_tokens=2, stream=True))) >= 2
        drip = Sim("mg-drip", "--ttft-s", "0.05", "--tokens-per-s", "1.25", served="quick")
        try:
            h.set_ready([drip.backend(model="quick"), sims["patient"].backend(model="patient")])
            got, t = [], time.monotonic()
            with pytest.raises(Exception):   # (the connection cut mid-stream: the SDK's transport error)
                for chunk in c.completions.create(model="quick", prompt="x", max_tokens=3, stream=True):
                    got.append(chunk)
            assert len(got) == 1 and time.monotonic() - t < 1.5, (got, time.monotonic() - t)
        finally:
            drip.stop()
            h.set_ready([s.backend(model=m) for m, s in sims.items()])
        # the queue: quick's holds nobody (its one slot taken: 429 at once), patient's waits its turn
        with ThreadPoolExecutor(2) as pool:
            for model, queued_ok in (("quick", False), ("patient", True)):
                first = pool.submit(c.completions.create, model=model, prompt="x", max_tokens=1, timeout=5)
                time.sleep(0.5)   # (the first holds the model's one slot for 1.5 s)
                if queued_ok:
                    assert c.completions.create(model=model, prompt="y", max_tokens=1).usage.completion_tokens == 1
                else:
                    with pytest.raises(openai.RateLimitError) as e:
                        c.completions.create(model=model, prompt="y", max_tokens=1)
                    assert e.value.body["code"] == "queue_full"
                if model == "quick":   # (its own answer: past its 1 s, a 504)
                    with pytest.raises(openai.APIStatusError):
                        first.result(10)
                else:
                    first.result(10)
        # a reload gives quick the gateway's timeout back
        h.reload(h.text.replace("gateway: {request_timeout_s: 1, stream_idle_timeout_s: 0.5, max_queue: 0}", ""))
        assert c.completions.create(model="quick", prompt="x", max_tokens=1).usage.completion_tokens == 1
    finally:
        h.close()
        for s in sims.values():
            s.stop()


def test_the_settings_are_checked_at_their_line_and_are_not_the_jobs():
    base = f"fleet: f\nstate_dir: /tmp/x\nmodels:\n{MODELS}"
    cfg = load_config_text(base, "f.yaml", {})
    quick, patient = cfg.models
    assert quick.gateway.request_timeout_s == 1 and patient.gateway.request_timeout_s is None
    with pytest.raises(ConfigError) as e:
        load_config_text(base.replace("request_timeout_s: 1,", "request_timeout_s: 0, first_byte_s: 3,"), "f.yaml", {})
    assert str(e.value) == ("f.yaml:8:34: models[0].gateway.request_timeout_s: Input should be greater than 0\n"
                            "f.yaml:8:37: models[0].gateway.first_byte_s: unknown field (did you mean "
                            "'first_byte_timeout_s'?)")
    # the job does not read them: its hash is the same with or without (a reload rolls no replica)
    plain = load_config_text(base.replace("    gateway: {request_timeout_s: 1, stream_idle_timeout_s: 0.5, max_queue: 0}\n",
                                          ""), "f.yaml", {}).models[0]
    assert jobshape.model_part(quick.model_dump(), kv_events=False) == \
        jobshape.model_part(plain.model_dump(), kv_events=False)
