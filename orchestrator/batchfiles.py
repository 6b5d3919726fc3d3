"""The Files API's files (``/v1/files``, :mod:`orchestrator.gateway.files`), durable under the state dir (the
check of a batch input file as it streams in is :mod:`orchestrator.batchcheck`).  The gateway stores uploads; the
batch runner reads an input with :meth:`FileStore.open_lines` and stores its output and error files with
:meth:`FileStore.adopt` or :meth:`FileStore.create_output`.  One flat folder, ``<state_dir>/files/``, no
index (every gateway process and the runner see the same files; a listing reads one owner's records)::

    file-<id>.data                the content, never changed once it has a record
    file-<id>.<owner tag>.json    its record (OpenAI's File object plus owner, lines, endpoint, models);
                                  the file exists exactly when its record does
    .up-<pid>-<hex>[.<owner tag>.<bytes>]   an upload being received (by whom, and the bytes its request says
                                  it sends: every gateway process counts the others' against the key's quota)
    .out-<file id>                an output being written (reopened by its id after a restart)

The owner tag is 8 bytes of BLAKE2b of the key's name: another key's file is not found by name (404).
Writes: content first (temporary file, fsync, rename), then the record (the same, and the folder fsync'd),
so a SIGKILL leaves a whole file or none; what a crash leaves behind (an upload's temporary file, content
without a record) is swept after :data:`SWEEP_AFTER_S`.  Delete removes the record first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import orjson

from .durable import fsync_dir, write_whole
from .pagination import page, time_id

log = logging.getLogger(__name__)

MAX_UPLOAD_BYTES = 2 * 1024 ** 3
"""An upload's content at most (2 GiB; ``gateway.max_body_bytes`` bounds proxied bodies, not uploads)."""
SWEEP_AFTER_S = 3600.0
"""A temporary upload or content without a record untouched this long is a crash's leftover."""
EXPIRES_AFTER_S = (3600, 30 * 86400)
"""The bounds of a file's ``expires_after.seconds`` (and a batch's ``output_expires_after``), as OpenAI's."""
PUBLIC = ("id", "object", "bytes", "created_at", "filename", "purpose", "status", "expires_at", "status_details")


def public(record: dict) -> dict:
    """What a client sees of a record: OpenAI's File object."""
    return {k: record.get(k) for k in PUBLIC}


def expires_after_s(value: object, name: str) -> int:
    """The seconds of an ``expires_after`` policy (``{"anchor": "created_at", "seconds": N}``); ValueError
    with the reason, naming ``name``."""
    lo, hi = EXPIRES_AFTER_S
    if not isinstance(value, dict) or set(value) != {"anchor", "seconds"} or value["anchor"] != "created_at":
        raise ValueError(f"{name} must be {{\"anchor\": \"created_at\", \"seconds\": N}}.")
    n = value["seconds"]
    if isinstance(n, str) and n.isascii() and n.isdigit():   # (a form field is text)
        n = int(n)
    if type(n) is not int or not lo <= n <= hi:
        raise ValueError(f"{name}.seconds must be an integer from {lo} (1 hour) to {hi} (30 days).")
    return n


def _expired(rec: dict, now: float) -> bool:
    return rec.get("expires_at") is not None and now >= rec["expires_at"]


def owner_tag(owner: str) -> str:
    return hashlib.blake2b(owner.encode(), digest_size=8).hexdigest()


def _tagged_upload(name: str) -> tuple[int, str, int] | None:
    """(process id, owner tag, declared bytes) of a gateway process's upload in progress
    (``.up-<pid>-<hex>.<owner tag>.<bytes>``, :meth:`FileStore.upload`), None for any other name."""
    parts = name[4:].split(".") if name.startswith(".up-") else ()
    if len(parts) != 3 or not parts[2].isdigit() or not (pid := parts[0].split("-", 1)[0]).isdigit():
        return None
    return int(pid), parts[1], int(parts[2])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # (another user's: alive)
        pass
    return True


DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
"""A hard link refused for these is the disk's (or quota's) problem: a move would not do better."""


