"""The daemon's small authenticated admin API (and ``/metrics``)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..config import MAX_REPLICAS as MAX_PIN
from ..observability.metrics import Metrics
from ..auth import KeySet
from ..errors import error_response
from ..statedir import StateDir

log = logging.getLogger(__name__)


def ensure_admin_key(state: StateDir, configured: list[str], env_key: str | None) -> list[str]:
    """The admin keys; with none configured, one is generated into ``<state_dir>/admin.key`` (0600)."""
    keys = list(configured) + ([env_key] if env_key else [])
    if keys:
        return keys
    path = state.admin_key
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or not path.read_text().strip():   # (written whole: a crash never leaves it empty)
        state.write_private(path, secrets.token_urlsafe(32) + "\n")
    return [path.read_text().strip()]


class Admin:
    def __init__(self, keys: list[str], metrics: Metrics, *, status: Callable[[], dict],
                 reload: Callable[[], Awaitable[dict]], drain: Callable[[str, bool], Awaitable[str | None]],
                 scale: Callable[[str, int | None], Awaitable[str]], metrics_keys: list[str] = (), tls=None):
        self.tls = tls   # (its HTTPS: a ServerTls, with daemon.admin_tls)
        self.keys = KeySet(keys)
        self.metrics_keys = KeySet(list(metrics_keys))   # empty: /metrics open
        self.metrics = metrics
        self._status, self._reload, self._drain, self._scale = status, reload, drain, scale

    def reload_tls(self, gw) -> None:
        """A reload: the certificate of its HTTPS (``daemon.admin_tls``) loaded again."""
        if self.tls is not None:
            self.tls.reload(gw)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/admin/status", self.status)
        app.router.add_post("/admin/reload", self.reload)
        app.router.add_post("/admin/drain/{job_id}", self.drain)
        app.router.add_post("/admin/scale", self.scale)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path.startswith("/admin/") and not self.keys.check(request.headers):
            return error_response(401, "Invalid or missing admin key.", "invalid_request_error", "invalid_api_key")
        if request.path == "/metrics" and self.metrics_keys.enabled and not (
                self.metrics_keys.check(request.headers) or self.keys.check(request.headers)):
            return error_response(401, "Invalid or missing key: /metrics takes a key of daemon.metrics_api_keys "
                                  "or an admin key.", "invalid_request_error", "invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as exc:   # aiohttp's own answers (no such path, a wrong method): OpenAI's shape
            if exc.status < 400:
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}.",
                                  "invalid_request_error", "not_found" if exc.status == 404 else
                                  "method_not_allowed" if exc.status == 405 else None, allow)

    async def metrics_handler(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, _: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def reload(self, _: web.Request) -> web.Response:
        result = await self._reload()
        return web.json_response(result, status=200 if result.get("ok") else 422)

    async def drain(self, request: web.Request) -> web.Response:
        """Drain a replica now, or with ``{"replace": true}`` once a successor serves (a handover)."""
        jid = request.match_info["job_id"]
        try:
            body = await request.json() if request.can_read_body else {}
            replace = body.get("replace", False)
            if not isinstance(replace, bool):
                raise ValueError("`replace` must be a boolean")
        except (ValueError, AttributeError) as exc:
            return error_response(400, f"Body must be empty or {{'replace': true|false}}: {exc}",
                                  "invalid_request_error")
        log.info("admin: %s of job %s asked from %s", "drain --replace" if replace else "drain", jid, request.remote)
        done = await self._drain(jid, replace)
        if done is None:
            return error_response(404, f"No replica with job id {jid}.", "invalid_request_error", "not_found")
        return web.json_response({"ok": True, "job_id": jid, "draining": done == "draining",
                                  "replacing": done == "replacing"})

    async def scale(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            model, n = body["model"], body["replicas"]
            if n != "auto" and (type(n) is not int or not 0 <= n <= MAX_PIN):   # "auto": unpin (the autoscaler
                raise ValueError(f"replicas must be a whole number from 0 to {MAX_PIN}")   # or the file decides)
            n = None if n == "auto" else n
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"Body must be {{'model': NAME, 'replicas': 0..{MAX_PIN} or \"auto\"}}: {exc}",
                                  "invalid_request_error")
        log.info("admin: scale %s to %s asked from %s", model, "auto" if n is None else n, request.remote)
        try:
            model = await self._scale(model, n)   # (an alias: the model's served name)
        except KeyError:
            return error_response(404, f"The model `{model}` is not in the fleet.", "invalid_request_error",
                                  "model_not_found")
        except TimeoutError:   # (a reload being applied, waiting on SLURM's test submissions)
            return error_response(503, "A reload is being applied: retry the scale in a moment.", "server_error",
                                  "reload_in_progress", {"Retry-After": "5"})
        except OSError as exc:   # the pin is written to the state dir before it holds: nothing changed
            return error_response(500, f"The pin could not be saved and does not hold: {exc}", "server_error",
                                  "state_dir_unwritable")
        return web.json_response({"ok": True, "model": model, "replicas": n})
