"""The built wheel works without the checkout: templates and example fleets ship inside it.

Builds the wheel from a copy of the sources (so no ``build/`` or ``*.egg-info`` lands in the
repository; no network: ``--no-build-isolation`` uses the setuptools and wheel of this venv),
installs it with ``pip --target SITE``, and runs ``python -m orchestrator`` from an empty folder
with ``PYTHONPATH=SITE``. PYTHONPATH comes before site-packages, where the editable install of
the checkout lives, and the test asserts that ``orchestrator`` and its data resolve inside SITE.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_runs_outside_the_checkout(tmp_path):
    src, site, cwd = tmp_path / "src", tmp_path / "site", tmp_path / "cwd"
    cwd.mkdir()
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "orchestrator", "sbatch", "configs"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", src],
                   check=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("slurmfleet-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True, timeout=120)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SLURMFLEET_CONFIG"))}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-s", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=60)

    where = run("-c", "import orchestrator, orchestrator.resources as r; "
                      "print(orchestrator.__file__, r.configs_dir(), r.templates_dir(), sep='\\n')")
    assert where.returncode == 0, where.stderr
    data = site / "orchestrator" / "_data"
    assert where.stdout.split() == [str(site / "orchestrator" / "__init__.py"), str(data / "configs"),
                                    str(data / "sbatch")]

    for fleet in ("example.yaml", "local.yaml"):  # local.yaml: ${VAR:-default} expansions validate as they are
        r = run("-m", "orchestrator", "validate", str(data / "configs" / fleet))
        assert r.returncode == 0, r.stdout + r.stderr
    r = run("-m", "orchestrator", "render", "llama-8b", "-c", str(data / "configs" / "example.yaml"))
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --job-name=slurmfleet-prod" in r.stdout and "vllm serve" in r.stdout
    # without -c (and no $SLURMFLEET_CONFIG) the default fleet is the shipped local.yaml
    r = run("-m", "orchestrator", "render", "tiny")
    assert r.returncode == 0 and "#SBATCH --job-name=slurmfleet-local" in r.stdout and "vllm serve" in r.stdout, r.stderr
    r = run("-m", "orchestrator", "render", "no-such-model")
    assert r.returncode == 2 and str(data / "configs" / "local.yaml") in r.stderr, r.stderr
