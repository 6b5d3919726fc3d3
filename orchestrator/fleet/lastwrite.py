"""The usage ledger's last write as the daemon stops: off the event loop, within a bound.

The state dir may be on NFS or Lustre, which can hang: the ledger's last flush and close (``<state_dir>/
usage.sqlite3``) then never return, and on the event loop they held the daemon's stop for ever (a second SIGTERM
too).  They run in a thread of their own; one not done within the bound is logged, naming the file, and the daemon
exits without waiting for it (the process's end gives it 5 s more: :func:`orchestrator.procexit.exit_bounded`).
What it writes is one SQLite transaction: it lands whole or not at all, and what earlier flushes wrote stays.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable

from .tenancy import Tenancy
from .usage import UsageLedger

log = logging.getLogger("slurmfleet")


class LastWrite:
    def __init__(self, tenancy: Tenancy, ledger: UsageLedger):
        self.tenancy, self.ledger = tenancy, ledger
        self.started = False   # the stop's write began: a second SIGTERM writes nothing beside it
        self.left_behind = False   # not done within its bound: it may land still (the state dir's lock is kept)

    async def stop(self, timeout_s: float) -> bool:
        """The gateway has stopped: its processes' last reports taken (on the loop: in memory), then the ledger
        flushed and closed in a thread, waited for ``timeout_s`` at most.  True once written."""
        self.started = True
        self._settle()

        async def last() -> None:
            await self.ledger.settled()   # (the flush out in the ledger's thread first: landed on the loop)
            await asyncio.wrap_future(self._start(self.ledger.close, daemon=False))
        try:
            await asyncio.wait_for(last(), timeout_s)
            return True
        except TimeoutError:
            self._abandoned(timeout_s)
        except Exception:  # noqa: BLE001 - logged; the rest of the shutdown goes on
            log.exception("could not write the usage ledger %s at shutdown", self.ledger.path)
        return False

    def now(self, timeout_s: float) -> None:
        """A second SIGTERM: the last reports taken and written before the process ends, waited for ``timeout_s``
        at most (blocking: the process ends next); nothing when the stop's own write is under way."""
        if self.started:
            return
        self._settle()
        try:
            self._start(self.ledger.flush, daemon=True).result(timeout_s)
        except concurrent.futures.TimeoutError:
            self._abandoned(timeout_s)
        except Exception:  # noqa: BLE001 - exiting all the same
            log.exception("could not write the usage down before exiting")

    def _settle(self) -> None:
        try:
            self.tenancy.settle()
        except Exception:  # noqa: BLE001 - what was taken is written all the same
            log.exception("could not take the gateway processes' last usage reports")

    def _abandoned(self, timeout_s: float) -> None:
        self.left_behind = True
        log.error("usage ledger %s: its last write did not finish within %.0fs (a hung file system?): exiting "
                  "without it; the usage counted since its last flush is lost unless it lands before the process "
                  "ends", self.ledger.path, timeout_s)

    @staticmethod
    def _start(fn: Callable[[], object], *, daemon: bool) -> concurrent.futures.Future:
        """``fn()`` in a thread of its own (a pool's may all be stuck on the same file system)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def body() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    fut.set_exception(exc)
        threading.Thread(target=body, name="slurmfleet-usage", daemon=daemon).start()
        return fut
