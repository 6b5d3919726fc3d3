"""Where the files that ship with slurmfleet lie: the sbatch templates and the example fleets.

In the repository they are the top-level ``sbatch/`` and ``configs/`` folders; a built wheel carries
copies of both inside the package (``orchestrator/_data/``, see ``setup.py``), so an installed
slurmfleet finds them without a checkout.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    shipped = _PACKAGE / "_data" / name
    if shipped.is_dir():
        return shipped
    return _PACKAGE.parent / name


def templates_dir() -> Path:
    """The folder holding ``replica.sh.j2`` and ``node.sh.j2``."""
    return _find("sbatch")


def configs_dir() -> Path:
    """The folder holding the example fleets (``local.yaml``, ``example.yaml``)."""
    return _find("configs")
