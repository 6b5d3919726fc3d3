"""``/v1/files``: the OpenAI Files API on the gateway, compatible with the ``openai`` SDK (upload, list,
retrieve, content, delete), for the Batch API's input files.

A file belongs to the key (tenant) that uploaded it: for any other key it does not exist (404, never
listed).  An upload is multipart/form-data (``purpose``, ``file``, optionally the SDK's ``expires_after[anchor]``
and ``expires_after[seconds]``), read as it streams into a temporary file of the store
(:class:`~orchestrator.batchfiles.FileStore`, under the state dir, shared by every gateway process) and
checked line by line on the way (:class:`~orchestrator.batchcheck.BatchLines`): the first
problem is a 400 that names its line, and nothing is stored.  Only ``purpose=batch`` is uploadable;
``batch_output`` files are the batch runner's.  Uploads have their own size limit,
:data:`~orchestrator.batchfiles.MAX_UPLOAD_BYTES` (``gateway.max_body_bytes`` bounds one line instead: the
runner sends each line's body through the gateway).

Storage is bounded per key and for the fleet (:class:`Room`, ``batches.*`` settings): an upload that would take
its key past ``max_file_bytes_per_key`` or ``max_files_per_key`` (or its own ``max_file_bytes``, ``max_files`` in
``gateway.api_keys``; the key's stored files of every purpose, past their expiry left out, and its uploads in
progress: this process's as received, the other gateway processes' as they are on disk or as their requests'
``Content-Length`` says, if more) is a 400 ``storage_limit_exceeded``; one that would
leave the state dir's file system less than ``min_free_bytes`` free, a 507 ``insufficient_storage``.  Both are
checked before the body is read and as it streams in; the batch runner's outputs count, but are never refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os

from aiohttp import BodyPartReader, web

from ..batchcheck import BadFile, BatchLines
from ..batchfiles import MAX_UPLOAD_BYTES, FileStore, expires_after_s, public
from ..errors import NO_RETRY, error_response, method_not_allowed, unknown_url
from ..pagination import UnknownCursor
from ..statedir import StateDir
from .endpoints import UNREADABLE
from .tenants import Tenant

log = logging.getLogger("slurmfleet.files")
CHUNK_BYTES = 256 * 1024
FORM_SLACK_BYTES = 64 * 1024   # the multipart envelope around the file
FIELD_BYTES = 4096             # a form field other than the file
DRAIN_S = 60.0                 # a refused upload still being sent is read (and dropped) this long for its answer
PURPOSES = ("assistants", "fine-tune", "vision", "user_data", "evals")
REFRESH_BYTES = 64 * 1024 ** 2   # an upload reads its key's usage and the free space again after this many bytes
FULL_RETRY_S = 60                # a 507's Retry-After (the batch runner removes expired files every minute)


class Refused(Exception):
    """An upload refused: the OpenAI error to answer."""

    def __init__(self, status: int, message: str, param: str | None = "file", code: str = "invalid_request",
                 etype: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.etype, self.headers = status, param, code, etype, headers

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": str(self), "type": self.etype, "param": self.param,
                                            "code": self.code}}, status=self.status, headers=self.headers)


def free_bytes(path) -> int:
    """What an unprivileged writer may still write on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    return f"{n} bytes ({n / 1024 ** 3:.2f} GiB)" if n >= 1024 ** 3 else f"{n} bytes"


class Uploads:
    """A gateway process's uploads in progress, per key (what the store does not show yet): how many, and the
    bytes received; and per key the records read before (:meth:`~orchestrator.batchfiles.FileStore.usage`)."""

    def __init__(self):
        self.files: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.known: dict[str, dict] = {}


