"""The fleet's status as data (for ``/admin/status`` and ``status --json``) and as a table."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from ..contract import NO_LOAD, EngineLoad
from ..fleet.reconciler import Reconciler
from ..fleet.replica import State
from ..fleet.reports import ReportHub
from ..statedir import log_tail
from ..timefmt import utc_minute

NEXT_SUBMISSION = re.compile(r"; next submission in \d+s")


def fleet_status(rec: Reconciler, hub: ReportHub | None = None, loads: Mapping[str, EngineLoad] | None = None,
                 now: float | None = None, gpus: dict[tuple[str, str, str, str], dict[str, float]] | None = None,
                 gateway: dict[str, Any] | None = None, last_reload: dict | None = None) -> dict[str, Any]:
    """``hub``: the gateway processes' reports (in flight, queued); ``loads``: the engines' scraped load;
    ``gateway``: ``processes`` and ``worker_restarts``; ``last_reload``: the last reload's ``ok``, ``time`` and
    ``errors`` (None: none since the start)."""
    now = time.time() if now is None else now
    gpus = gpus or {}
    loads = loads or {}
    queued = hub.queued() if hub else {}
    # one read of the reports for every replica; as they are (a process behind the newest table makes
    # inflight_by_job count every job at least 1, for drains: shown, it was a phantom request on idle replicas)
    inflight = dict(hub.inflight_by_job()) if hub else None
    models = []
    names = [m.name for m in rec.cfg.models] + sorted({f.model for f in rec.replicas.values()}
                                                       - {m.name for m in rec.cfg.models})
    for name in names:
        m = rec.cfg.model(name)
        rt = rec.runtime(name)
        reps = []
        for f in sorted((f for f in rec.replicas.values() if f.model == name), key=lambda f: (f.slot, f.job_id)):
            st = rec.state_of(f, now)
            load = loads.get(f.job_id, NO_LOAD)
            mine = [v for (*_, job), v in gpus.items() if job == f.job_id]   # (a slot's successor: its own)
            reps.append({
                "job_id": f.job_id, "slot": f.slot, "state": st.value, "slurm_state": f.slurm_state,
                "reason": f.reason, "nodes": f.nodelist,
                "endpoint": f"{f.endpoint.host}:{f.endpoint.port}" if f.endpoint else None,
                "age_s": round(now - f.start_time, 1) if f.start_time and f.slurm_state == "RUNNING" else None,
                "time_left_s": round(tl, 1) if (tl := f.time_left_s(now)) is not None else None,
                "config_hash": f.config_hash,
                "outdated": m is None or f.config_hash != m.job_hash(),
                "draining": f.drain_requested_at is not None,
                "handing_over": f.drain_requested_at is None and (f.replace_requested or f.time_limit_warned),
                "last_probe_error": f.last_probe_error,
                "inflight": inflight.get(f.job_id, 0) if inflight is not None else None,
                "engine_running": load.running,
                "engine_waiting": load.waiting,
                "kv_cache_usage": load.kv_usage,
                "gpus": len(mine),
                "gpu_utilization": (sum(v.get("utilization_ratio", 0.0) for v in mine) / len(mine)) if mine else None,
                "gpu_memory_used_bytes": sum(v.get("memory_used_bytes", 0.0) for v in mine) if mine else None,
            })
        count = {s.value: sum(1 for r in reps if r["state"] == s.value) for s in State}
        pending = sorted({r["reason"] for r in reps if r["state"] == "QUEUED" and r["reason"]})
        models.append({
            "model": name, "aliases": list(m.aliases) if m else [], "configured": m is not None,
            "desired": rec.desired(m) if m else 0, "pinned": rt.desired_override if m else None,   # (`scale`)
            "ready": count["READY"], "starting": count["STARTING"],
            "pending": count["QUEUED"], "pending_reasons": pending, "states": count,
            "blocked": rt.blocked, "last_error": rt.last_error, "last_log": rt.last_log,
            "backoff_s": round(max(0.0, rt.backoff_until - now), 1), "backoff_cause": rt.backoff_cause,
            "crashes": rt.crashes,
            "excluded_nodes": sorted(rt.excluded), "submitted": rt.submitted,
            "autoscale": _autoscale(rec, m, now) if m is not None and m.autoscale is not None else None,
            "queued_requests": queued[name].depth if name in queued else 0,
            "oldest_queued_s": round(queued[name].oldest_age_s, 1) if name in queued else 0.0,
            "replicas": reps,
        })
    gw = dict(gateway or {"processes": 1, "worker_restarts": 0})
    return {"fleet": rec.cfg.fleet, "ticks": rec.ticks, "last_tick_error": rec.last_tick_error,
            "time": now, "gateway": gw, "last_reload": last_reload, "models": models}


def _autoscale(rec: Reconciler, m, now: float) -> dict[str, Any]:
    """The autoscaler's view of an autoscaled model: its target, why, and the scale-up jobs still PENDING."""
    a = m.autoscale
    pinned = rec.runtime(m.name).desired_override
    d = rec.autoscaler.decisions.get(m.name)
    cap = rec.capacity(m, now)
    reason = (f"pinned at {pinned} by `slurmfleet scale` (`slurmfleet scale {m.name} auto` or a reload unpins)"
              if pinned is not None else d.reason if d else "no decision yet")
    return {"min": a.min_replicas, "max": a.max_replicas, "target": rec.desired(m), "reason": reason,
            "pinned": pinned is not None, "pending_jobs": [{"job_id": j, "reason": r} for j, r in cap.pending],
            "handover": cap.handover}


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 0:
        return "0s"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}h" if d else (f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s"))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def render_table(status: dict[str, Any]) -> str:
    """A human table (rich), one block per model."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buf = StringIO()
    console = Console(file=buf, width=150, force_terminal=False, color_system=None)
    gw = status.get("gateway") or {}
    console.print(f"fleet {status['fleet']}  (ticks {status['ticks']})"
                  + (f"  gateway: {gw['processes']} process{'es' if gw['processes'] != 1 else ''}"
                     + (f", {gw['worker_restarts']} worker restarts" if gw.get("worker_restarts") else "")
                     if gw else "")
                  + (f"  last tick error: {status['last_tick_error']}" if status.get("last_tick_error") else ""))
    if (rl := status.get("last_reload")) and not rl["ok"]:   # (the fleet runs on its last good file)
        more = f" (+{len(rl['errors']) - 3} more)" if len(rl["errors"]) > 3 else ""
        console.print(f"last reload REJECTED at {utc_minute(rl['time'])}, the fleet runs on its last good file: "
                      + "; ".join(rl["errors"][:3]) + more)
    summary = Table("model", "desired", "ready", "starting", "pending", "pending reasons", "problem",
                    title="models", title_justify="left")
    for m in status["models"]:
        problem = m["blocked"] or m["last_error"] or ""
        if m.get("last_error") and m.get("last_log") and not m["blocked"]:   # (read here: the CLI, on the daemon's
            problem += f"; {log_tail(m['last_log']) or 'its log: ' + m['last_log']}"   # host; never in the tick)
        # (the log's "next submission in N s" was said at the crash: the back-off left is the live figure)
        problem = NEXT_SUBMISSION.sub("", problem)
        if m["backoff_s"]:   # (a job count limit, a drained partition: no crash, next try in)
            problem = (f"backing off {m['backoff_s']:.0f}s" if m.get("backoff_cause", "crash") == "crash" else
                       f"next try in {m['backoff_s']:.0f}s") + f": {problem}"
        if not m["configured"]:
            problem = "removed from config: draining"
        summary.add_row(m["model"], f"{m['desired']}{' (pinned)' if m.get('pinned') is not None else ''}", str(m["ready"]), str(m["starting"]), str(m["pending"]),
                        ", ".join(m["pending_reasons"]) or "-", problem or "-")
    console.print(summary)
    scaled = [m for m in status["models"] if m.get("autoscale")]
    if scaled:
        auto = Table("model", "bounds", "target", "held requests", "pending scale-up jobs", "why",
                     title="autoscaling", title_justify="left")
        for m in scaled:
            a = m["autoscale"]
            held = f"{m['queued_requests']} (oldest {m['oldest_queued_s']:.0f}s)" if m["queued_requests"] else "0"
            jobs = ", ".join(f"{j['job_id']} ({j['reason'] or '-'})" for j in a["pending_jobs"]) or "-"
            auto.add_row(m["model"], f"{a['min']}-{a['max']}", str(a["target"]), held, jobs, a["reason"])
        console.print(auto)
    reps = Table("model", "slot", "job", "state", "node", "endpoint", "age", "time left", "in flight",
                 "engine run/wait", "kv", "gpu util", title="replicas", title_justify="left")
    for m in status["models"]:
        for r in m["replicas"]:
            eng = "-" if r["engine_running"] is None else f"{r['engine_running']:.0f}/{r['engine_waiting'] or 0:.0f}"
            state = r["state"] + (" (outdated)" if r["outdated"] else "") + (" (handing over)" if r.get("handing_over")
                                                                              else "")
            if r["state"] == "QUEUED" and r["reason"]:
                state += f" ({r['reason']})"
            reps.add_row(m["model"], str(r["slot"]), r["job_id"], state, r["nodes"] or "-", r["endpoint"] or "-",
                         _dur(r["age_s"]), _dur(r["time_left_s"]), str(r["inflight"] or 0), eng,
                         _pct(r["kv_cache_usage"]), _pct(r.get("gpu_utilization")))
    console.print(reps)
    return buf.getvalue()
