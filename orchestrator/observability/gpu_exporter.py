#!/usr/bin/env python3
"""GPU readings of one job on one node, through NVML, written as JSON for the daemon to collect.

Runs next to vLLM on every node of a replica (the sbatch template starts it), standard library plus
``nvidia-ml-py`` only, so the same file runs from the package on a host or copied into the image.
Every ``--interval-s`` it writes ``--out`` atomically (write, then rename):
``{"job_id", "node", "rank", "time", "gpus": [{"index", "uuid", "name", "utilization_ratio",
"memory_used_bytes", "memory_total_bytes", "temperature_celsius", "power_watts"}], "error"}`` (``index``: the
GPU's ``/dev/nvidiaN`` number where NVML tells it, the node's number for it, else NVML's index).
Without NVML (no driver, no GPU) ``gpus`` is empty and ``error`` says why: nothing is invented.

Which GPUs: the job's own.  NVML enumerates every GPU it can open regardless of ``CUDA_VISIBLE_DEVICES``:
the node's, or under SLURM's ``ConstrainDevices`` the job's alone, numbered from 0.  So entries of
``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS`` (SLURM's global GPU ids, which are not relative to the job's device
cgroup: ``/dev/nvidiaN``'s N where gres.conf lists the device files in order) are matched to each device's
minor number (its ``/dev/nvidiaN``), and to NVML's index only where no minor number matches (a gres.conf
whose ids are not the files' numbers, on a node whose GPUs NVML all sees); ``CUDA_VISIBLE_DEVICES`` UUIDs
(``GPU-...``) are matched too, and its plain indices are used as NVML indices only when neither is there.

With ``--parent-pid`` (the job's node script passes its own pid) it exits, removing ``--out``, once that
process is gone, checked about every second whatever ``--interval-s``: it never outlives its job.  A
pid it cannot see at start (another PID namespace) is not watched.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def wanted_devices(env: dict[str, str]) -> tuple[str, list[str]] | None:
    """The job's GPUs: ("slurm", SLURM's global GPU ids or UUIDs) or ("cuda", CUDA_VISIBLE_DEVICES' indices or
    UUIDs); None means every GPU NVML sees."""
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if env.get(key):
            return "slurm", [x.strip() for x in env[key].split(",") if x.strip()]
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return "cuda", [x.strip() for x in cvd.split(",") if x.strip()]
    return None


def _minor(pynvml, h) -> str | None:
    try:
        return str(pynvml.nvmlDeviceGetMinorNumber(h))
    except pynvml.NVMLError:   # (not on every platform)
        return None


def read_gpus(pynvml, wanted: tuple[str, list[str]] | None) -> list[dict]:
    devices = []   # (NVML's index, handle, UUID, minor number: the node's number for it, NVML's index being
    for i in range(pynvml.nvmlDeviceGetCount()):   # the job's under a device cgroup)
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        devices.append((i, h, uuid.decode() if isinstance(uuid, bytes) else uuid, _minor(pynvml, h)))
    if wanted is not None:
        kind, ids = wanted
        by_minor = [d for d in devices if kind == "slurm" and d[3] in ids]
        devices = by_minor or [d for d in devices if str(d[0]) in ids or d[2] in ids]
    out = []
    for i, h, uuid, minor in devices:
        name = pynvml.nvmlDeviceGetName(h)
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        gpu = {"index": int(minor) if minor is not None else i, "uuid": uuid,
               "name": name.decode() if isinstance(name, bytes) else name,
               "utilization_ratio": util.gpu / 100.0, "memory_used_bytes": int(mem.used),
               "memory_total_bytes": int(mem.total)}
        try:
            gpu["temperature_celsius"] = float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
        except pynvml.NVMLError:
            pass
        try:
            gpu["power_watts"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        except pynvml.NVMLError:
            pass
        out.append(gpu)
    return out


def sample(env: dict[str, str]) -> dict:
    doc = {"job_id": env.get("SLURM_JOB_ID", ""), "node": env.get("SLURMD_NODENAME") or socket.gethostname(),
           "rank": int(env.get("SLURM_NODEID", "0") or 0), "time": time.time(), "gpus": [], "error": None}
    try:
        import pynvml
    except ImportError:
        doc["error"] = "nvidia-ml-py (pynvml) is not installed"
        return doc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        doc["error"] = f"NVML unavailable: {exc}"
        return doc
    try:
        doc["driver"] = pynvml.nvmlSystemGetDriverVersion()
        doc["driver"] = doc["driver"].decode() if isinstance(doc["driver"], bytes) else doc["driver"]
        doc["gpus"] = read_gpus(pynvml, wanted_devices(env))
    except Exception as exc:
        doc["error"] = f"NVML read failed: {exc}"
    finally:
        pynvml.nvmlShutdown()
    return doc


def write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def _proc_start(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process from /proc, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


class ParentWatch:
    """Is the process that started us still there?  The pid, and its start time where /proc tells it
    (a reused pid is another process; a zombie is gone)."""

    def __init__(self, pid: int):
        self.pid = pid
        st = _proc_start(pid)
        self.start = st[1] if st else None

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # there, another user's
        st = _proc_start(self.pid)
        if st is None or self.start is None:
            return True
        return st[0] != "Z" and st[1] == self.start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="file to (re)write; default: print once to stdout")
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--parent-pid", type=int, help="exit (removing --out) once this process is gone")
    args = ap.parse_args(argv)
    parent = None
    if args.parent_pid is not None:
        parent = ParentWatch(args.parent_pid)
        if not parent.alive():
            print(f"gpu_exporter: --parent-pid {args.parent_pid} not visible (another PID namespace?); "
                  "not watching it", file=sys.stderr)
            parent = None
    while True:
        doc = sample(dict(os.environ))
        if args.out:
            write(args.out, doc)
        if args.once or not args.out:
            print(json.dumps(doc, indent=2))
            return 0
        deadline = time.monotonic() + args.interval_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            if parent is not None and not parent.alive():
                print(f"gpu_exporter: parent {parent.pid} is gone; exiting", file=sys.stderr)
                try:
                    os.unlink(args.out)
                except FileNotFoundError:
                    pass
                return 0


if __name__ == "__main__":
    sys.exit(main())
