"""A vLLM-compatible simulator: vLLM's OpenAI routes and ``vllm:*`` metrics, with knobs.

Knobs: time to first token, tokens/s, max concurrent sequences (more wait in a
queue, visible in ``vllm:num_requests_waiting``) and faults (refuse
connections, answer 503, hang (a stream after its headers, as vLLM's), die
mid-stream, exit after N seconds).  Faults can also be switched at run time with
``POST /sim/fault``.
SIGTERM is vLLM's shutdown (``simstream``): the requests in flight end with
``finish_reason`` "abort" (after ``--shutdown-timeout`` s, 0 by default), then it
exits; ``POST /sim/fault {"fault": "abort"}`` aborts them the same way and goes on.
Multi-node flags mirror ``vllm serve``: the head listens on ``--master-port``,
headless ranks connect to it, and when a worker is gone the head still says
``/health`` 200 but completions hang, as vLLM does.

Text is made of the deterministic tokens of ``simtokens`` (one per stream chunk),
so a generation resumed from ``prompt_token_ids + token_ids[:k]`` (``prompt`` as
a list of ids, or a chat with ``continue_final_message``) goes on exactly as the
uninterrupted one; ``return_token_ids`` returns the ids where vLLM does.  With a
model directory (positional ``model``) the ids are that model's (``simvocab``).

KV cache: vLLM's prefix cache (``simcache``).  Requests are admitted in the order
of ``--scheduling-policy`` (fcfs, or priority: each request's ``priority``, lower
first; see ``simengine``) when a slot (``--max-num-seqs``) and their blocks are free;
uncached prompt tokens are prefilled at ``--prefill-s-per-token`` each, one prefill
at a time; ``--kv-events-config`` publishes the cache's events as vLLM (``simkvevents``).

Usage as vLLM reports it: in every non-streamed answer; in a stream, a last chunk
(``choices: []``) before ``[DONE]`` only with ``stream_options.include_usage``, and
usage so far in every chunk with ``continuous_usage_stats`` too (both forced by
``--enable-force-include-usage``).  ``vllm:prompt_tokens_total`` and
``vllm:generation_tokens_total`` grow by exactly the usage the requests report (but
with ``n`` choices, each an engine request: the prompt counted once per choice).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import signal
import sys
import time
import uuid

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from orchestrator.devtools import simgen
from orchestrator.devtools.simengine import SimState
from orchestrator.devtools.simkvevents import KVEventPublisher, KVEventsSettings
from orchestrator.devtools.simresponses import Responses
from orchestrator.devtools.simstream import error_response, shut_down

FAULTS = ("none", "refuse", "503", "hang", "die-mid-stream")
ABORT = "abort"  # POST /sim/fault's one-off: the requests in flight are aborted as a SIGTERM does, without exiting
JSON_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/completions/render", "/tokenize", "/detokenize",
                         "/v1/chat/completions/render", "/v1/embeddings", "/v1/responses"})   # (vLLM's that take application/json only)


def build_app(state: SimState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    @web.middleware
    async def guard(request: web.Request, handler):
        if state.fault == "503" and request.path.startswith("/v1/"):
            return error_response(503, "simulated overload", "ServiceUnavailableError")
        if request.path.startswith("/v1/"):
            state.last_headers = {**request.headers, ":path": request.path_qs}  # what arrived, as HTTP/2 names it
        guarded = state.guard_all or request.path.startswith("/v1/") or request.path.startswith("/sim/")
        if state.api_key and guarded:
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                       f"Bearer {state.api_key}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        if request.method == "POST" and request.path in JSON_ROUTES and request.content_type != "application/json":
            # (vLLM's validate_json_request: no Content-Type, */*+json, text/plain)
            return error_response(400, "1 validation error:\n  Unsupported Media Type: Only 'application/json' "
                                  "is allowed", "Bad Request")
        try:
            return await handler(request)
        except web.HTTPClientError as exc:
            if exc is getattr(request.match_info, "http_exception", None):   # no route, or not that method:
                allow = {"Allow": ", ".join(sorted(exc.allowed_methods))} if exc.status == 405 else {}
                return web.json_response({"detail": exc.reason}, status=exc.status, headers=allow)   # FastAPI's
            return error_response(exc.status, exc.reason, exc.reason)   # a handler's: vLLM's http_exception_handler

    app.middlewares.append(guard)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.0-slurmfleet-sim"})

    async def models(_: web.Request) -> web.Response:
        data = [{"id": n, "object": "model", "created": int(state.started), "owned_by": "vllm", "root": n,
                 "parent": None, "max_model_len": state.max_model_len} for n in state.names]
        data += [{"id": n, "object": "model", "created": int(state.started), "owned_by": "vllm", "root": path,
                  "parent": state.names[0], "max_model_len": None} for n, path in state.adapters.items()]   # (vLLM's)
        return web.json_response({"object": "list", "data": data})

    async def metrics(_: web.Request) -> web.Response:
        state._sync()
        return web.Response(body=generate_latest(state.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def set_fault(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("fault") == ABORT:
            return web.json_response({"fault": state.fault, "aborted": state.abort()})
        if body.get("fault") not in FAULTS:
            return error_response(400, f"fault must be one of {(*FAULTS, ABORT)}")
        state.fault = body["fault"]
        return web.json_response({"fault": state.fault})

    async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
        state.inflight += 1   # (a shutdown waits for the answers of the requests in flight)
        try:
            return await simgen.generate(state, request, chat)
        finally:
            state.inflight -= 1

    async def render(request: web.Request, chat: bool | None) -> web.Response:
        """vLLM's render endpoints (what a router asks to learn a request's prompt ids): chat gives one
        GenerateRequest, completions a list of them; ``chat`` None: its /tokenize (a chat with ``messages``)."""
        try:
            body = await request.json()
            kind = ("messages" in body) if chat is None and isinstance(body, dict) else chat
            ids = state.vocab.prompt(body, kind) if isinstance(body, dict) else None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError) as e:
            return error_response(400, str(e) or "invalid JSON body")
        if ids is None:
            return error_response(400, "body must be a JSON object")
        if chat is None:
            return web.json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                                      "token_strs": None})
        out = {"request_id": uuid.uuid4().hex, "token_ids": ids, "token_offsets": None, "features": None}
        return web.json_response(out if chat else [out])

    async def detokenize(request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of token ids (a character left half made ends in U+FFFD, as there)."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, str(e) or "invalid JSON body")
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or any(type(t) is not int or not 0 <= t < state.vocab.size for t in ids):
            return error_response(400, "tokens must be a list of token ids of the model's vocabulary")
        return web.json_response({"prompt": state.vocab.text(ids)})

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3, 0.4]} for i in range(len(inputs))]
        return web.json_response({"object": "list", "data": data, "model": body.get("model"),
                                  "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})

    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", functools.partial(generate, chat=False))
    app.router.add_post("/v1/chat/completions", functools.partial(generate, chat=True))
    app.router.add_post("/v1/chat/completions/render", functools.partial(render, chat=True))
    app.router.add_post("/v1/completions/render", functools.partial(render, chat=False))
    app.router.add_post("/tokenize", functools.partial(render, chat=None))
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/embeddings", embeddings)
    Responses(state).add_routes(app)   # (/v1/responses, and its store: by a response's id)
    app.router.add_post("/sim/fault", set_fault)

    async def last_headers(_: web.Request) -> web.Response:
        return web.json_response(state.last_headers)

    app.router.add_get("/sim/last_headers", last_headers)

    async def last_body(_: web.Request) -> web.Response:  # the last generation request's body, as it arrived
        return web.json_response(state.last_body)

    app.router.add_get("/sim/last_body", last_body)

    async def reset_prefix_cache(_: web.Request) -> web.Response:  # vLLM's (in its dev mode)
        ok = state.cache.reset()
        state.publish()
        return web.json_response({"success": ok})

    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


def lora_module(text: str) -> tuple[str, str]:
    """vllm serve's ``--lora-modules`` item: ``NAME=PATH`` or ``{"name": ..., "path": ...}``."""
    if text.startswith("{"):
        d = json.loads(text)
        return str(d["name"]), str(d["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"Invalid --lora-modules item {text!r}: NAME=PATH")
    return name, path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.devtools.simulator", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="vllm serve's model path: a directory with a tokenizer.json gives "
                   "the prompts' token ids and the vocabulary (else simtokens')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", action="extend")
    p.add_argument("--api-key")
    p.add_argument("--ttft-s", type=float, default=0.05)
    p.add_argument("--tokens-per-s", type=float, default=200.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, help="the context length (default: the model folder's config.json "
                   "max_position_embeddings, as vLLM's, else 4096)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=4096, help="KV-cache blocks (one is vLLM's null)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-events-config", type=KVEventsSettings.from_json, default=KVEventsSettings())
    p.add_argument("--prefill-s-per-token", type=float, default=0.0, help="prefill time of each uncached prompt token")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--enable-force-include-usage", action="store_true", help="usage in every stream, as vLLM's")
    p.add_argument("--enable-prompt-tokens-details", action="store_true", help="as vLLM's: the final usage's "
                   "prompt_tokens_details.cached_tokens (the prompt tokens its prefix cache served)")
    p.add_argument("--sse-keep-alive-interval", type=int, default=0, help="as vLLM's: a stream idle this many "
                   "seconds (queued, prefilling, between tokens) gets a ': keep-alive' comment event (0: never)")
    p.add_argument("--enable-lora", action="store_true", help="serve the --lora-modules adapters, as vLLM's")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, help="NAME=PATH (or vLLM's JSON form) each: "
                   "requests naming one generate as its weights would (their own tokens and cached blocks)")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--exit-after-s", type=float)
    p.add_argument("--shutdown-timeout", type=int, default=0, help="as vLLM's: on SIGTERM the requests in flight "
                   "run for up to this many seconds, then are aborted (0: at once)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--middleware", action="append", default=[], help="as vllm serve's; slurmfleet's RequireSecret "
                   "(orchestrator/fleet/engine_auth.py) is honoured by name")
    args, _unknown = p.parse_known_args(argv)  # accept (and ignore) the rest of vllm serve's flags
    if args.sse_keep_alive_interval < 0:   # vLLM's check, and its exit (1)
        sys.exit("Error: --sse-keep-alive-interval must be a non-negative integer (0 disables keep-alive comments).")
    return args


async def _worker(args: argparse.Namespace) -> int:
    """A headless rank: hold a connection to the head; exit when it goes away."""
    print(f"simulator: headless rank {args.node_rank}/{args.nnodes} master {args.master_addr}:{args.master_port}",
          flush=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            reader, writer = await asyncio.open_connection(args.master_addr, args.master_port)
            break
        except OSError:
            if time.monotonic() > deadline:
                return 1
            await asyncio.sleep(0.5)
    writer.write(f"rank {args.node_rank}\n".encode())
    await writer.drain()
    await reader.read()  # returns when the head closes
    return 1


async def _serve(args: argparse.Namespace) -> int:
    if args.fault == "refuse":
        print("simulator: fault=refuse, not listening", flush=True)
        await asyncio.sleep(3600)
        return 1
    state = SimState(args)
    if args.kv_events_config.active:
        state.publisher = KVEventPublisher(args.kv_events_config)
        print(f"simulator: KV-cache events on {state.publisher.endpoint} (replay "
              f"{state.publisher.replay_endpoint}, topic {args.kv_events_config.topic!r})", flush=True)
    master = None
    if args.nnodes > 1:
        async def on_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            line = await reader.readline()
            print(f"simulator: worker joined: {line.decode().strip()}", flush=True)
            state.workers.add(writer)
            await reader.read()
            state.workers.discard(writer)
            print("simulator: worker lost", flush=True)

        master = await asyncio.start_server(on_worker, "0.0.0.0", args.master_port)
        deadline = time.monotonic() + 120
        while not state.cluster_ok:  # like vLLM: no HTTP until every rank has joined
            if time.monotonic() > deadline:
                return 1
            await asyncio.sleep(0.2)
    # like vLLM's server (its `with_cancellation`): a client that goes away cancels its generation
    runner = web.AppRunner(build_app(state), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"simulator: rank {args.node_rank}/{args.nnodes} serving {state.names} on {args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), args.exit_after_s)
        await shut_down(state, args.shutdown_timeout)   # vLLM's: its requests in flight end "abort"
        rc = 0
    except asyncio.TimeoutError:
        print(f"simulator: exiting after {args.exit_after_s}s (fault knob)", flush=True)
        rc = 3
    if master:
        master.close()
    await runner.cleanup()
    if state.publisher:
        await state.publisher.close()
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    coro = _worker(args) if args.headless else _serve(args)
    return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
