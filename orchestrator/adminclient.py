"""The CLI's client of the daemon's admin API (``status``, ``reload``, ``drain``, ``scale``): which key it sends,
and what it says when the daemon cannot be reached or refuses it."""

from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from typing import NoReturn

from .config import FleetConfig
from .configchecks import dial_host
from .tlsfiles import client_context
from .statedir import StateDir


def fail(message: str, code: int = 1) -> NoReturn:
    print(message, file=sys.stderr)
    raise SystemExit(code)


def daemon_config(config_path: str) -> FleetConfig:
    """The fleet file as the admin commands read it: whole, or, when it does not validate (an edit its daemon
    refused: the daemon runs on its last good file), only what reaches the daemon (``fleet``, ``state_dir``,
    ``daemon``, ``cluster.command_timeout_s``), with a warning; exits (2) with the problems when even those do
    not validate."""
    from pydantic import ValidationError

    from .fleetfile import parse_config
    from .yamlsrc import ConfigError, load_file
    try:
        src = load_file(config_path)   # (read once: its problems, then its parts)
    except ConfigError as exc:
        fail("\n".join(map(str, exc.problems)), 2)
    try:
        return parse_config(src)
    except ConfigError as exc:
        problems = exc.problems
    try:
        data = src.data
        part = {k: data[k] for k in ("fleet", "state_dir", "daemon") if k in data}
        if isinstance(data.get("cluster"), dict) and "command_timeout_s" in data["cluster"]:
            part["cluster"] = {"command_timeout_s": data["cluster"]["command_timeout_s"]}
        cfg = FleetConfig.model_validate(part)
    except (ValidationError, TypeError, AttributeError):   # (a file that is no mapping)
        fail("\n".join(map(str, problems)), 2)
    print(f"warning: {config_path} does not validate ({len(problems)} problem(s): `slurmfleet validate "
          f"{config_path}`); reaching its daemon with the file's fleet, state_dir and daemon settings",
          file=sys.stderr)
    return cfg


def admin_key(cfg: FleetConfig, config_path: str) -> str:
    """As the daemon takes it (fleet.admin.ensure_admin_key): $SLURMFLEET_ADMIN_KEY, else the first configured
    key that is not a ``sha256:`` digest, else (none configured) the generated <state_dir>/admin.key."""
    if key := os.environ.get("SLURMFLEET_ADMIN_KEY"):
        return key
    if cfg.daemon.admin_api_keys:
        key = next((k for k in cfg.daemon.admin_api_keys if not k.startswith("sha256:")), None)
        return key if key is not None else fail(f"daemon.admin_api_keys in {config_path} holds only sha256: "
                                                "digests, which cannot be sent: set SLURMFLEET_ADMIN_KEY", 2)
    keyfile = StateDir(cfg.state_dir).admin_key
    try:
        return keyfile.read_text().strip()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        fail(f"cannot read the admin key {keyfile}: {exc.strerror or exc}")


def call(cfg: FleetConfig, config_path: str, admin_url: str | None, method: str, path: str,
         body: dict | None = None) -> tuple[int, dict]:
    """``method path`` on the fleet's admin API: (HTTP status, its JSON object); exits (1) with a message that
    says what to do when the daemon cannot be reached, answers no JSON, or refuses the key."""
    # (a reload shows changed jobs to SLURM first: twice the sbatch timeout at most)
    # (a scale: a reload being applied for 5 s at most, then its pins' fsync for the command timeout at most)
    wait_s = {"/admin/reload": 2 * cfg.cluster.command_timeout_s + 10,
              "/admin/scale": cfg.cluster.command_timeout_s + 15}.get(path, 10)
    key = admin_key(cfg, config_path)
    if not (key.isascii() and key.isprintable()):   # (urllib cannot send it: "cannot reach the daemon" misled)
        fail("the admin key ($SLURMFLEET_ADMIN_KEY, or the key file) must be printable ASCII")
    tls = client_context(cfg.gateway) if cfg.daemon.admin_tls else None   # (its own certificate trusted)
    url = (admin_url or f"{'https' if tls else 'http'}://{dial_host(cfg.daemon.admin_host)}:{cfg.daemon.admin_port}"
           ).rstrip("/")
    try:
        req = urllib.request.Request(url + path, method=method, headers={"Authorization": f"Bearer {key}",
                                                                        "Content-Type": "application/json"},
                                     data=json.dumps(body).encode() if body is not None else None)
    except ValueError as exc:   # (--admin-url foo)
        fail(f"--admin-url {url!r} is no URL: {exc}")
    try:
        try:
            with urllib.request.urlopen(req, timeout=wait_s, context=tls) as r:
                code, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            code, raw = e.code, e.read()
    except (OSError, http.client.HTTPException, ValueError) as e:   # refused, a timeout, a broken answer
        why = getattr(e, "reason", e)
        fail(f"cannot reach the daemon at {url}: " + (f"no answer within {wait_s:.0f}s" if isinstance(
            why, TimeoutError) else str(why) or type(why).__name__) + (reload_hint(cfg, config_path, path) or (
                "" if admin_url else f" (daemon.admin_host/admin_port of {config_path}: is its daemon running, "
                                     f"`slurmfleet serve -c {config_path}`? Another fleet's file: -c FILE)")))
    try:
        res = json.loads(raw or b"{}")
    except ValueError:
        res = None
    if not isinstance(res, dict):   # a text 404, a proxy's HTML page
        fail(f"the admin API at {url} answered HTTP {code} with no JSON object: "
             f"{raw[:200].decode('utf-8', 'replace').strip()!r}")
    if code == 401:   # (another fleet's daemon on that port, or this state_dir's key not readable here)
        src = ("$SLURMFLEET_ADMIN_KEY" if os.environ.get("SLURMFLEET_ADMIN_KEY") else "daemon.admin_api_keys"
               if cfg.daemon.admin_api_keys else f"{StateDir(cfg.state_dir).admin_key}" + ("" if key else " (none)"))
        fail(f"the daemon at {url} refused the admin key from {src}: is it the daemon of fleet {cfg.fleet!r} "
             f"({config_path})? Name the fleet's file with -c, or set SLURMFLEET_ADMIN_KEY"
             + reload_hint(cfg, config_path, path))
    return code, res


def reload_hint(cfg: FleetConfig, config_path: str, path: str) -> str:
    """A reload whose file changed the admin port or keys finds the daemon on its old ones: SIGHUP reaches it."""
    return "" if path != "/admin/reload" else (
        f". If {config_path} changed daemon.admin_port or admin_api_keys since the daemon started, it still "
        f"has the old ones: `kill -HUP $(cat {StateDir(cfg.state_dir).root / 'daemon.lock'})` reloads it")
