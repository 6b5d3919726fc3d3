"""The ``slurmfleet`` command."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from . import adminclient, batchcli
from . import cliargs
from .autoscaleconf import advisories
from .keys import key_advisories
from .config import FleetConfig
from .fleetfile import load_config, parse_config
from .resources import configs_dir
from .statedir import StateDir
from .timefmt import utc_minute
from .yamlsrc import ConfigError, load_file

DEFAULT_CONFIG = configs_dir() / "local.yaml"


def _config_path(args: argparse.Namespace) -> str:
    return args.config or os.environ.get("SLURMFLEET_CONFIG") or str(DEFAULT_CONFIG)


def _load(path: str) -> FleetConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        _fail("\n".join(map(str, exc.problems)), 2)


def cmd_validate(args: argparse.Namespace) -> int:
    from .fleet import preflight

    args.file = args.file or _config_path(args)   # a file named, else -c, $SLURMFLEET_CONFIG, the default
    try:
        src = load_file(args.file)
        cfg = parse_config(src)
        warnings = advisories(cfg.models, cfg.gateway.workers) + key_advisories(cfg.gateway, time.time()) + (
            asyncio.run(preflight.vet_file(cfg, src)) if args.slurm else [])
    except ConfigError as exc:
        for p in exc.problems:
            print(p)
        print(f"{args.file}: {len(exc.problems)} problem(s)", file=sys.stderr)
        return 2
    print(f"{args.file}: fleet {cfg.fleet!r}, {len(cfg.models)} model(s), state_dir {cfg.state_dir}")
    for m in cfg.models:
        limit = "unlimited" if m.time_limit is None else f"{m.time_limit / 3600:g}h"
        gpus = f"{m.gpus_per_node} {m.gpu_type}" if m.gpu_type else str(m.gpus_per_node)
        print(f"  {m.name}: {m.count_label} x ({m.nodes} node(s) x {gpus} GPU, TP={m.tensor_parallel_size} "
              f"PP={m.pipeline_parallel_size}) engine={m.engine} time_limit={limit} routing={m.routing}"
              + (f" aliases={','.join(m.aliases)}" if m.aliases else "") + f" hash={m.job_hash()}")
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


def _model(cfg: FleetConfig, name: str):   # the model served as ``name``: its name or one of its aliases
    return next((m for m in cfg.models if name in m.served_names), None)


def cmd_render(args: argparse.Namespace) -> int:
    from .fleet.render import Renderer
    cfg = _load(_config_path(args))
    m = _model(cfg, args.model)
    if m is None:
        print(f"no model {args.model!r} in {_config_path(args)} (have: {', '.join(x.name for x in cfg.models)})",
              file=sys.stderr)
        return 2
    sys.stdout.write(Renderer().render(cfg, m, args.slot, nonce="render"))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .daemon import Daemon
    from .procexit import exit_bounded

    path = _config_path(args)
    cfg = _load(path)
    if path == str(DEFAULT_CONFIG):   # the embedded fleet: its vLLM is .ci/setup-vllm's (.venv-vllm), as demo's
        from .devtools.demo import vllm_available
        vllm_available()
    try:
        import uvloop  # noqa: F401
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return exit_bounded(runner(Daemon(path, cfg, cancel_jobs_on_exit=args.cancel_jobs_on_exit, settle_gc=True).run()))


def _fail(message: str, code: int = 1) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(code)


def _admin(args: argparse.Namespace, method: str, path: str, body: dict | None = None,
           cfg: FleetConfig | None = None) -> tuple[int, dict]:
    cfg = cfg or adminclient.daemon_config(_config_path(args))   # (a file its daemon refused still reaches it)
    return adminclient.call(cfg, _config_path(args), args.admin_url, method, path, body)


def _refused(cmd: str, res: dict) -> int:
    """The admin API's refusal as one line on stderr (its OpenAI-style message), exit status 1."""
    err = res.get("error")
    msg = err.get("message") if isinstance(err, dict) else err
    print(f"slurmfleet {cmd}: {msg if isinstance(msg, str) and msg else json.dumps(res)}", file=sys.stderr)
    return 1


def cmd_status(args: argparse.Namespace) -> int:
    from .observability.status import render_table
    while True:
        code, st = _admin(args, "GET", "/admin/status")
        if code != 200:
            return _refused("status", st)
        if args.json:
            print(json.dumps(st, indent=2))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print(render_table(st), end="")
        if not args.watch:
            return 0
        time.sleep(args.watch)


