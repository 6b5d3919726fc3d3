"""Named API keys, priority classes and scheduling policy in the fleet config: what valid configs resolve to,
every bad one refused at its file, line and field (the keys file's own, for a bad keys file), and the UTC
calendar periods of token budgets."""

from __future__ import annotations

import calendar
import hashlib
import pickle
import textwrap

import pytest

from orchestrator.config import GatewayConfig
from orchestrator.fleetfile import load_config, load_config_text
from orchestrator.keys import KeyPolicy, period_end, period_start
from orchestrator.keysfile import read_keys_file
from orchestrator.yamlsrc import ConfigError

BASE = """\
fleet: prod
state_dir: /shared/slurmfleet
models:
  - name: tiny
    aliases: [t]
    engine: simulator
    container: {enabled: false}
  - name: llama-8b
    engine: simulator
    container: {enabled: false}
gateway:
"""
HEX = hashlib.sha256(b"sk-hashed").hexdigest()


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def problems(text: str, file: str = "fleet.yaml") -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config_text(textwrap.dedent(text), file, {})
    return [str(p) for p in info.value.problems]


def test_inline_keys_resolve_names_priorities_and_policies():
    cfg = load_config_text(BASE + f"""\
  priority_classes: [gold, silver, bronze]
  default_priority: silver
  api_keys:
    - sk-plain
    - 'sha256:{HEX.upper()}'
    - name: team-a
      key: sk-team-a
      group: nlp
      models: [t, llama-8b]
      rpm: 600
      tpm: 200000
      max_concurrent: 16
      budget_tokens: 10000000
      budget_period: week
      priority: gold
""", "fleet.yaml", {})
    keys = cfg.gateway.keys()
    # unnamed keys: "key-" and the first 8 hex digits of the secret's SHA-256 (given hex is lowercased)
    assert [k.name for k in keys] == [f"key-{sha('sk-plain')[:8]}", f"key-{HEX[:8]}", "team-a"]
    assert [k.digest for k in keys] == [sha("sk-plain"), HEX, sha("sk-team-a")]
    assert [k.priority for k in keys] == ["silver", "silver", "gold"]
    a = keys[2]
    assert (a.group, a.models, a.rpm, a.tpm, a.max_concurrent, a.budget_tokens, a.budget_period) == \
        ("nlp", ["t", "llama-8b"], 600, 200000, 16, 10_000_000, "week")
    assert keys[0].models is None and keys[0].rpm is None and keys[0].budget_period == "day"
    # the same config gives the same names (they are what usage is counted under)
    assert [k.name for k in load_config_text(BASE + "  api_keys: [sk-plain]\n", "f.yaml", {}).gateway.keys()] \
        == [f"key-{sha('sk-plain')[:8]}"]


def test_defaults_without_keys():
    gw = load_config_text(BASE + "  {}\n", "fleet.yaml", {}).gateway
    assert gw.priority_classes == ["high", "normal", "low"] and gw.default_priority == "normal"
    assert gw.keys() == [] and gw.api_keys_file is None and gw.open


@pytest.mark.parametrize("keys", ["{api_keys: []}", "{api_keys_file: \"${KEYS:-}\"}"])
def test_a_key_source_set_but_empty_opens_nothing(keys):
    """Open (no key asked) is only neither source set: an empty list, or a keys file path left empty by an unset
    variable, lets no client in (the path one opened the gateway to every client)."""
    gw = load_config_text(BASE + f"  {keys}\n", "fleet.yaml", {}).gateway
    assert gw.keys() == [] and not gw.open


YAML_KEYS = f"""\
# the team keys
- sk-file-plain
- name: team-b
  key: sha256:{HEX}
  models: [tiny]
  priority: low
"""


def test_yaml_keys_file_relative_to_the_config_travels_pickled(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "keys.yaml").write_text(YAML_KEYS)
    (conf / "fleet.yaml").write_text(BASE + "  api_keys: [sk-inline]\n  api_keys_file: keys.yaml\n")
    cfg = load_config(conf / "fleet.yaml", {})   # the working directory is not conf/
    expected = [(f"key-{sha('sk-inline')[:8]}", "normal", None), (f"key-{sha('sk-file-plain')[:8]}", "normal", None),
                ("team-b", "low", ["tiny"])]
    assert [(k.name, k.priority, k.models) for k in cfg.gateway.keys()] == expected
    (conf / "keys.yaml").unlink()   # read once, by the config: the gateway workers get the keys in the pickle
    again = pickle.loads(pickle.dumps(cfg))
    assert [(k.name, k.priority, k.models) for k in again.gateway.keys()] == expected and again == cfg


