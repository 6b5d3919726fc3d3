"""The README's YAML example is a fleet file's part that loads as written (with the `configs/` keys file it names)."""

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
