"""The gateway's own endpoints, beside the proxied ``/v1`` generations: the model list, health and
readiness, and the Files and Batch APIs (loaded by their first request)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from ..errors import error_response

if TYPE_CHECKING:
    from .server import Gateway


# vLLM's /v1 paths that change a replica for everyone (runtime LoRA loading, when an operator allows it): never
# a client's to call through the gateway, which would add the job's secret
ENGINE_ONLY = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
CONTROL = re.compile(r"[\x00-\x1f\x7f]")   # refused in a decoded path: "/v1/load_lora_adapter\n" matched the
# engine's route (Python's `$` matches before a trailing newline) while it passed the gateway's as another path


def canonical(path: str) -> str:
    """``path`` with its dot segments resolved, empty segments and a trailing slash dropped."""
    if "//" not in path and "/." not in path and not path.endswith("/"):
        return path
    out: list[str] = []
    for seg in path.split("/"):
        if seg == "..":
            if out:
                out.pop()
        elif seg not in ("", "."):
            out.append(seg)
    return "/" + "/".join(out)


def served_here(path: str) -> bool:
    """Whether a request for the decoded ``path`` is the gateway's own, not proxied: outside ``/v1``, the model
    list, the Files and Batch APIs, the engine-only paths (however spelled) and paths with control characters."""
    return (not path.startswith("/v1/") or path.startswith("/v1/models") and (len(path) == 10 or path[10] == "/")
            or path.startswith("/v1/files") and (len(path) == 9 or path[9] == "/")
            or path.startswith("/v1/batches") and (len(path) == 11 or path[11] == "/")
            or CONTROL.search(path) is not None or canonical(path) in ENGINE_ONLY)


async def other(gw: "Gateway", request: web.BaseRequest, path: str) -> web.StreamResponse:
    method = request.method
    if CONTROL.search(path) is not None:
        return error_response(400, "The request path contains a control character.", "invalid_request_error",
                              "invalid_path")
    if path.startswith("/v1/files"):
        from .files import FilesApi   # the Files API: loaded by the first upload or listing
        return await FilesApi(gw).handle(request, path)
    if path.startswith("/v1/batches"):
        from ..batches import BatchStore
        from ..batchfiles import FileStore
        from .batchapi import BatchApi
        tenant = gw.tenants.identify(request.headers)
        if tenant is None:
            return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
        root = Path(gw.cfg.state_dir)
        return await BatchApi(BatchStore(root / "batches"), FileStore(root / "files"),
                              gw.tenants.budget_refusal).handle(request, tenant, path)
    if path.startswith("/v1/models"):
        if method != "GET":
            return error_response(405, f"Method {method} not allowed on {path}.", "invalid_request_error",
                                  "method_not_allowed", {"Allow": "GET"})
        return await (list_models(gw, request) if path == "/v1/models" else
                      get_model(gw, request, path[len("/v1/models/"):]))
    if path in ("/healthz", "/readyz"):
        if method not in ("GET", "HEAD"):
            return error_response(405, f"Method {method} not allowed on {path}.", "invalid_request_error",
                                  "method_not_allowed", {"Allow": "GET"})
        return await (healthz(gw, request) if path == "/healthz" else readyz(gw, request))
    return error_response(404, f"No route for {method} {path}.", "invalid_request_error", "not_found")


async def healthz(gw: "Gateway", _: web.BaseRequest) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(gw: "Gateway", request: web.BaseRequest | None) -> web.Response:
    """Ready when every model the fleet wants replicas of (the routing table's desired count, the same
    number the reconciler works toward) has one READY.  The models that have none are named only to a key
    that may use them (any client of an open gateway, as its model list): a health checker needs the status
    code, and without a key the names told anyone which models exist (``/admin/status`` has them all)."""
    missing = [name for name, p in gw.pools.pools.items() if p.desired > 0 and not p.slots]
    if gw.shutting_down or missing:
        out = {"status": "not ready", "shutting_down": gw.shutting_down}
        t = gw.tenants.identify(request.headers) if request is not None else None
        if t is not None:
            out["models_without_ready_replica"] = [n for n in missing if t.models is None or n in t.models]
        return web.json_response(out, status=503)
    return web.json_response({"status": "ready"})


async def list_models(gw: "Gateway", request: web.BaseRequest) -> web.Response:
    t = gw.tenants.identify(request.headers)
    if t is None:
        return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "slurmfleet", "root": name}
            for n, name in gw.pools.names.items() if t.models is None or name in t.models]
    return web.json_response({"object": "list", "data": data})


async def get_model(gw: "Gateway", request: web.BaseRequest, name: str) -> web.Response:
    t = gw.tenants.identify(request.headers)
    if t is None:
        return error_response(401, "Invalid or missing API key.", "invalid_request_error", "invalid_api_key")
    pool = gw.pools.resolve(name)
    if pool is None or t.models is not None and pool.model.name not in t.models:
        return error_response(404, f"The model `{name}` does not exist or you do not have access to it.",
                              "invalid_request_error", "model_not_found")
    return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "slurmfleet",
                              "root": pool.model.name})
