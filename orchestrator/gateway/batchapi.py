"""``/v1/batches``: the OpenAI Batch API's objects, compatible with the ``openai`` SDK (create, retrieve, list,
cancel).  The gateway checks a request and writes the batch's record (:mod:`orchestrator.batches`); the
fleet's batch runner runs it.  A batch belongs to the key that created it: for any other key it does not
exist (404)."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from ..batches import (ACTIVE, DEDICATED_ENDPOINTS, ENDPOINTS, MAX_SHARDS, TERMINAL, WINDOWS_S, BatchStore,
                       ending_otherwise, new_batch, public)
from ..batchfiles import expires_after_s
from ..errors import NO_RETRY, error_response, method_not_allowed, unknown_url
from ..pagination import UnknownCursor
from .endpoints import read_body
from .tenants import Tenant


def _bad(message: str, param: str | None = None, status: int = 400) -> web.Response:
    # (a 409 is the batch's state: the openai SDK would send it again twice)
    return error_response(status, message, "invalid_request_error", "invalid_request",
                          NO_RETRY if status == 409 else None, param)


def _shards_refused(limit: int, running: int, shards: int) -> web.Response | None:
    """A dedicated batch of ``shards`` tasks past its key's ``max_shards`` (``limit``; ``running``: the tasks of
    its unfinished ones): a 400, as OpenAI refuses a batch past a limit on what a key may have enqueued (a 429
    would have the SDK send it again at once); None when it fits."""
    if running + shards <= limit:
        return None
    why = ("this key may not run dedicated batches (SLURM job arrays); ask its operator for max_shards" if not limit
           else f"this key's dedicated batches may have {limit} array tasks in all, not {shards}" if not running else
           f"this key's dedicated batches may have {limit} array tasks in all; its unfinished ones have {running}, "
           f"so {limit - running} more at most, not {shards}")
    return error_response(400, f"metadata.shards: {why}.", "invalid_request_error", "shard_limit_exceeded",
                          param="metadata")


def _missing(batch_id: str) -> web.Response:
    return error_response(404, f"No batch with id '{batch_id}' found.", "invalid_request_error", "not_found")


class BatchApi:
    def __init__(self, store: BatchStore, files, budget_refusal, model_of, shard_limit=lambda owner: MAX_SHARDS):
        self.store, self.files = store, files
        self.shard_limit = shard_limit   # a key's name -> the array tasks its running dedicated batches may have
        self.budget_refusal = budget_refusal   # a key's spent budget: its 429 (see Tenants.budget_refusal)
        self.model_of = model_of   # a served name -> the fleet's ModelConfig now, or None (a reload removed it)

    async def handle(self, request: web.BaseRequest, tenant: Tenant, path: str) -> web.Response:
        parts = [p for p in path[len("/v1/batches"):].strip("/").split("/") if p]   # ("/v1/batches/": the list)
        method = request.method
        if not parts:
            if method == "POST":
                return await self.create(request, tenant)
            if method == "GET":
                return await self.list(request, tenant)
            return method_not_allowed(method, path, "GET, POST")
        # (the record, its marker and lock are files of the state dir, shared with the nodes: read in a thread, as a
        # stalled NFS or Lustre mount would stall the event loop, every client of this gateway process with it)
        if len(parts) == 1 and method == "GET":
            return await asyncio.to_thread(self.retrieve, parts[0], tenant)
        if len(parts) == 2 and parts[1] == "cancel" and method == "POST":
            return await asyncio.to_thread(self.cancel, parts[0], tenant)
        if len(parts) == 1 or len(parts) == 2 and parts[1] == "cancel":   # a route, not this method
            allow = "GET" if len(parts) == 1 else "POST"
            return method_not_allowed(method, path, allow)
        return unknown_url(method, path)

    async def create(self, request: web.BaseRequest, tenant: Tenant) -> web.Response:
        raw = await read_body(request, request.client_max_size)   # (too large: the JSON 413 of every endpoint)
        if isinstance(raw, web.Response):
            return raw
        try:
            body = orjson.loads(raw)
        except ValueError as exc:
            return _bad(f"Malformed JSON body: {exc}")
        if not isinstance(body, dict):
            return _bad("The JSON body must be an object.")
        unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
        if unknown:
            return _bad(f"Unknown parameter: {sorted(unknown)[0]}.", sorted(unknown)[0])
        endpoint, window, meta = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
        if endpoint not in ENDPOINTS:
            return _bad(f"endpoint must be one of {', '.join(ENDPOINTS)}.", "endpoint")
        if not isinstance(window, str) or window not in WINDOWS_S:
            return _bad(f"completion_window must be one of {', '.join(WINDOWS_S)}.", "completion_window")
        if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items())):
            return _bad("metadata: at most 16 string keys (64 characters) with string values (512).", "metadata")
        expires = body.get("output_expires_after")
        if expires is not None:
            try:
                expires = expires_after_s(expires, "output_expires_after")
            except ValueError as exc:
                return _bad(str(exc), "output_expires_after")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            return _bad("input_file_id is required: the id of an uploaded file of purpose 'batch'.", "input_file_id")
        info = await asyncio.to_thread(self.files.get, file_id, tenant.name)   # (the state dir: off the loop)
        if info is None:
            return _bad(f"No file with id '{file_id}' found.", "input_file_id", 404)
        if info.get("purpose") != "batch":
            return _bad(f"File '{file_id}' has purpose '{info.get('purpose')}', not 'batch'.", "input_file_id")
        if info.get("endpoint") != endpoint:
            return _bad(f"The requests of file '{file_id}' are for {info.get('endpoint')}, not {endpoint}.",
                        "endpoint")
        models = list(info.get("models") or ())
        if len(models) > 1:   # (OpenAI's rule: the runner runs, tunes and counts a batch as one model's)
            return _bad(f"The requests of file '{file_id}' use {len(models)} models ({', '.join(models)}); a batch "
                        f"runs one model: upload one file per model.", "input_file_id")
        # the key lost the model since the upload, or a reload removed it: as its own requests would be, refused
        denied = [m for m in models if tenant.models is not None and m not in tenant.models or self.model_of(m) is None]
        if denied:
            return _bad(f"The model `{denied[0]}` of file '{file_id}' does not exist or you do not have access "
                        f"to it.", "input_file_id", 404)
        spent = self.budget_refusal(tenant)
        if spent is not None:   # its lines would only wait for the next period
            return spent
        shards = (meta or {}).get("shards")
        if shards is not None:   # dedicated mode: vllm run-batch of one model in a job array
            if not (isinstance(shards, str) and shards.isascii() and shards.isdigit()
                    and 1 <= int(shards) <= MAX_SHARDS):
                return _bad(f"metadata.shards: the number of SLURM array tasks of a dedicated batch, 1-{MAX_SHARDS}.",
                            "metadata")
            if endpoint not in DEDICATED_ENDPOINTS:
                return _bad(f"metadata.shards: a dedicated batch runs vllm run-batch, which serves "
                            f"{' and '.join(DEDICATED_ENDPOINTS)}, not {endpoint}.", "metadata")
            if len(info.get("models") or ()) != 1:
                return _bad(f"metadata.shards: a dedicated batch runs one model; file '{file_id}' uses "
                            f"{len(info.get('models') or ())}.", "metadata")
            if (nodes := self.model_of(models[0]).nodes) != 1:   # (its array's tasks run on one node each)
                return _bad(f"metadata.shards: a dedicated batch's tasks run on one node each; `{models[0]}` runs "
                            f"on {nodes}.", "metadata")
        rec = new_batch(tenant.name, file_id, endpoint, window, meta, int(info.get("lines") or 0),
                        list(info.get("models") or ()))
        if shards is not None:
            rec["shards"] = int(shards)   # dedicated mode: its own job array (orchestrator.fleet.batcharray)
        if expires is not None:
            rec["output_expires_after_s"] = expires   # its output and error files expire this long after theirs

        def save_if_there() -> web.Response | None:
            with self.files.inputs_lock():   # (every process's creates, one at a time: the shards counted hold)
                if self.files.get(file_id, tenant.name) is None:   # (deleted or expired since the look above)
                    return _bad(f"No file with id '{file_id}' found.", "input_file_id", 404)
                if shards is not None:
                    running = sum(int(r.get("shards") or 0) for r in self.store.all()
                                  if r.get("owner") == tenant.name and r.get("status") not in TERMINAL)
                    if (refused := _shards_refused(self.shard_limit(tenant.name), running, int(shards))) is not None:
                        return refused
                self.store.save(rec)
                return None
        refused = await asyncio.to_thread(save_if_there)
        return refused if refused is not None else web.json_response(public(rec))

    async def list(self, request: web.BaseRequest, tenant: Tenant) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            return _bad("limit must be an integer.", "limit")
        if not 1 <= limit <= 100:   # (as the files list: a clear 400, not a quiet clamp)
            return _bad("limit must be between 1 and 100.", "limit")
        try:
            # (off the event loop: it reads every batch record of the state dir, all keys' history)
            page, more = await asyncio.to_thread(self.store.list, tenant.name, limit, request.query.get("after"))
        except UnknownCursor as e:
            return _bad(str(e), "after")
        data = [self._public(r) for r in page]
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": more})

    def retrieve(self, batch_id: str, tenant: Tenant) -> web.Response:
        rec = self.store.get(batch_id, tenant.name)
        return web.json_response(self._public(rec)) if rec else _missing(batch_id)

    def cancel(self, batch_id: str, tenant: Tenant) -> web.Response:
        if self.store.get(batch_id, tenant.name) is None:
            return _missing(batch_id)
        with self.store.deciding(batch_id):   # (its runner decides its end under the same lock: see deciding)
            rec = self.store.get(batch_id, tenant.name)
            if rec is None:   # (removed meanwhile: its retention)
                return _missing(batch_id)
            if rec["status"] not in ACTIVE or rec["status"] == "finalizing":   # (finalizing: its lines are all done)
                return _bad(f"Cannot cancel a batch with status '{rec['status']}'.", status=409)
            if ending_otherwise(rec):   # (its end decided, not yet shown: expired, failed)
                return _bad(f"Cannot cancel a batch that is ending ({rec.get('ending') or 'expired'}).", status=409)
            self.store.request_cancel(batch_id)   # the runner stops it within a second and writes what was done
        return web.json_response(self._public(rec))

    def _public(self, rec: dict) -> dict:
        """What a client sees of a batch: one whose cancel was asked is ``cancelling`` from the cancel's answer
        on, though its runner has not seen the marker yet (never an earlier status after that answer)."""
        out = public(rec)
        if rec["status"] in ("validating", "in_progress") and not ending_otherwise(rec) and (
                asked := self.store.cancel_requested(rec["id"])):
            out.update(status="cancelling", cancelling_at=asked)
        return out
