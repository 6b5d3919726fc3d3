"""A client key with ``expires_at`` stops working then, with no reload: a 401 that says so on every client
endpoint, its batch lines refused, its dedicated batches stopped as a revoked key's."""

from __future__ import annotations

from datetime import UTC, datetime

import openai
import pytest

from gateway_harness import Harness, Sim
from orchestrator.config import GatewayConfig
from orchestrator.fleetfile import load_config_text
from orchestrator.gateway.tenants import Tenants
from orchestrator.keys import BATCH_OWNER, KeyPolicy
from orchestrator.yamlsrc import ConfigError

END = "2027-01-31T23:59:59Z"
END_S = datetime(2027, 1, 31, 23, 59, 59, tzinfo=UTC).timestamp()
MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
"""
KEYS = f"""\
api_keys:
  - {{name: course, key: sk-course, expires_at: "{END}"}}
  - {{name: staff, key: sk-staff}}
"""


def test_expires_at_needs_a_time_zone_and_is_refused_at_its_line():
    keys = "".join("  " + ln for ln in KEYS.splitlines(True))
    text = f"fleet: f\nstate_dir: /tmp/x\ngateway:\n{keys}models:\n{MODELS}"
    cfg = load_config_text(text, "f.yaml", {})
    assert cfg.gateway.keys()[0].expires_at.timestamp() == END_S
    assert cfg.gateway.keys()[1].expires_at is None
    with pytest.raises(ConfigError) as e:
        load_config_text(text.replace(END, "2027-01-31T23:59:59"), "f.yaml", {})
    assert str(e.value).startswith("f.yaml:5:50: gateway.api_keys[0].expires_at: Input should have timezone")


def test_a_key_stops_at_its_expiry_everywhere_and_the_others_go_on(tmp_path):
    h = Harness(tmp_path, MODELS, KEYS)
    sim = Sim("exp")
    now = [END_S - 60]
    try:
        h.route_to([sim])
        h.gateway.tenants.wall = lambda: now[0]
        h.tenancy.wall = lambda: now[0]

        def c(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0, timeout=30)
        assert c("sk-course").completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in c("sk-course").models.list()] == ["m"]
        assert h.tenancy.owner_refusal("course", "m") is None
        now[0] = END_S   # the second it names: no longer
        for call in (lambda k: k.completions.create(model="m", prompt="x", max_tokens=2),
                     lambda k: k.models.list(), lambda k: k.files.list(), lambda k: k.batches.list()):
            with pytest.raises(openai.AuthenticationError) as e:
                call(c("sk-course"))
            assert e.value.body["message"] == f"The API key `course` expired at {END}.", e.value.body
            assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError) as e:   # an unknown key is told nothing of the others
            c("sk-nobody").completions.create(model="m", prompt="x", max_tokens=2)
        assert e.value.body["message"] == "Invalid or missing API key."
        assert c("sk-staff").completions.create(model="m", prompt="x", max_tokens=2).usage.completion_tokens == 2
        # its dedicated batches stop (the fleet's check), as a revoked key's
        assert h.tenancy.owner_refusal("course", "m") == f"the key `course` expired at {END}"
        assert h.tenancy.owner_refusal("staff", "m") is None
    finally:
        h.close()
        sim.stop()


def test_the_batch_runners_lines_for_an_expired_key_are_refused():
    keys = [KeyPolicy(name="course", key="sk-course", expires_at=END), KeyPolicy(name="staff", key="sk-staff")]
    cfg = GatewayConfig(api_keys=keys)
    cfg._batch_key = "runner-secret"
    now = [END_S - 1]
    ts = Tenants(cfg, 0, "inc", {}, wall=lambda: now[0])
    runner = ts.identify({"Authorization": "Bearer runner-secret"})
    owner, refused = ts.batch_owner(runner, {BATCH_OWNER: "course"}, "m")
    assert owner is ts.by_name["course"] and refused is None
    now[0] = END_S + 1
    owner, refused = ts.batch_owner(runner, {BATCH_OWNER: "course"}, "m")
    assert owner is None and refused.status == 401 and f"expired at {END}".encode() in refused.body
    assert ts.batch_owner(runner, {BATCH_OWNER: "staff"}, "m")[1] is None
    assert ts.identify({"Authorization": "Bearer sk-course"}) is None
    assert ts.identify({"x-api-key": "sk-staff"}) is ts.by_name["staff"]