def cmd_reload(args: argparse.Namespace) -> int:
    code, res = _admin(args, "POST", "/admin/reload")
    if res.get("ok"):
        read = res.get("config")   # (the daemon reads its own file: -c names the daemon, not what it reads)
        other = isinstance(read, str) and os.path.realpath(read) != os.path.realpath(_config_path(args))
        head = f"reload applied (the daemon read {read}, not {_config_path(args)})" if other else "reload applied"
        print(head + "".join(f"\n  {c}" for c in res.get("changes", [])))
        print("".join(f"warning: {w}\n" for w in res.get("warnings", [])), end="", file=sys.stderr)
        return 0
    if not isinstance(res.get("errors"), list):   # (the admin API refused the call itself: not the file)
        return _refused("reload", res)
    print("".join(f"{e}\n" for e in res["errors"]), end="", file=sys.stderr)
    return 1 if res.get("invalid") is False else 2   # (a file refused: invalid input; the daemon failing on it: 1)


def cmd_drain(args: argparse.Namespace) -> int:
    code, res = _admin(args, "POST", f"/admin/drain/{args.job_id}", {"replace": True} if args.replace else None)
    if code != 200:
        return _refused("drain", res)
    print(json.dumps(res))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    cfg = adminclient.daemon_config(_config_path(args))
    m = _model(cfg, args.model)   # an alias means its model: the daemon pins models by name
    code, res = _admin(args, "POST", "/admin/scale", {"model": m.name if m else args.model,
                                                      "replicas": args.replicas}, cfg)
    if code != 200:
        return _refused("scale", res)
    print(json.dumps(res))
    return 0


_UNITS_S = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _when(v: str, now: float | None = None) -> float:
    """A time as epoch seconds: ``now``, ago (``30m``, ``24h``, ``7d``, ``2w``) or a UTC date/time
    (``2026-11-01``, ``2026-11-01T13:00``)."""
    from datetime import datetime, timezone

    now = time.time() if now is None else now
    if v == "now":
        return now
    if len(v) > 1 and v[-1] in _UNITS_S and v[:-1].isdigit():
        return max(0.0, now - min(int(v[:-1]) * _UNITS_S[v[-1]], now))   # (an age past 1970: all of it)
    try:
        t = datetime.fromisoformat(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is neither 'now', an age like 24h, 7d, 2w nor a date like "
                                         "2026-11-01 or 2026-11-01T13:00 (UTC)") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def _dimensions(v: str) -> str:
    from .fleet.usagequery import DIMENSIONS

    bad = [d for d in v.split(",") if d and d not in DIMENSIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"cannot sum by {', '.join(bad)} (one of {', '.join(DIMENSIONS)})")
    return v


_USAGE_COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "tokens")


def usage_report(rows: list[dict], by: list[str], fmt: str, title: str = "") -> str:
    """``rows`` of :func:`orchestrator.fleet.usagequery.query` as a table (with a totals row), JSON or CSV."""
    if fmt == "json":
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, [*by, *_USAGE_COLUMNS], lineterminator="\n")
        w.writeheader()
        w.writerows({**r, **({"group": r["group"] or ""} if "group" in r else {})} for r in rows)
        return buf.getvalue()
    from rich.console import Console
    from rich.table import Table

    table = Table(*by, *(c.replace("_", " ") for c in _USAGE_COLUMNS), title=title or None, title_justify="left")
    for c in table.columns[len(by):]:
        c.justify = "right"
    for r in rows:
        table.add_row(*(str(r[b]) if r[b] is not None else "-" for b in by), *(f"{r[c]:,}" for c in _USAGE_COLUMNS))
    table.add_section()
    table.add_row(*(["total"] + [""] * (len(by) - 1) if by else []),
                  *(f"{sum(r[c] for r in rows):,}" for c in _USAGE_COLUMNS))
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()