def _link(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` at ``dst`` (True); on a file system that will not link them, move it there (False).
    File systems refuse a link with many errnos (EPERM, EOPNOTSUPP; EXDEV across folders on AFS or EOS; ENOSYS
    on some FUSE ones; EMLINK, EINVAL): any but :data:`DISK_ERRNOS` moves."""
    try:
        os.link(src, dst)
        return True
    except OSError as e:
        if e.errno in DISK_ERRNOS:
            raise
        log.info("cannot hard-link %s into the file store (%s): moving it", src.name, e)
    os.replace(src, dst)
    return False


class FileStore:
    """The files of every key; stateless (a path), so any process may make one."""

    def __init__(self, root: str | Path):
        self.dir = Path(root)

    @staticmethod
    def new_id() -> str:
        return time_id("file-")

    def data_path(self, file_id: str) -> Path:
        """Where a file's content is (KeyError: not a file id, ``file-`` and up to 64 letters or digits)."""
        rest = file_id[5:] if isinstance(file_id, str) and file_id.startswith("file-") else ""
        if not (0 < len(rest) <= 64 and rest.isascii() and rest.isalnum()):
            raise KeyError(file_id)
        return self.dir / f"{file_id}.data"

    def record_path(self, file_id: str, owner: str) -> Path:
        return self.data_path(file_id).with_suffix(f".{owner_tag(owner)}.json")

    def get(self, file_id: str, owner: str, expired: bool = False) -> dict | None:
        """The record if the file exists and belongs to ``owner`` (for any other key it does not exist); a file
        past its ``expires_at`` does not exist either (``expired``: it does, until :meth:`expire` removes it)."""
        try:
            rec = orjson.loads(self.record_path(file_id, owner).read_bytes())
        except (KeyError, OSError, ValueError):
            return None
        if not isinstance(rec, dict) or rec.get("owner") != owner:
            return None
        return None if not expired and _expired(rec, time.time()) else rec

    def list(self, owner: str, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> tuple[list[dict], bool]:
        """The owner's files, newest first (``order="asc"``: oldest first), after the file ``after``: (page, more)."""
        suffix = f".{owner_tag(owner)}.json"
        names = os.listdir(self.dir) if self.dir.is_dir() else []
        recs = []
        for rec in (self.get(n.split(".", 1)[0], owner) for n in names if n.endswith(suffix)):
            if rec is not None and (purpose is None or rec.get("purpose") == purpose):   # None: deleted meanwhile
                recs.append(rec)
        return page(recs, "file-", limit, after, newest_first=order != "asc")

    def usage(self, owner: str, known: dict | None = None, now: float | None = None) -> tuple[int, int]:
        """(bytes, files) of the owner's stored files, of every purpose, those past their ``expires_at`` left out:
        one listing and the owner's records.  ``known``, a dict the caller keeps for this owner, saves reading a
        record again (a record never changes): its (bytes, expires_at), forgotten once the record is gone.  With
        them, the owner's uploads that other processes are receiving (:meth:`_uploading`)."""
        now = time.time() if now is None else now
        tag = owner_tag(owner)
        suffix, known = f".{tag}.json", {} if known is None else known
        try:
            listing = os.listdir(self.dir)
        except FileNotFoundError:
            listing = []
        names = {n for n in listing if n.endswith(suffix)}
        for gone in list(known):   # (a copy: another thread may be adding the same owner's)
            if gone not in names:
                known.pop(gone, None)
        size = count = 0
        for n in names:
            if (entry := known.get(n)) is None:
                try:
                    rec = orjson.loads((self.dir / n).read_bytes())
                except (OSError, ValueError):   # deleted meanwhile
                    continue
                if not isinstance(rec, dict) or rec.get("owner") != owner:
                    continue
                entry = known[n] = (int(rec.get("bytes") or 0), rec.get("expires_at"))
            if entry[1] is None or now < entry[1]:   # (not past its expiry)
                size, count = size + entry[0], count + 1
        up_size, up_count = self._uploading(listing, tag, now)
        return size + up_size, count + up_count

    def open_lines(self, file_id: str) -> Iterator[tuple[int, bytes]]:
        """The lines of a stored file, in order: (line number from 1, the line without its end).  Blank
        lines are left out (a batch file may only end with some).  KeyError or OSError when it is not there."""
        f = open(self.data_path(file_id), "rb")

        def lines() -> Iterator[tuple[int, bytes]]:
            with f:
                for n, raw in enumerate(f, 1):
                    line = raw.rstrip(b"\r\n")
                    if line.strip():
                        yield n, line
        return lines()

    def upload(self, owner: str = "", declared: int = 0) -> Writer:
        """A new file's content, written to a temporary file; :meth:`Writer.commit` stores it.  ``owner``'s
        upload, of ``declared`` bytes as its request says, counts in its usage for the other processes."""
        mine = f".{owner_tag(owner)}.{max(0, declared)}" if owner else ""
        return Writer(self, self.dir / f".up-{os.getpid()}-{secrets.token_hex(8)}{mine}", self.new_id())

    def _uploading(self, names: Collection[str], tag: str, now: float) -> tuple[int, int]:
        """(bytes, files) of the owner's uploads other live processes receive: each its bytes on disk, or its
        declared ones if more (not one older than :data:`SWEEP_AFTER_S`)."""
        size = count = 0
        for n in names:
            up = _tagged_upload(n)
            if up is None or up[1] != tag or up[0] == os.getpid() or not _alive(up[0]):
                continue
            try:
                st = (self.dir / n).stat()
            except FileNotFoundError:   # stored or given up meanwhile
                continue
            if now - st.st_mtime <= SWEEP_AFTER_S:
                size, count = size + max(st.st_size, up[2]), count + 1
        return size, count

    def create_output(self, owner: str, purpose: str, filename: str, file_id: str | None = None) -> Writer:
        """A file written line by line (:meth:`Writer.append`, then :meth:`Writer.finalize`).  With
        ``file_id`` it resumes: the same id reopens the same partial file, cut to its last whole line."""
        fid = file_id or self.new_id()
        out, data = self.dir / f".out-{fid}", self.data_path(fid)
        if not out.exists() and data.exists() and self.get(fid, owner, expired=True) is None:
            os.replace(data, out)   # a crash between the content's rename and its record: finish it again
        w = Writer(self, out, fid, resume=True)
        w.owner, w.purpose, w.filename = owner, purpose, filename
        return w

    def adopt(self, path: str | Path, owner: str, purpose: str, filename: str, file_id: str | None = None,
              expires_after: int | None = None) -> str:
        """Make the file at ``path`` (on the store's file system) a stored file, moved in whole; its id.
        Idempotent with ``file_id``: done already (a restart after a crash), it returns the id; ``path``
        gone and no content either, the file is empty.  ``expires_after``: seconds from now to its expiry.
        Safe from a crash or an error at any point: the content is hard-linked in, its record written, and only
        then ``path`` removed; a try that failed (a full disk) leaves ``path`` as it was (no content without a
        record: nothing for a sweep to take), for the next.  (A file system that will not link it: moved, and
        each try makes the content recent again, so a sweep does not take it while the tries go on.)"""
        fid, src = file_id or self.new_id(), Path(path)
        if self.get(fid, owner, expired=True) is None:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            data, linked = self.data_path(fid), False
            if src.exists():
                with open(src, "rb+") as f:
                    os.fsync(f.fileno())
                os.utime(src)   # recent: not a crash's leftover for a sweep between the link and the record
                data.unlink(missing_ok=True)   # a link an earlier try left (its record never written)
                linked = _link(src, data)
            elif data.exists():   # moved in, not recorded (a try that failed, a crash): recorded now; recent
                os.utime(data)    # meanwhile, not a leftover for a sweep while a full disk keeps failing the tries
            else:   # none at all: empty
                data.touch()
            try:
                with open(data, "rb") as f:
                    lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
                self.publish(fid, owner, purpose, filename, lines, expires_after=expires_after)
            except BaseException:
                if linked:   # (``path`` keeps the content)
                    with contextlib.suppress(OSError):
                        data.unlink()
                raise
        src.unlink(missing_ok=True)
        return fid

    def publish(self, file_id: str, owner: str, purpose: str, filename: str, lines: int,
                endpoint: str | None = None, models: list[str] | None = None, expires_after: int | None = None) -> dict:
        """Write the record of content already at :meth:`data_path`: from now on the file exists (until
        ``expires_after`` seconds from its creation, when given)."""
        now = time.time()
        rec = {"id": file_id, "object": "file", "bytes": self.data_path(file_id).stat().st_size,
               "created_at": int(now), "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": None if expires_after is None else int(now) + expires_after, "status_details": None,
               "owner": owner, "created": now, "lines": lines, "endpoint": endpoint, "models": models or []}
        # (the folder's fsync makes both renames, the content's and the record's, durable)
        write_whole(self.record_path(file_id, owner), orjson.dumps(rec), mode=0o666,
                    tmp=self.dir / f".up-{os.getpid()}-{secrets.token_hex(8)}")
        return rec

    @contextlib.contextmanager
    def inputs_lock(self) -> Iterator[None]:
        """Held while a batch is recorded as reading a file, and while a file is deleted or expired (an exclusive
        ``flock``: every gateway process and the daemon): a file is not removed between a new batch's look at it
        and its record, which the delete's look for batches reading it would have missed."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.dir / ".inputs.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def delete(self, file_id: str, owner: str) -> bool:
        """Remove the owner's file: False when it has none by that id."""
        try:
            self.record_path(file_id, owner).unlink()
        except (KeyError, FileNotFoundError):
            return False
        fsync_dir(self.dir)
        self.data_path(file_id).unlink(missing_ok=True)   # a reader that has it open reads on
        return True

    def expire(self, keep: Collection[str] = (), now: float | None = None,
               in_use: Callable[[], Collection[str]] = frozenset) -> int:
        """Remove the files past their ``expires_at`` (their records first), but those in ``keep`` or ``in_use``
        (asked once, under :meth:`inputs_lock`: a batch made since ``keep`` was) -- the inputs of batches that
        have not ended: their runners read them on; how many went."""
        now = time.time() if now is None else now
        try:
            names = [n for n in os.listdir(self.dir) if n.endswith(".json") and n.startswith("file-")]
        except FileNotFoundError:
            return 0
        due = []
        for n in names:
            try:
                rec = orjson.loads((self.dir / n).read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and _expired(rec, now) and rec.get("id") not in keep:
                due.append(rec)
        if not due:
            return 0
        gone = 0
        with self.inputs_lock():
            read = in_use()
            for rec in due:
                if rec["id"] not in read and self.delete(rec["id"], rec.get("owner", "")):
                    log.info("file %s of %s expired: removed", rec["id"], rec.get("owner"))
                    gone += 1
        return gone

    def drop_uploads(self) -> int:
        """Remove the uploads in progress an earlier daemon's gateway processes left (they ended with it; a process
        id reused since would make them count); how many went."""
        try:
            names = [n for n in os.listdir(self.dir) if _tagged_upload(n) is not None]
        except FileNotFoundError:
            return 0
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / n).unlink()
        return len(names)

    def sweep(self, now: float | None = None) -> int:
        """Remove what crashes left: temporary uploads and content without a record, untouched for
        :data:`SWEEP_AFTER_S` (an output being written, ``.out-*``, is left for its writer)."""
        now = time.time() if now is None else now
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return 0
        recorded = {n.split(".", 1)[0] for n in names if n.endswith(".json")}
        gone = 0
        for n in names:
            if n.startswith(".up-") or n.endswith(".data") and n[:-5] not in recorded:
                with contextlib.suppress(FileNotFoundError):
                    if now - (self.dir / n).stat().st_mtime > SWEEP_AFTER_S:
                        (self.dir / n).unlink()
                        gone += 1
        return gone


class Writer:
    """A file being written to a temporary path of the store: :meth:`write` (an upload's chunks) or
    :meth:`append` (an output's lines, fsync'd with ``sync``), then :meth:`commit`, or :meth:`abort`."""

    def __init__(self, store: FileStore, path: Path, file_id: str, resume: bool = False):
        store.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.store, self.path, self.id, self.resume = store, path, file_id, resume
        self.owner = self.purpose = self.filename = ""
        self.f = open(path, "a+b" if resume else "xb")
        self.bytes = self.lines = 0
        if resume:   # cut a line half written
            self.f.seek(0)
            for raw in self.f:
                if not raw.endswith(b"\n"):
                    break
                self.lines += 1
                self.bytes += len(raw)
            self.f.truncate(self.bytes)
            self.f.seek(self.bytes)

    def write(self, data: bytes) -> None:
        self.bytes += self.f.write(data)

    def append(self, line: bytes, sync: bool = True) -> None:
        self.write(line if line.endswith(b"\n") else line + b"\n")
        self.f.flush()
        if sync:
            os.fsync(self.f.fileno())
        self.lines += 1

    def commit(self, owner: str, purpose: str, filename: str, lines: int, endpoint: str | None = None,
               models: list[str] | None = None, expires_after: int | None = None) -> dict:
        """fsync, move into place, write the record; blocking (a thread's work in an event loop).  Idempotent: a
        file stored under this id already is returned as it is.  An upload's id is made now, as its created_at."""
        try:
            self.id = self.id if self.resume else self.store.new_id()   # (a list by id: by when it was stored)
            done = self.store.get(self.id, owner, expired=True)
            if done is None:
                self.f.flush()
                os.fsync(self.f.fileno())
                os.replace(self.path, self.store.data_path(self.id))
                done = self.store.publish(self.id, owner, purpose, filename, lines, endpoint, models, expires_after)
        except BaseException:
            if not self.resume:   # an upload that failed is gone; an output stays to be finalized again
                self.abort()
            raise
        self.abort()   # closed (the temporary file was moved)
        return done

    def finalize(self) -> dict:
        """Store an output made by :meth:`FileStore.create_output`."""
        return self.commit(self.owner, self.purpose, self.filename, self.lines)

    def abort(self) -> None:
        self.f.close()
        self.path.unlink(missing_ok=True)