class Room:
    """What one upload may still store: its key's quota less the key's stored files and this process's uploads
    in progress (this one's bytes included), and the state dir's free space above ``min_free_bytes``; read when
    the upload starts and again every :data:`REFRESH_BYTES`.  Counted in :class:`Uploads` until :meth:`end`."""

    def __init__(self, store: FileStore, uploads: Uploads, owner: str, conf, policy=None):
        self.store, self.uploads, self.owner, self.conf = store, uploads, owner, conf
        # the key's own limits (its api_keys entry), else the batches: section's (0: none)
        own = (policy.max_file_bytes, policy.max_files) if policy is not None else (None, None)
        self.max_bytes = conf.max_file_bytes_per_key if own[0] is None else own[0]
        self.max_files = conf.max_files_per_key if own[1] is None else own[1]
        self.stored = self.files = 0       # the key's stored files when last read
        self.bytes = self.at = 0           # this upload's bytes: received, and when last read
        self.free = 0                      # what may be written from ``at`` on above the floor
        uploads.files[owner] += 1

    def end(self) -> None:
        for tally, n in ((self.uploads.files, 1), (self.uploads.bytes, self.bytes)):
            tally[self.owner] -= n
            if tally[self.owner] <= 0:
                del tally[self.owner]

    async def read(self, first: bool = False) -> None:
        c = self.conf
        if self.max_bytes or self.max_files:
            self.stored, self.files = await asyncio.to_thread(self.store.usage, self.owner,
                                                              self.uploads.known.setdefault(self.owner, {}))
        self.at = self.bytes
        if first and self.max_files and self.files + self.uploads.files[self.owner] > self.max_files:
            raise self.over(f"this key may store {self.max_files} file{'s' * (self.max_files != 1)}")
        if c.min_free_bytes:
            self.free = await asyncio.to_thread(free_bytes, self.store.dir) - c.min_free_bytes

    def check(self, n: int) -> None:
        """Refused when ``n`` more bytes of this upload would pass its key's quota or the free-space floor."""
        if self.max_bytes and self.stored + self.uploads.bytes[self.owner] + n > self.max_bytes:
            raise self.over(f"this key's files may take {_size(self.max_bytes)} in all")
        if self.conf.min_free_bytes and self.bytes - self.at + n > self.free:
            raise self.full()

    async def add(self, n: int) -> None:
        self.check(n)
        self.bytes += n
        self.uploads.bytes[self.owner] += n
        if self.bytes - self.at >= REFRESH_BYTES:
            await self.read()

    def over(self, limit: str) -> Refused:
        others = self.uploads.files[self.owner] - 1
        busy = f", and {others} other upload{'s' * (others > 1)} of it in progress" if others else ""
        return Refused(400, f"Storage limit exceeded: {limit}; it "
                       f"stores {_size(self.stored)} in {self.files} file{'s' * (self.files != 1)}{busy}, and this "
                       "upload would pass the limit. Deleting files (DELETE /v1/files/{file_id}) frees room.",
                       code="storage_limit_exceeded")

    @staticmethod
    def full() -> Refused:
        return Refused(507, "The gateway's file storage is nearly full: the upload cannot be stored now. Try again "
                       "later.", None, "insufficient_storage", "server_error", {"Retry-After": str(FULL_RETRY_S),
                                                                               **NO_RETRY})   # (the SDK sent a
        # 2 GiB upload twice more within two minutes)


def _missing(file_id: str) -> web.Response:
    return web.json_response({"error": {"message": f"No such File object: {file_id}", "type": "invalid_request_error",
                                        "param": "id", "code": None}}, status=404)


def _filename(name: str | None) -> str:
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    return base[:255] or "upload.jsonl"


def _check_purpose(purpose: str) -> None:
    if purpose == "batch":
        return
    if purpose == "batch_output":
        raise Refused(400, "Files with purpose `batch_output` are written by the batch runner, not uploaded.",
                      "purpose")
    raise Refused(400, f"Purpose {purpose!r} is not supported: this gateway stores batch input files "
                       "(purpose `batch`) only." if purpose in PURPOSES else
                  f"Invalid purpose {purpose!r}: the files stored here have purpose `batch`.", "purpose")


async def _field(part: BodyPartReader) -> str:
    data = bytearray()
    while chunk := await part.read_chunk(FIELD_BYTES):
        data += chunk
        if len(data) > FIELD_BYTES:
            raise Refused(400, f"The field `{part.name}` is longer than {FIELD_BYTES} bytes.", part.name)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise Refused(400, f"The field `{part.name}` is not UTF-8 text.", part.name) from None


async def _drain(request: web.BaseRequest, max_bytes: int) -> bool:
    """Read and drop what is left of a refused upload (an HTTP client reads the answer once it has sent its
    body); False when it did not end in :data:`DRAIN_S` or ``max_bytes``."""
    loop = asyncio.get_running_loop()
    end, n = loop.time() + DRAIN_S, 0
    try:
        while n <= max_bytes:
            chunk = await asyncio.wait_for(request.content.readany(), max(0.0, end - loop.time()))
            if not chunk:
                return True
            n += len(chunk)
    except Exception:  # noqa: BLE001 - a timeout or a broken body: the connection is closed
        pass
    return False