def cmd_usage(args: argparse.Namespace) -> int:
    import sqlite3

    from .fleet.usagequery import query

    if args.since > args.until:   # (an empty table would say nothing of the mistake)
        print(f"--since ({utc_minute(args.since)}) is after --until ({utc_minute(args.until)})", file=sys.stderr)
        return 2
    path = StateDir(_load(_config_path(args)).state_dir).root / "usage.sqlite3"
    by = list(dict.fromkeys(b for v in (args.by or ["key"]) for b in v.split(",") if b))
    try:
        rows = query(path, args.since, args.until, by)
    except FileNotFoundError:
        print(f"no usage recorded yet: {path} does not exist (the daemon creates it when it starts; is "
              f"{_config_path(args)} the fleet's config?)", file=sys.stderr)
        return 1
    except (ValueError, sqlite3.Error, OSError) as exc:
        print(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    end = -(-args.until // 3600) * 3600   # the hour ``until`` falls in is counted whole
    span = " to ".join(time.strftime("%Y-%m-%d %H:00", time.gmtime(t)) for t in (args.since, end))
    sys.stdout.write(usage_report(rows, by, "json" if args.json else "csv" if args.csv else "table",
                                  f"usage {span} UTC (whole hours)"))
    return 0


def cmd_local_cluster(args: argparse.Namespace) -> int:
    from .devtools.localcluster import ClusterError, LocalCluster

    kw = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node}
    if args.dir:
        kw["root"] = Path(args.dir)
    if args.ctld_port is not None:
        kw["ctld_port"] = args.ctld_port
    if args.slurmd_port_base is not None:
        kw["slurmd_base_port"] = args.slurmd_port_base
    try:
        cluster = LocalCluster(**kw)
        if args.action == "up":
            took = cluster.up()
            print(f"local SLURM cluster up: {cluster.describe()} (ready in {took:.1f}s)")
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            print("stopped: " + (", ".join(cluster.down()) or "nothing was running"))
        else:
            print(json.dumps(cluster.status(), indent=2))
    except ClusterError as exc:
        print(f"local-cluster: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise
    except OSError as exc:   # (its folder cannot be made: --dir under /proc, a read-only file system)
        print(f"local-cluster: {_os_error(exc)}", file=sys.stderr)
        return 1
    return 0


def _os_error(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def cmd_demo(args: argparse.Namespace) -> int:
    from .devtools.demo import ClusterError, run_demo

    try:
        return run_demo(_config_path(args))
    except ConfigError as exc:
        _fail("\n".join(map(str, exc.problems)), 2)
    except ClusterError as exc:
        _fail(f"demo: {exc}")
    except BrokenPipeError:
        raise
    except OSError as exc:   # (the cluster's folder cannot be made: $SLURMFLEET_CLUSTER_DIR)
        _fail(f"demo: {_os_error(exc)}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slurmfleet", description="Serve LLM fleets on SLURM behind one OpenAI endpoint.",
                                epilog="exit status: 0 done; 1 failed or refused (no daemon, an API error); 2 invalid "
                                       "input (a bad fleet file, a bad argument); 130 Ctrl-C")
    p.add_argument("--log-level", default=os.environ.get("SLURMFLEET_LOG_LEVEL", "INFO"))
    p.add_argument("--config", "-c", dest="top_config", help="fleet YAML, before the command as after it")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", "-c", help=f"fleet YAML (default: $SLURMFLEET_CONFIG or {DEFAULT_CONFIG})")
        return sp

    def with_admin(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        with_config(sp).add_argument("--admin-url", help="admin API URL (default: from the config)")
        return sp

    sp = with_config(sub.add_parser("validate", help="check a fleet YAML; print every problem as FILE:LINE:COL"))
    sp.add_argument("file", nargs="?", help="the YAML to check (default: --config's)")
    sp.add_argument("--slurm", action="store_true", help="also show each model's job to SLURM (sbatch --test-only: "
                    "submits nothing) and report those it refuses")
    sp.set_defaults(func=cmd_validate)
    sp = with_config(sub.add_parser("render", help="print the sbatch script of a model"))
    sp.add_argument("model", help="a served name or an alias")
    sp.add_argument("--slot", type=cliargs.slot, default=0, help="the replica slot whose script (default 0)")
    sp.set_defaults(func=cmd_render)
    sp = with_config(sub.add_parser("serve", help="run the daemon: replicas, gateway, admin API"))
    sp.add_argument("--cancel-jobs-on-exit", action="store_true", help="cancel the fleet's jobs on shutdown")
    sp.set_defaults(func=cmd_serve)
    sp = with_admin(sub.add_parser("status", help="the fleet's models and replicas"))
    sp.add_argument("--json", action="store_true", help="the admin API's status object, as JSON")
    sp.add_argument("--watch", type=cliargs.seconds, metavar="SECONDS", help="show it again every SECONDS (Ctrl-C ends)")
    sp.set_defaults(func=cmd_status)
    sp = with_admin(sub.add_parser("reload", help="the daemon re-reads its own YAML (like SIGHUP); -c finds it"))
    sp.set_defaults(func=cmd_reload)
    sp = with_admin(sub.add_parser("drain", help="drain a replica: no new requests, then cancel"))
    sp.add_argument("job_id", type=cliargs.job_id, help="the replica's SLURM job id (slurmfleet status lists them)")
    sp.add_argument("--replace", action="store_true", help="keep it serving until a successor is READY, then drain "
                    "it (a handover: the model never goes without it)")
    sp.set_defaults(func=cmd_drain)
    sp = with_admin(sub.add_parser("scale", help="pin a model's replica count until the next reload (autoscaling "
                                   "paused); 'auto' unpins"))
    sp.add_argument("model")
    sp.add_argument("replicas", type=cliargs.replicas, help="a count >= 0, or 'auto'")
    sp.set_defaults(func=cmd_scale)
    sp = with_config(sub.add_parser("usage", help="tokens and requests per API key, group, model, day or hour "
                                   "(from the state directory's usage ledger, UTC hours)"))
    sp.add_argument("--since", type=_when, default="7d", help="an age (30m, 24h, 7d, 2w) or a UTC date/time "
                    "(2026-11-01, 2026-11-01T13:00); default 7d")
    sp.add_argument("--until", type=_when, default="now", help="the same forms, the end: an hour it falls inside "
                    "counts whole, one that starts at it does not (--until 2026-11-02 ends with Nov 1); default now")
    sp.add_argument("--by", nargs="+", action="extend", metavar="DIM",
                    type=_dimensions, help="sum by any of key, group, model, day, hour (default: key)")
    fmt = sp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="a JSON list of rows")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header")
    sp.set_defaults(func=cmd_usage)
    batchcli.add_parser(sub, with_config, _load, _config_path)
    sp = with_config(sub.add_parser("demo", help="start the local cluster, serve the embedded fleet, stream one answer"))
    sp.set_defaults(func=cmd_demo)
    sp = sub.add_parser(
        "local-cluster", help="a real SLURM cluster on this host (munge, slurmctld, slurmd x N)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A real SLURM cluster on this host: munged, slurmctld and one slurmd per node, all in one "
                    "directory.\nWorks on Slurm 22.05 (Debian 12) and 24.11 (Debian 13): the release is read from "
                    "`slurmd -V`\n(24.05 and later get a cgroup.conf with CgroupPlugin=disabled).",
        epilog="environment (a flag wins over its variable):\n"
               "  SLURMFLEET_CLUSTER_DIR               the directory (default /tmp/slurmfleet-cluster-UID)\n"
               "  SLURMFLEET_CLUSTER_CTLD_PORT         slurmctld's port (default 16817)\n"
               "  SLURMFLEET_CLUSTER_SLURMD_PORT_BASE  node i's slurmd listens on BASE+i (default 16900)\n"
               "Two clusters share a host when both the directory and the ports differ; give `down` and "
               "`status`\nthe same settings as `up`.")
    sp.add_argument("action", choices=["up", "down", "status"])
    sp.add_argument("--dir", help="state directory (default: $SLURMFLEET_CLUSTER_DIR or /tmp/slurmfleet-cluster-UID)")
    sp.add_argument("--ctld-port", type=int, metavar="PORT",
                    help="slurmctld's port (default: $SLURMFLEET_CLUSTER_CTLD_PORT or 16817)")
    sp.add_argument("--slurmd-port-base", type=int, metavar="BASE",
                    help="node i's slurmd listens on BASE+i (default: $SLURMFLEET_CLUSTER_SLURMD_PORT_BASE or 16900)")
    sp.add_argument("--nodes", type=int, default=4)
    sp.add_argument("--gpus-per-node", type=int, default=4)
    sp.set_defaults(func=cmd_local_cluster)
    return p


def main(argv: list[str] | None = None) -> int:
    import signal
    args = build_parser().parse_args(argv)
    if args.top_config and getattr(args, "config", "") is None:   # (`slurmfleet -c FILE status`: the command's)
        args.config = args.top_config
    if not isinstance(logging.getLevelName(level := args.log_level.upper()), int):
        _fail(f"slurmfleet: --log-level or $SLURMFLEET_LOG_LEVEL: unknown level {args.log_level!r} (one of DEBUG, "
              "INFO, WARNING, ERROR, CRITICAL)", 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = args.cmd in ("validate", "render", "status", "usage")   # `status | head` ends quietly (not the daemon:
    pipe = signal.signal(signal.SIGPIPE, signal.SIG_DFL if quiet else signal.getsignal(signal.SIGPIPE))   # EPIPE)
    try:
        rc = args.func(args)
        if args.cmd not in ("serve", "demo"):
            sys.stdout.flush()   # (here, not at exit: a reader that left is an EPIPE now, caught below)
        return rc
    except KeyboardInterrupt:   # Ctrl-C in a --watch: no traceback
        return 130
    except BrokenPipeError:   # (`slurmfleet scale m 2 | true`: done, its reader gone; nothing more to say)
        if args.cmd in ("serve", "demo"):
            raise
        if sys.stdout is sys.__stdout__:   # (no "Exception ignored" when Python flushes stdout on its way out)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
        return 141
    finally:   # (put back: main() in a process that goes on, the tests, must not die of a closed socket)
        signal.signal(signal.SIGPIPE, pipe)


if __name__ == "__main__":
    sys.exit(main())
