"""Which GPUs the NVML exporter reads: the job's, matched to SLURM's global GPU ids by their device minor numbers
(under SLURM's device cgroup NVML sees the job's GPUs alone, numbered from 0), on a fake NVML."""

from __future__ import annotations

import pytest

from orchestrator.observability.gpu_exporter import read_gpus, wanted_devices


class FakeNVML:
    """pynvml's calls the exporter makes, over devices given as (minor number or None, uuid)."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, devices: list[tuple[int | None, str]]):
        self.devices = devices

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.devices[h][1]

    def nvmlDeviceGetMinorNumber(self, h: int) -> int:
        if self.devices[h][0] is None:
            raise self.NVMLError("Not Supported")
        return self.devices[h][0]

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H100"

    def nvmlDeviceGetUtilizationRates(self, h: int):
        return type("U", (), {"gpu": 10 * (h + 1)})()

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return type("M", (), {"used": 1 << 30, "total": 80 << 30})()

    def nvmlDeviceGetTemperature(self, h: int, _kind: int) -> int:
        return 40

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 300_000


def node(n: int) -> list[tuple[int | None, str]]:
    return [(i, f"GPU-{i}") for i in range(n)]


@pytest.mark.parametrize("devices,env,want", [
    # SLURM's device cgroup: NVML sees the job's GPUs 4 and 5 as its 0 and 1 (none were read: 0 and 1 matched none)
    ([(4, "GPU-4"), (5, "GPU-5")], {"SLURM_STEP_GPUS": "4,5"}, [(4, "GPU-4"), (5, "GPU-5")]),
    # the job's GPUs 1 and 2 seen as 0 and 1: NVML index 1 was read, as GPU 1, and was the job's GPU 2
    ([(1, "GPU-1"), (2, "GPU-2")], {"SLURM_JOB_GPUS": "1,2"}, [(1, "GPU-1"), (2, "GPU-2")]),
    # no cgroup: the whole node, the job's two
    (node(8), {"SLURM_JOB_GPUS": "6,7", "CUDA_VISIBLE_DEVICES": "0,1"}, [(6, "GPU-6"), (7, "GPU-7")]),
    # SLURM's ids that are not the device files' numbers (a gres.conf of /dev/nvidia[4-7]): NVML's index then
    ([(4 + i, f"GPU-{i}") for i in range(4)], {"SLURM_JOB_GPUS": "0,1"}, [(4, "GPU-0"), (5, "GPU-1")]),
    # no minor number to be had: NVML's index
    ([(None, "GPU-a"), (None, "GPU-b")], {"SLURM_JOB_GPUS": "1"}, [(1, "GPU-b")]),
    # CUDA_VISIBLE_DEVICES alone: NVML indices or UUIDs
    (node(4), {"CUDA_VISIBLE_DEVICES": "2"}, [(2, "GPU-2")]),
    (node(4), {"CUDA_VISIBLE_DEVICES": "GPU-3"}, [(3, "GPU-3")]),
    (node(2), {}, [(0, "GPU-0"), (1, "GPU-1")]),
], ids=["cgroup-4-5", "cgroup-1-2", "whole-node", "ids-not-minors", "no-minor", "cuda-index", "cuda-uuid", "all"])
def test_the_jobs_gpus_are_read(devices, env, want):
    got = read_gpus(FakeNVML(devices), wanted_devices(env))
    assert [(g["index"], g["uuid"]) for g in got] == want
    assert all(g["memory_total_bytes"] == 80 << 30 and g["power_watts"] == 300.0 for g in got)
