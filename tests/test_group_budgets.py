"""A group's shared token budget (``gateway.groups``): every key of the group draws on it, beside its own
limits; once the group's keys have used it, each of them gets 429 insufficient_quota until the period ends."""

from __future__ import annotations

import time

import openai
import pytest

from conftest import metric_sum
from gateway_harness import Harness, Sim
from orchestrator.fleet.reports import ReportHub
from orchestrator.fleet.tenancy import Tenancy
from orchestrator.fleet.usage import UsageLedger
from orchestrator.fleet.usagequery import key_usage
from orchestrator.fleetfile import load_config_text
from orchestrator.keys import key_advisories
from orchestrator.observability.metrics import Metrics
from orchestrator.yamlsrc import ConfigError

MODELS = """\
  - name: m
    engine: simulator
    container: {enabled: false}
"""
KEYS = """\
api_keys:
  - {name: ann, key: sk-ann, group: lab}
  - {name: ben, key: sk-ben, group: lab, budget_tokens: 1000}
  - {name: cy, key: sk-cy, group: other}
groups:
  lab: {budget_tokens: 40, budget_period: day}
"""


def test_the_groups_keys_share_its_budget_until_the_period_ends(tmp_path):
    h = Harness(tmp_path, MODELS, KEYS)
    sim = Sim("grp")
    try:
        h.route_to([sim])
        now = [time.time()]
        h.tenancy.wall = h.tenancy.ledger.clock = lambda: now[0]   # the fleet's calendar, moved by the test
        day_end = (now[0] // 86400 + 1) * 86400

        def c(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=h.base + "/v1", api_key=key, max_retries=0, timeout=30)

        def ask(fn, *a):   # on the loop's thread (the ledger's sqlite lives there)
            async def run():
                return fn(*a)
            return h.call(run())
        assert ask(h.tenancy.budget_left, "ben") == (40, day_end) and ask(h.tenancy.budget_left, "cy") is None
        c("sk-ann").completions.create(model="m", prompt="a b c d e", max_tokens=38)   # 43 tokens: past 40
        h.tenancy_tick()
        assert set(h.publisher.table.groups_spent) == {"lab"} and not h.publisher.table.budgets_spent
        for key, name in (("sk-ann", "ann"), ("sk-ben", "ben")):   # ben too: his own 1000 are untouched
            with pytest.raises(openai.RateLimitError) as e:
                c(key).completions.create(model="m", prompt="x", max_tokens=1)
            assert e.value.body["message"] == (f"Group `lab` of key `{name}` has used its token budget for this day "
                                               "(40 tokens).")
            assert e.value.body["type"] == "insufficient_quota"
            assert abs(int(e.value.response.headers["Retry-After"]) - (day_end - now[0])) < 5
        assert c("sk-cy").completions.create(model="m", prompt="x", max_tokens=1).usage.completion_tokens == 1
        # a dedicated batch goes by the smaller of the key's own budget and its group's
        assert ask(h.tenancy.budget_left, "ben") == (40 - 43, day_end)
        assert ask(h.tenancy.budget_left, "ann") == (40 - 43, day_end)
        # the batch runner's lines for a key of the group are refused as the key's own would be
        h.cfg.gateway._batch_key = "runner-secret"
        h.gateway.set_config(h.cfg)
        with pytest.raises(openai.RateLimitError) as e:
            c("runner-secret").completions.create(model="m", prompt="x", max_tokens=1,
                                                  extra_headers={"x-slurmfleet-batch-owner": "ann"})
        assert "Group `lab` of key `ann`" in e.value.body["message"]
        text = ask(lambda: Metrics(key_usage=lambda: key_usage(h.tenancy.ledger, [], h.tenancy.groups,
                                                               h.tenancy.budgets)).render().decode())
        assert metric_sum(text, "slurmfleet_group_budget_tokens", group="lab") == 40
        assert metric_sum(text, "slurmfleet_group_budget_used_tokens", group="lab") == 43
        assert metric_sum(text, "slurmfleet_group_budget_reset_timestamp_seconds", group="lab") == day_end
        assert metric_sum(text, "slurmfleet_key_budget_used_tokens", key="ben") == 0   # (his own budget's)
        assert 'group="other"' not in text   # (no budget: no series)
        now[0] = day_end + 1   # the next day: the group's budget is whole again
        h.tenancy_tick()
        assert not h.publisher.table.groups_spent
        assert c("sk-ann").completions.create(model="m", prompt="x", max_tokens=1).usage.completion_tokens == 1
        # spent again by ann, whom a reload then revokes: her tokens still count toward the group's budget
        c("sk-ann").completions.create(model="m", prompt="a b c d e", max_tokens=38)
        h.reload(h.text.replace("    - {name: ann, key: sk-ann, group: lab}\n", ""))
        h.tenancy_tick()
        with pytest.raises(openai.RateLimitError):
            c("sk-ben").completions.create(model="m", prompt="x", max_tokens=1)
        # ... and after a restart too (the ledger's rows say which keys booked under the group this period)
        h.tenancy_tick(flush=True)
        restarted = Tenancy(load_config_text(h.text.replace("    - {name: ann, key: sk-ann, group: lab}\n", ""),
                                             "gw.yaml", {}), ReportHub(),
                            UsageLedger(tmp_path / "usage.sqlite3", lambda: now[0]), lambda *a: 0, wall=lambda: now[0])
        assert restarted.budget_left("ben")[0] <= 0 and "ann" not in restarted.groups
        # then a reload takes the group's budget away (ann back): its keys go on at once
        h.reload(h.text.replace("  groups:\n    lab: {budget_tokens: 40, budget_period: day}\n", ""))
        assert c("sk-ann").completions.create(model="m", prompt="x", max_tokens=1).usage.completion_tokens == 1
    finally:
        h.close()
        sim.stop()


def test_a_groups_settings_are_checked_at_their_line_and_an_unused_one_is_warned_of():
    keys = "".join("  " + ln for ln in KEYS.splitlines(True))
    text = f"fleet: f\nstate_dir: /tmp/x\ngateway:\n{keys}models:\n{MODELS}"
    cfg = load_config_text(text, "f.yaml", {})
    assert cfg.gateway.groups["lab"].budget_tokens == 40
    assert key_advisories(cfg.gateway, time.time()) == []
    with pytest.raises(ConfigError) as e:
        load_config_text(text.replace("{budget_tokens: 40, budget_period: day}", "{budget_tokens: 0, period: day}"),
                         "f.yaml", {})
    assert str(e.value) == ("f.yaml:9:26: gateway.groups.lab.budget_tokens: Input should be greater than or equal to 1\n"
                            "f.yaml:9:29: gateway.groups.lab.period: unknown field")
    cfg = load_config_text(text.replace("    lab: {", "    labs: {"), "f.yaml", {})   # a misspelt group
    assert key_advisories(cfg.gateway, time.time()) == [
        "gateway.groups.labs: no key has group 'labs': its budget limits nothing"]
