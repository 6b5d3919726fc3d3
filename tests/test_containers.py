"""The Apptainer definition: parsed, required sections present, entry command = what the templates run."""

from __future__ import annotations

import re
import subprocess

from conftest import ROOT
from orchestrator.config import GpuMetricsConfig
from orchestrator.fleetfile import load_config_text
from orchestrator.fleet.render import Renderer, engine_argv

DEF = ROOT / "containers" / "vllm.def"


def parse_def(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        m = re.match(r"^%(\w+)\s*$", line)
        if m:
            current = m.group(1)
            assert current not in sections, f"section %{current} twice"
            sections[current] = []
        elif current is None:
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
        else:
            sections[current].append(line.strip())
    return header, sections


def test_definition_sections_and_base():
    header, sections = parse_def(DEF.read_text())
    assert header["Bootstrap"] == "docker"
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", header["From"]), header["From"]
    assert {"files", "post", "environment", "runscript", "test", "labels"} <= set(sections)


def test_exporter_lands_where_the_templates_run_it():
    _, sections = parse_def(DEF.read_text())
    copies = dict(line.split() for line in sections["files"])
    target = GpuMetricsConfig().container_path
    assert copies["orchestrator/observability/gpu_exporter.py"] == target
    assert (ROOT / "orchestrator" / "observability" / "gpu_exporter.py").exists()
    assert any("nvidia-ml-py" in line for line in sections["post"])
    cfg = load_config_text("fleet: c\nstate_dir: /s\nmodels:\n  - {name: m, model_path: /models/m, "
                           "container: {image: /img.sif}}\n", "c.yaml", {})
    line = next(x for x in Renderer().node_script(cfg.models[0]).splitlines() if x.startswith("setsid apptainer"))
    assert line.startswith("setsid apptainer exec --nv ") and f" /img.sif python3 {target} " in line, line
    # the exporter writes into the state dir (here /srv/sf: no default bind of apptainer's), with the engine's
    # extra_args (a site that needs --userns to start a container at all needs it for the exporter too)
    cfg = load_config_text("fleet: c\nstate_dir: /srv/sf\nmodels:\n  - {name: m, model_path: /models/m, "
                           "container: {image: /img.sif, extra_args: [--userns]}}\n", "c.yaml", {})
    line = next(x for x in Renderer().node_script(cfg.models[0]).splitlines() if x.startswith("setsid apptainer"))
    assert line.startswith('setsid apptainer exec --nv --userns --bind "$SF_GPU_READINGS:$SF_GPU_READINGS" /img.sif '
                           f'python3 {target} --out "$SF_GPU_OUT"'), line


def test_entry_command_matches_the_templates():
    _, sections = parse_def(DEF.read_text())
    run = [line for line in sections["runscript"] if not line.startswith("#")]
    assert run == ['exec vllm serve "$@"']
    cfg = load_config_text("fleet: c\nstate_dir: /s\nmodels:\n  - {name: m, model_path: /models/m, "
                           "container: {image: /img.sif}}\n", "c.yaml", {})
    assert engine_argv(cfg.models[0])[:2] == ["vllm", "serve"]
    node = Renderer().node_script(cfg.models[0])
    assert 'apptainer exec --nv --bind "$SF_PYLIB:$SF_PYLIB:ro" /img.sif )' in node
    assert 'export APPTAINERENV_PYTHONPATH="$SF_PYLIB' in node
    env = "\n".join(sections["environment"])
    for var in ("HF_HOME", "VLLM_CACHE_ROOT", "HF_HUB_OFFLINE"):
        assert f"export {var}=" in env


def test_build_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "containers" / "build.sh")], check=True)
    r = subprocess.run(["shellcheck", str(ROOT / "containers" / "build.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