def test_plain_keys_file_old_format_and_absolute_path(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# comment\nsk-one\n\n   sk-two  \n  # indented comment\nsha256:{HEX}\n")
    cfg = load_config_text(BASE + f"  api_keys_file: {keys}\n", "elsewhere/fleet.yaml", {})
    assert [k.digest for k in cfg.gateway.keys()] == [sha("sk-one"), sha("sk-two"), HEX]
    assert read_keys_file(keys) == ["sk-one", "sk-two", f"sha256:{HEX}"]


def test_keys_read_without_parse_config(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(YAML_KEYS)
    gw = GatewayConfig(api_keys=[KeyPolicy(name="x", key="sk-x", priority="high")], api_keys_file=str(keys))
    assert [(k.name, k.priority) for k in gw.keys()] == [
        ("x", "high"), (f"key-{sha('sk-file-plain')[:8]}", "normal"), ("team-b", "low")]


BAD = [
    ("bad key name", "  api_keys: [{name: 'a b', key: k}]\n",
     "fleet.yaml:12:21: gateway.api_keys[0].name: 'a b' is not allowed: letters, digits and _ . - (at most 64)"),
    ("empty key", "  api_keys: [{name: a, key: ''}]\n", "fleet.yaml:12:29: gateway.api_keys[0].key: a key may not be empty"),
    ("short sha256 string", "  api_keys: [ok, 'sha256:abc']\n",
     "fleet.yaml:12:18: gateway.api_keys[1]: sha256: must be followed by the 64 hex digits of the key's SHA-256"),
    ("sha256 not hex", f"  api_keys: [{{name: a, key: 'sha256:{'g' * 64}'}}]\n",
     "fleet.yaml:12:29: gateway.api_keys[0].key: sha256: must be followed by"),
    ("zero rpm", "  api_keys: [{name: a, key: k, rpm: 0}]\n",
     "fleet.yaml:12:37: gateway.api_keys[0].rpm: Input should be greater than or equal to 1"),
    ("negative budget", "  api_keys: [{name: a, key: k, budget_tokens: -5}]\n",
     "fleet.yaml:12:47: gateway.api_keys[0].budget_tokens: Input should be greater than or equal to 1"),
    ("unknown period", "  api_keys: [{name: a, key: k, budget_period: year}]\n",
     "fleet.yaml:12:47: gateway.api_keys[0].budget_period: Input should be 'hour', 'day', 'week' or 'month'"),
    ("empty models", "  api_keys: [{name: a, key: k, models: []}]\n",
     "fleet.yaml:12:40: gateway.api_keys[0].models: List should have at least 1 item"),
    ("unknown key field", "  api_keys: [{name: a, key: k, colour: blue}]\n",
     "fleet.yaml:12:32: gateway.api_keys[0].colour: unknown field"),
    ("number as key", "  api_keys: [12345]\n", "fleet.yaml:12:14: gateway.api_keys[0]: must be text, and YAML read this value as a number (12345): put it in quotes"),
    ("duplicate name", "  api_keys:\n    - {name: a, key: k1}\n    - {name: a, key: k2}\n",
     "fleet.yaml:14:14: gateway.api_keys[1].name: name 'a' is already used by fleet.yaml:13 gateway.api_keys[0]"),
    ("reserved name", "  api_keys: [{name: _batches, key: k}]\n",
     "fleet.yaml:12:21: gateway.api_keys[0].name: name '_batches' is reserved (the gateway's own tenants: "
     "anonymous, _batches)"),
    ("same secret plain and hashed", f"  api_keys:\n    - sk-hashed\n    - {{name: b, key: 'sha256:{HEX.upper()}'}}\n",
     "fleet.yaml:14:22: gateway.api_keys[1].key: the same key (secret) as fleet.yaml:13 gateway.api_keys[0]"),
    ("unknown model", "  api_keys:\n    - name: a\n      key: k\n      models: [tiny, t, mistral]\n",
     ("fleet.yaml:15:25: gateway.api_keys[0].models[2]: unknown model 'mistral'; served names and aliases: "
      "llama-8b, t, tiny")),
    ("unknown priority", "  api_keys: [{name: a, key: k, priority: urgent}]\n",
     "fleet.yaml:12:42: gateway.api_keys[0].priority: 'urgent' is not a priority class; one of: high, normal, low"),
    ("priority of the default classes",
     "  priority_classes: [a, b]\n  default_priority: b\n  api_keys: [{name: a, key: k, priority: high}]\n",
     "fleet.yaml:14:42: gateway.api_keys[0].priority: 'high' is not a priority class; one of: a, b"),
    ("default not a class", "  priority_classes: [a, b]\n",
     "fleet.yaml:12:3: gateway.default_priority: 'normal' is not a priority class; one of: a, b"),
    ("duplicate classes", "  priority_classes: [a, b, a]\n  default_priority: a\n",
     "fleet.yaml:12:21: gateway.priority_classes: priority class 'a' is listed twice"),
    ("no classes", "  priority_classes: []\n",
     "fleet.yaml:12:21: gateway.priority_classes: List should have at least 1 item"),
]


@pytest.mark.parametrize("case,gateway,expected", BAD, ids=[c[0] for c in BAD])
def test_bad_key_config_reports_file_line_and_field(case, gateway, expected):
    got = problems(BASE + gateway)
    assert any(p.startswith(expected) for p in got), got


def test_every_key_problem_is_reported_at_once():
    got = problems(BASE + "  api_keys:\n    - {name: a, key: k, models: [x]}\n    - {name: a, key: k, priority: p}\n")
    assert [p.split(": ")[1] for p in got] == ["gateway.api_keys[0].models[0]", "gateway.api_keys[1].key",
                                               "gateway.api_keys[1].priority"]


BAD_FILE = [
    ("yaml item field", "keys.yaml", "- sk-ok\n- name: b\n  key: kb\n  rpm: 0\n",
     "keys.yaml:4:8: [1].rpm: Input should be greater than or equal to 1"),
    ("yaml unknown field", "keys.yaml", "- {name: b, key: kb, tmp: 5}\n", "keys.yaml:1:22: [0].tmp: unknown field"),
    ("yaml unknown model", "keys.yaml", "- {name: b, key: kb, models: [tiny, gpt-5]}\n",
     "keys.yaml:1:37: [0].models[1]: unknown model 'gpt-5'"),
    ("yaml unknown priority", "keys.yml", "- {name: b, key: kb, priority: vip}\n",
     "keys.yml:1:32: [0].priority: 'vip' is not a priority class"),
    ("name clashes with the config's", "keys.yaml", "- {name: inline, key: kb}\n",
     "keys.yaml:1:10: [0].name: name 'inline' is already used by {dir}/fleet.yaml:12 gateway.api_keys[0]"),
    ("secret of the config's", "keys.yaml", "- {name: b, key: sk-inline}\n",
     "keys.yaml:1:18: [0].key: the same key (secret) as {dir}/fleet.yaml:12 gateway.api_keys[0]"),
    ("yaml name, not a list", "keys.yaml", "name: b\nkey: kb\n", "keys.yaml:1:1: <root>: a keys file must be a YAML list"),
    ("yaml name, bad yaml", "keys.yaml", "- [unclosed\n", "keys.yaml:2:1: <root>: YAML syntax error"),
    ("plain file bad hash", "keys.txt", "# team keys\nsk-one\n\n  sha256:00ff\n",
     "keys.txt:4:3: [1]: sha256: must be followed by the 64 hex digits"),
    ("plain file repeated key", "keys", "sk-one\nsk-two\nsk-one\n",
     "keys:3:1: [2]: the same key (secret) as {dir}/keys:1 [0]"),
    ("yaml list in a .txt", "keys.txt", "- {name: b, key: kb, rpm: -1}\n", "keys.txt:1:27: [0].rpm: Input should be"),
    # a YAML list with a typo, in a file not named *.yaml: its lines were taken as plain keys ("- name: alice"
    # opened the gateway, sk-alice got 401), not its syntax error
    ("yaml list with a typo in a plain name", "client-keys", "- name: alice\n  key: sk-alice\n   rpm: 100\n",
     "client-keys:3:7: <root>: YAML syntax error"),
    ("a plain key with a space", "keys.txt", "sk-one\nsk two\n", "keys.txt:2:1: [1]: a key holds no spaces"),
    # a model-wide check's field: it was put at the item's first line, as "[1]"
    ("a boolean rpm", "keys.yaml", "- {name: a, key: ka}\n- name: b\n  key: kb\n  rpm: true\n",
     "keys.yaml:4:8: [1].rpm: rpm must be a number, not true"),
    # YAML reads U+2028 as a line break, editors and grep do not: a commented-out key was a live one
    ("a line break editors do not show", "keys.yaml",
     "- {name: a, key: ka}\n# - {name: b, key: kb}\u2028- {name: c, key: kc}\n",
     "keys.yaml:2:23: <root>: U+2028 LINE SEPARATOR: YAML reads it as a line break"),
    ("a line break editors do not show, plain", "keys.txt", "sk-one\n# old\u2029sk-two\n",
     "keys.txt:2:6: <root>: U+2029 PARAGRAPH SEPARATOR: YAML reads it as a line break"),
]


@pytest.mark.parametrize("case,name,content,expected", BAD_FILE, ids=[c[0] for c in BAD_FILE])
def test_bad_keys_file_reports_the_keys_files_line_and_field(tmp_path, case, name, content, expected):
    (tmp_path / name).write_text(content, encoding="utf-8")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(BASE + f"  api_keys: [{{name: inline, key: sk-inline}}]\n  api_keys_file: {name}\n")
    with pytest.raises(ConfigError) as info:
        load_config(fleet, {})
    got = [str(p) for p in info.value.problems]
    # the fleet file's line that names the keys file, then the keys file's own problems
    assert got[0] == f"{fleet}:13:18: gateway.api_keys_file: invalid keys file {tmp_path / name}", got
    assert any(p.startswith(f"{tmp_path}/{expected.format(dir=tmp_path)}") for p in got[1:]), got


def test_missing_keys_file_is_a_config_error(tmp_path):
    assert problems(BASE + f"  api_keys_file: {tmp_path}/nope.txt\n") == [
        f"fleet.yaml:12:18: gateway.api_keys_file: invalid keys file {tmp_path}/nope.txt",
        f"{tmp_path}/nope.txt:1:1: <root>: cannot read file: No such file or directory"]


def utc(y, mo, d, h=0, mi=0, s=0) -> float:
    return float(calendar.timegm((y, mo, d, h, mi, s)))


PERIODS = [
    ("hour", utc(2024, 3, 10, 15, 42, 7), utc(2024, 3, 10, 15), utc(2024, 3, 10, 16)),
    ("hour", utc(2024, 12, 31, 23, 0, 0), utc(2024, 12, 31, 23), utc(2025, 1, 1)),
    ("day", utc(2024, 3, 10, 15, 42, 7) + 0.5, utc(2024, 3, 10), utc(2024, 3, 11)),
    ("day", utc(2024, 2, 28, 23, 59, 59), utc(2024, 2, 28), utc(2024, 2, 29)),
    ("week", utc(2024, 3, 10, 15, 42, 7), utc(2024, 3, 4), utc(2024, 3, 11)),   # a Sunday: its Monday is the 4th
    ("week", utc(2024, 3, 11), utc(2024, 3, 11), utc(2024, 3, 18)),             # Monday 00:00 starts a week
    ("week", utc(2024, 12, 31, 12), utc(2024, 12, 30), utc(2025, 1, 6)),        # across the year's end
    ("month", utc(2024, 2, 29, 12), utc(2024, 2, 1), utc(2024, 3, 1)),
    ("month", utc(2023, 12, 31, 23, 59, 59), utc(2023, 12, 1), utc(2024, 1, 1)),
    ("month", utc(2024, 1, 1), utc(2024, 1, 1), utc(2024, 2, 1)),
]


@pytest.mark.parametrize("period,now,start,end", PERIODS)
def test_budget_periods_are_utc_calendar_periods(period, now, start, end):
    assert (period_start(period, now), period_end(period, now)) == (start, end)


def test_unknown_period_is_refused():
    with pytest.raises(ValueError, match="unknown period 'year'"):
        period_start("year", 0.0)


def with_first_model(line: str) -> str:
    return BASE.replace("    aliases: [t]\n", f"    aliases: [t]\n    {line}\n") + "  {}\n"


def test_scheduling_policy_is_a_model_field_and_the_flag_is_managed():
    cfg = load_config_text(with_first_model("scheduling_policy: priority"), "fleet.yaml", {})
    assert [m.scheduling_policy for m in cfg.models] == ["priority", "fcfs"]
    # the engine starts differently: a change rolls the replicas
    assert cfg.models[0].job_hash() != cfg.models[0].model_copy(update={"scheduling_policy": "fcfs"}).job_hash()
    assert problems(with_first_model("scheduling_policy: lottery")) == [
        "fleet.yaml:6:24: models[0].scheduling_policy: Input should be 'fcfs' or 'priority'"]
    assert problems(with_first_model("vllm_args: {scheduling-policy: priority}")) == [
        "fleet.yaml:6:36: models[0].vllm_args.scheduling-policy: --scheduling-policy is set by scheduling_policy"]