class FilesApi:
    """The handlers, made per request from the gateway's config, models and keys (no state of their own)."""

    def __init__(self, gateway, max_bytes: int | None = None):
        self.gw = gateway
        self.store = FileStore(StateDir(gateway.cfg.state_dir).files)
        self.max_bytes = max_bytes or MAX_UPLOAD_BYTES

    async def handle(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        tenant = self.gw.tenants.identify(request.headers)
        if tenant is None:
            return self.gw.tenants.refusal(request.headers)
        parts = path[len("/v1/files"):].strip("/").split("/") if path.strip("/") != "v1/files" else []
        method = request.method
        if not parts:
            if method == "POST":
                return await self.upload(request, tenant)
            if method == "GET":
                return await self.list(request, tenant)
            return method_not_allowed(method, path, "GET, POST")
        if len(parts) == 1:
            if method == "GET":   # (a record of the state dir, shared with the nodes: read in a thread, as a
                # stalled NFS or Lustre mount would stall the event loop, every client of this process with it)
                rec = await asyncio.to_thread(self.store.get, parts[0], tenant.name)
                return web.json_response(public(rec)) if rec else _missing(parts[0])
            if method == "DELETE":
                return await self.delete(parts[0], tenant)
            return method_not_allowed(method, path, "GET, DELETE")
        if len(parts) == 2 and parts[1] == "content":
            if method == "GET":
                return await self.content(parts[0], tenant)
            return method_not_allowed(method, path, "GET")
        return unknown_url(method, path)

    # -- upload ---------------------------------------------------------------------------------------------
    async def upload(self, request: web.BaseRequest, tenant: Tenant) -> web.StreamResponse:
        if self.gw.shutting_down:
            return error_response(503, "The gateway is shutting down.", "service_unavailable", "shutting_down",
                                  {"Retry-After": "5"})
        if request.content_type != "multipart/form-data":
            return Refused(400, "Upload a file as multipart/form-data with the fields `purpose` and `file`.",
                           None).response()
        length = request.content_length
        if length is not None and length > self.max_bytes + FORM_SLACK_BYTES:
            resp = self._too_large().response()
            resp.force_close()   # not a byte of the body read: the connection cannot be used again
            return resp
        expect = request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue"
        up = await asyncio.to_thread(self.store.upload, tenant.name, max(0, (length or 0) - FORM_SLACK_BYTES))
        room = Room(self.store, self.gw.file_uploads, tenant.name, self.gw.cfg.batches,
                    self.gw.tenants.policies.get(tenant.name))
        try:   # in the key's uploads in progress until stored or refused
            return await self._upload(request, tenant, up, room, expect)
        finally:
            room.end()

    async def _upload(self, request: web.BaseRequest, tenant: Tenant, up, room: Room,
                      expect: bool) -> web.StreamResponse:
        try:
            await room.read(first=True)   # before a byte is read (a client awaiting 100-continue sends none)
            room.check(max(1, (request.content_length or 0) - FORM_SLACK_BYTES))
            if expect:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                expect = False
            purpose, filename, check, expires = await self._receive(request, tenant, up, room)
        except Refused as exc:
            await asyncio.to_thread(up.abort)   # (the state dir's files: off the loop, as every write of an upload)
            if exc.code in ("storage_limit_exceeded", "insufficient_storage"):
                log.warning("upload by %s refused (%s): %s", tenant.name, exc.code, exc)
            resp = exc.response()
            if exc.status == 413 or expect or not await _drain(request, self.max_bytes + FORM_SLACK_BYTES):
                resp.force_close()
            return resp
        except BaseException:   # the client went away: nothing stored (its file removed even if cancelled again)
            await asyncio.shield(asyncio.to_thread(up.abort))
            raise
        # all received and checked: stored even if the client goes away now (commit cleans up if it fails)
        rec = await asyncio.shield(asyncio.to_thread(up.commit, tenant.name, purpose, filename, check.lines,
                                                     check.endpoint, check.models, expires))
        log.info("file %s stored for %s: %d lines, %d bytes, %s", rec["id"], tenant.name, rec["lines"],
                 rec["bytes"], rec["endpoint"])
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.store.sweep)
        return web.json_response(public(rec))

    def _too_large(self) -> Refused:
        return Refused(413, f"The file is larger than {self.max_bytes} bytes, the limit of an upload.",
                       code="file_too_large")

    async def _receive(self, request: web.BaseRequest, tenant: Tenant, up,
                       room: Room) -> tuple[str, str, BatchLines, int | None]:
        """Read the form: (purpose, file name, the file's check, seconds to its expiry or None).  Every problem
        raises :class:`Refused`."""
        purpose = filename = check = None
        expiry: dict[str, str] = {}   # expires_after[anchor], expires_after[seconds]: the SDK's form fields
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise Refused(400, "A nested multipart body is not an upload.", None)
                if part.name == "purpose":
                    purpose = (await _field(part)).strip()
                    _check_purpose(purpose)
                elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):
                    expiry[part.name[14:-1]] = (await _field(part)).strip()
                elif part.name == "file":
                    if check is not None:
                        raise Refused(400, "One `file` per upload.")
                    filename = _filename(part.filename)
                    check = await self._stream(part, tenant, up, room)
                else:
                    raise Refused(400, f"Unknown parameter: {part.name!r}.", part.name)
        except BadFile as exc:
            raise Refused(400, str(exc), code="invalid_batch_file") from None
        except (ValueError, AssertionError) as exc:   # aiohttp's word on a malformed multipart body
            raise Refused(400, f"Malformed multipart body: {exc}", None) from None
        except UNREADABLE as exc:
            raise Refused(400, f"Cannot read the request body: {exc}", None) from None
        if check is None:
            raise Refused(400, "The upload has no `file` field.")
        if purpose is None:
            raise Refused(400, "The upload has no `purpose` field (use `batch`).", "purpose")
        try:
            # (none asked: OpenAI's 30 days for a batch file, batches.file_expiry_s)
            expires = expires_after_s(expiry, "expires_after") if expiry else self.gw.cfg.batches.file_expiry_s or None
        except ValueError as exc:
            raise Refused(400, str(exc), "expires_after") from None
        return purpose, filename, check, expires

    async def _stream(self, part: BodyPartReader, tenant: Tenant, up, room: Room) -> BatchLines:
        """Check the file's lines and write them to the temporary file, one chunk at a time."""
        pools = self.gw.pools

        def resolve(name: str) -> str | None:
            pool = pools.resolve(name)
            return pool.model.name if pool is not None else None
        check = BatchLines(resolve, tenant.models, max_line_bytes=self.gw.cfg.gateway.max_body_bytes)
        while chunk := await part.read_chunk(CHUNK_BYTES):
            if up.bytes + len(chunk) > self.max_bytes:
                raise self._too_large()
            await room.add(len(chunk))
            check.feed(chunk)
            try:
                await asyncio.to_thread(up.write, chunk)
            except OSError as e:   # the disk (or a quota on it) full after all
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise Room.full() from None
        check.close()
        return check

    # -- the others -----------------------------------------------------------------------------------------
    async def list(self, request: web.BaseRequest, tenant: Tenant) -> web.Response:
        q = request.query
        try:
            limit = int(q.get("limit", "10000"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 10000:
            return Refused(400, "limit must be an integer from 1 to 10000.", "limit").response()
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            return Refused(400, "order must be `asc` or `desc`.", "order").response()
        try:
            page, more = await asyncio.to_thread(self.store.list, tenant.name, q.get("purpose"), limit,
                                                 q.get("after"), order)
        except UnknownCursor as e:
            return Refused(400, str(e), "after").response()
        data = [public(r) for r in page]
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": more})

    async def delete(self, file_id: str, tenant: Tenant) -> web.Response:
        from ..batches import BatchStore
        batches = BatchStore(StateDir(self.gw.cfg.state_dir).root / "batches")
        if await asyncio.to_thread(self.store.get, file_id, tenant.name) is None:   # past its expiry too: gone
            return _missing(file_id)   # for the client (a batch that still reads it keeps it until the batch ends)

        def delete_unread() -> tuple[str | None, bool]:   # (a batch made meanwhile reads it: refused, not deleted)
            with self.store.inputs_lock():
                batch = batches.uses(file_id, tenant.name)
                return batch, batch is None and self.store.delete(file_id, tenant.name)
        batch, deleted = await asyncio.to_thread(delete_unread)
        if batch is not None:
            return Refused(409, f"File '{file_id}' is the input of batch '{batch}', which has not ended: cancel the "
                           f"batch, or delete the file once it has ended.", "file_id", "file_in_use",
                           headers=NO_RETRY).response()   # (the SDK sends a 409 again twice: it would be again)
        if not deleted:
            return _missing(file_id)
        log.info("file %s deleted by %s", file_id, tenant.name)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def content(self, file_id: str, tenant: Tenant) -> web.StreamResponse:
        if await asyncio.to_thread(self.store.get, file_id, tenant.name) is None:
            return _missing(file_id)
        return web.FileResponse(self.store.data_path(file_id), chunk_size=CHUNK_BYTES,
                                headers={"Content-Type": "application/octet-stream"})
