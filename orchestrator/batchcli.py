"""``slurmfleet batch``: submit a JSONL file as a batch, watch it, list, cancel, fetch the results.  A client of
the gateway's ``/v1/files`` and ``/v1/batches`` (the same API the ``openai`` SDK uses), with the key in
``--api-key`` (seen in ``ps``), ``--api-key-file``, ``$SLURMFLEET_API_KEY`` or ``$OPENAI_API_KEY``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl as ssl_
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from . import cliargs
from .config import FleetConfig
from .configchecks import dial_host
from .tlsfiles import client_context, scheme

TERMINAL = {"failed", "completed", "expired", "cancelled"}


class ApiError(Exception):
    pass


READ_TIMEOUT_S = 120.0   # a gateway that accepts the connection and then says nothing for this long has failed


class Client:
    def __init__(self, base: str, key: str | None, ssl: ssl_.SSLContext | None = None):
        self.base = base.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.ssl = ssl if ssl is not None else True   # (aiohttp's default: the system's CAs)

    def unreachable(self, exc: BaseException) -> ApiError:
        """The gateway not there, or silent: said as such (aiohttp's words named ssl on plain HTTP)."""
        if isinstance(exc, aiohttp.ClientConnectorError):
            return ApiError(f"cannot reach the gateway at {self.base} ({exc.os_error.strerror or exc.os_error}): is "
                            "the daemon running (`slurmfleet serve`), and is --url or the config's gateway right?")
        return ApiError(f"the gateway at {self.base} did not answer in {READ_TIMEOUT_S:.0f}s")

    async def call(self, method: str, path: str, **kw) -> dict:
        try:
            return await self._call(method, path, **kw)
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as exc:
            raise self.unreachable(exc) from None

    async def _call(self, method: str, path: str, **kw) -> dict:
        # (no total: an upload takes as long as it takes while it moves)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=READ_TIMEOUT_S)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout) as s:
            async with s.request(method, self.base + path, ssl=self.ssl, **kw) as r:
                text = await r.text()
                try:
                    body = json.loads(text)
                except ValueError:
                    body = {"error": {"message": text[:500]}}
                if r.status >= 400:   # (a proxy's error may be any JSON: its text then)
                    err = body.get("error") if isinstance(body, dict) else None
                    raise ApiError(f"{r.status}: {err.get('message', text[:500]) if isinstance(err, dict) else text[:500]}")
                return body

    async def download(self, file_id: str, out: Path) -> int:
        """Append the file's content to ``out``: as long as it takes while bytes keep coming."""
        n = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
        async with aiohttp.ClientSession(headers=self.headers, timeout=timeout) as s:
            async with s.get(f"{self.base}/v1/files/{file_id}/content", ssl=self.ssl) as r:
                if r.status >= 400:
                    raise ApiError(f"{r.status}: {(await r.text())[:500]}")
                with open(out, "ab") as f:
                    async for chunk in r.content.iter_chunked(1 << 16):
                        f.write(chunk)
                        n += len(chunk)
        return n


def with_model(src: Path, model: str | None, shards: int | None) -> Path:
    """The input with ``model`` filled into every line's body (when given); streamed to a temporary file, removed
    again when a line is no JSON (ApiError naming the line)."""
    if not model:
        return src
    fd, name = tempfile.mkstemp(prefix="slurmfleet-batch-", suffix=".jsonl")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as fout, open(src, "rb") as fin:
            for n, raw in enumerate(fin, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError as exc:
                    raise ApiError(f"{src}: line {n} is no JSON ({exc})") from None
                if isinstance(obj, dict) and isinstance(obj.get("body"), dict):
                    obj["body"]["model"] = model
                fout.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def endpoint_of(path: Path) -> str:
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                line = json.loads(raw)
                return line.get("url", "/v1/chat/completions") if isinstance(line, dict) else "/v1/chat/completions"
    raise ApiError(f"{path} is empty")


async def submit(c: Client, args) -> dict:
    path = with_model(Path(args.file), args.model, args.shards)
    try:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        with open(path, "rb") as f:
            form.add_field("file", f, filename=Path(args.file).name, content_type="application/jsonl")
            up = await c.call("POST", "/v1/files", data=form)
        meta = {"shards": str(args.shards)} if args.shards else None
        return await c.call("POST", "/v1/batches", json={"input_file_id": up["id"], "endpoint": endpoint_of(path),
                                                          "completion_window": "24h", "metadata": meta})
    finally:
        if path != Path(args.file):
            path.unlink(missing_ok=True)


def line(b: dict) -> str:
    rc = b.get("request_counts") or {}
    return (f"{b['id']}  {b['status']:<11}  {rc.get('completed', 0)}/{rc.get('total', 0)} done, "
            f"{rc.get('failed', 0)} failed  {b['endpoint']}")


def shard_state(s: dict) -> str:
    return f"{s['state']} ({s['reason']})" if s.get("reason") else s["state"]


def shard_lines(b: dict) -> list[str]:
    """A dedicated batch's job array, one line per shard: state (SLURM's pending reason), task, node, lines."""
    slurm = b.get("slurm")
    if not slurm:
        return []
    out = [f"job array {slurm.get('job_id') or '(not submitted yet)'} ({slurm.get('job_name')})"]
    if slurm.get("blocked"):
        out.append(f"  blocked: {slurm['blocked']}")
    if slurm.get("held"):
        out.append(f"  held: {slurm['held']}")
    if slurm.get("waiting"):
        out.append(f"  waiting: {slurm['waiting']}")
    for s in slurm.get("shards") or ():
        retries = f"  {s['retries']} retr{'y' if s['retries'] == 1 else 'ies'}" if s.get("retries") else ""
        if s.get("errors"):
            retries = f" ({s['errors']} answered with an error)" + retries
        out.append(f"  shard {s['shard']:>3}  {shard_state(s):<28} {s.get('job') or '-':<12} {s.get('node') or '-':<10}"
                   f" {s['done']}/{s['lines']}{retries}")
    return out


async def watch(c: Client, batch_id: str, interval_s: float, out: Callable[[dict], None],
                stderr: bool = False) -> dict:
    """A progress bar (on stderr with ``stderr``: stdout keeps only the JSON of ``--json``) until the batch ends;
    a dedicated batch's shards get a bar each (the first 32)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[st]}"),
                  TimeElapsedColumn(), transient=False, console=Console(stderr=stderr)) as bar:
        task = None
        shards: dict[int, int] = {}
        while True:
            b = await c.call("GET", f"/v1/batches/{batch_id}")
            rc = b.get("request_counts") or {}
            total = rc.get("total") or 0
            if task is None:
                task = bar.add_task(batch_id, total=total, st="")
            bar.update(task, total=total, completed=rc.get("completed", 0) + rc.get("failed", 0),
                       st=f"{b['status']} ({rc.get('failed', 0)} failed)")
            for s in ((b.get("slurm") or {}).get("shards") or ())[:32]:
                if s["shard"] not in shards:
                    shards[s["shard"]] = bar.add_task(f"  shard {s['shard']}", total=s["lines"], st="")
                bar.update(shards[s["shard"]], total=s["lines"], completed=s["done"],
                           st=f"{shard_state(s)} {s.get('job') or ''}")
            if b["status"] in TERMINAL:
                return b
            await asyncio.sleep(interval_s)


def readable(path: str) -> str:
    """An argument naming a file this user can read (argparse's usage error otherwise)."""
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {path}")
    return path


def key_file(path: str | None) -> str | None:
    """The client key in ``path`` (its first line, stripped), or None."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.readline().strip() or None


def cmd_batch(args: argparse.Namespace, load: Callable[[str], FleetConfig], config_path: str) -> int:
    cfg = load(config_path)
    host = dial_host(cfg.gateway.host)
    key = args.api_key or key_file(getattr(args, "api_key_file", None)) or os.environ.get("SLURMFLEET_API_KEY") or os.environ.get(
        "OPENAI_API_KEY")
    c = Client(args.url or f"{scheme(cfg.gateway)}://{host}:{cfg.gateway.port}", key,
               client_context(cfg.gateway) if not args.url else None)   # (its own gateway: its own certificate)
    try:
        if args.batch_cmd == "submit":
            b = asyncio.run(submit(c, args))
            print(b["id"])
            if args.watch:
                b = asyncio.run(watch(c, b["id"], 1.0, print))
                print(line(b))
        elif args.batch_cmd == "status":
            b = asyncio.run(watch(c, args.id, 1.0, print, stderr=args.json)) if args.watch else asyncio.run(
                c.call("GET", f"/v1/batches/{args.id}"))
            print(json.dumps(b, indent=2) if args.json else "\n".join([line(b), *shard_lines(b)]))
        elif args.batch_cmd == "list":
            page = asyncio.run(c.call("GET", "/v1/batches", params={"limit": str(args.limit)}))
            if args.json:
                print(json.dumps(page["data"], indent=2))
            for b in [] if args.json else page["data"]:
                print(line(b) + "  " + time.strftime("%Y-%m-%d %H:%M", time.gmtime(b["created_at"])))
        elif args.batch_cmd == "cancel":
            print(line(asyncio.run(c.call("POST", f"/v1/batches/{args.id}/cancel"))))
        elif args.batch_cmd == "results":
            b = asyncio.run(c.call("GET", f"/v1/batches/{args.id}"))
            files = [f for f in (b.get("output_file_id"), b.get("error_file_id") if args.errors else None) if f]
            if not files:
                print(f"{args.id} has no output{' or errors' if args.errors else ''} yet ({b['status']})",
                      file=sys.stderr)
                return 1
            if not b.get("output_file_id"):
                print(f"{args.id} has no output file, only errors ({b['status']})", file=sys.stderr)
            out = Path(args.output)
            part = out.with_name(out.name + ".part")   # (the output file appears whole, or not at all)
            try:
                part.write_bytes(b"")
                for fid in files:
                    asyncio.run(c.download(fid, part))
                os.replace(part, out)
            finally:
                part.unlink(missing_ok=True)
            print(f"{out}: {sum(1 for _ in open(out, 'rb'))} lines ({b['status']})")
    except (ApiError, aiohttp.ClientError, OSError, ValueError) as exc:
        print(f"slurmfleet batch {args.batch_cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub, with_config: Callable, load: Callable[[str], FleetConfig], config_path: Callable) -> None:
    sp = with_config(sub.add_parser("batch", help="OpenAI batches on the fleet: submit, status, list, cancel, results"))
    sp.add_argument("--api-key", help="client key (default $SLURMFLEET_API_KEY or $OPENAI_API_KEY); on a shared login "
                    "node any user sees it in `ps`: prefer the variables or --api-key-file")
    sp.add_argument("--api-key-file", type=readable, help="a file holding the client key (its first line)")
    sp.add_argument("--url", help="the gateway (default: the config's gateway host and port)")
    sub_add = sp.add_subparsers(dest="batch_cmd", required=True).add_parser

    def add_batch_cmd(name: str, **kw) -> argparse.ArgumentParser:
        """A subcommand that takes -c/--config, --api-key and --url after its name too (as every other command
        takes them); left out there, they keep what was given before it."""
        p = sub_add(name, **kw)
        for flags in (("--config", "-c"), ("--api-key",), ("--api-key-file",), ("--url",)):
            p.add_argument(*flags, default=argparse.SUPPRESS, help="as before the subcommand",
                           **({"type": readable} if flags == ("--api-key-file",) else {}))
        return p

    p = add_batch_cmd("submit", help="upload a JSONL file of requests and start a batch")
    p.add_argument("file")
    p.add_argument("--model", help="set every line's body.model")
    p.add_argument("--shards", type=cliargs.shards, help="run as a SLURM job array of this many shards (dedicated mode)")
    p.add_argument("--watch", action="store_true", help="show progress until it ends")
    p = add_batch_cmd("status", help="a batch's state and counts")
    p.add_argument("id")
    p.add_argument("--watch", action="store_true", help="a progress bar until it ends")
    p.add_argument("--json", action="store_true")
    p = add_batch_cmd("list", help="your batches, newest first")
    p.add_argument("--limit", type=cliargs.list_limit, default=20, metavar="1-100")
    p.add_argument("--json", action="store_true")
    p = add_batch_cmd("cancel", help="cancel a batch (what was done stays in its output)")
    p.add_argument("id")
    p = add_batch_cmd("results", help="download a batch's output")
    p.add_argument("id")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--errors", action="store_true", help="append the error file's lines too")
    sp.set_defaults(func=lambda a: cmd_batch(a, load, config_path(a)))
