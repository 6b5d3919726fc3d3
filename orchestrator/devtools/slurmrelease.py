"""Which Slurm release this host has (``slurmd -V``), and what the local cluster writes for it."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

CGROUP_CONF_HEADER = "# written by slurmfleet local-cluster (Slurm 24.05 and later); do not edit\n"


@dataclasses.dataclass(frozen=True, order=True)
class SlurmRelease:
    """A Slurm release as ``slurmd -V`` names it (``slurm-wlm 24.11.5`` -> 24.11.5)."""

    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"

    @property
    def disables_cgroup_plugin(self) -> bool:
        """``CgroupPlugin=disabled`` exists from 24.05 on (22.05 rejects it) and is needed there: slurmd
        always starts a cgroup plugin and exits where no cgroup file system is usable."""
        return (self.major, self.minor) >= (24, 5)


_VERSION = re.compile(r"\b(\d+)\.(\d+)(?:\.(\d+))?")


def parse_slurm_version(text: str) -> SlurmRelease | None:
    """The release in ``slurmd -V``'s output (``slurm-wlm 24.11.5``, ``slurm 22.05.8``); None if none."""
    m = _VERSION.search(text)
    if not m:
        return None
    return SlurmRelease(int(m[1]), int(m[2]), int(m[3] or 0))


def cgroup_conf(release: SlurmRelease | None) -> str | None:
    """The cgroup.conf this release needs beside slurm.conf, or None for none (22.05, or unknown)."""
    if release is None or not release.disables_cgroup_plugin:
        return None
    return CGROUP_CONF_HEADER + "CgroupPlugin=disabled\n"


def exe(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


def detect_release(slurmd: str | None = None) -> SlurmRelease | None:
    """Run ``slurmd -V``; None when it cannot be run or says no version."""
    try:
        r = subprocess.run([slurmd or exe("slurmd"), "-V"], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_slurm_version(r.stdout + " " + r.stderr)
