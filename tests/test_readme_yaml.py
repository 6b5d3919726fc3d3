"""The README's YAML example is a fleet file's part that loads as written (with the `configs/` keys file it names)."""

import ast
import re
import shutil
from pathlib import Path

from orchestrator.fleetfile import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_readme_yaml_blocks_load(tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has a YAML example"
    shutil.copy(ROOT / "configs" / "client-keys.yaml", tmp_path / "client-keys.yaml")
    for n, block in enumerate(blocks):
        path = tmp_path / f"block{n}.yaml"
        path.write_text(f"fleet: readme\nstate_dir: {tmp_path / 'state'}\n" + block)
        cfg = load_config(path)   # ConfigError names the file, line and field of what went stale
        assert cfg.models, f"README YAML block {n} defines a model"
    keys = {k.name: k for k in cfg.gateway.keys()}
    assert keys["team-vision"].rpm == 600 and keys["team-vision"].budget_period == "month"
    assert "team-nlp" in keys   # from the keys file the example names


def test_every_metric_the_code_exports_is_in_the_readmes_reference():
    """The README's metrics reference names every metric family the code exports (a name in a string, or the
    per-key and per-group budget families made from one pattern), as Prometheus shows it (counters with
    ``_total``), and no name the code does not export: a new metric without its line fails here."""
    names, patterns = set(), set()
    for f in (ROOT / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"slurmfleet_[a-z0-9_]+", node.value):
                names.add(node.value)
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
                    and node.values[0].value == "slurmfleet_" and isinstance(node.values[-1], ast.Constant):
                patterns.add(node.values[-1].value)   # (f"slurmfleet_{key or group}_budget_tokens")
    assert len(names) > 60 and patterns == {"_budget_tokens", "_budget_used_tokens", "_budget_reset_timestamp_seconds"}
    section = (ROOT / "README.md").read_text().split("\n## Metrics reference\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`slurmfleet_[a-z0-9_]+`(?:, `slurmfleet_[a-z0-9_]+`)*) \| (gauge|counter|histogram) \|",
                      section, re.M)
    documented = {n.strip("`"): kind for cell, kind in rows for n in cell.split(", ")}
    assert sorted(n for n in names if n not in documented and n + "_total" not in documented) == []
    assert sorted(d for d in documented if d not in names and d.removesuffix("_total") not in names and not any(
        d in (f"slurmfleet_key{p}", f"slurmfleet_group{p}") for p in patterns)) == []
    assert all(d.endswith("_total") == (kind == "counter") for d, kind in documented.items()), documented
