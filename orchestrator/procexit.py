"""The process's end: bounded, whatever threads a hung file system holds."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("slurmfleet")


def exit_bounded(code: int, wait_s: float = 5.0) -> int:
    """``code``, once the threads still working when the daemon ended (a batch output's fsync) are done; one still
    stuck after ``wait_s`` (a hung file system: Python joins it at exit, for ever) is left behind by ``os._exit``."""
    deadline, me = time.monotonic() + wait_s, threading.current_thread()
    for t in threading.enumerate():
        if not t.daemon and t is not me:
            t.join(max(0.0, deadline - time.monotonic()))
    if not (stuck := [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not me]):
        return code
    log.error("exiting without %s, stuck for %.0fs (a hung file system?)", ", ".join(stuck), wait_s)
    try:
        logging.shutdown()
        sys.stdout.flush(), sys.stderr.flush()
    finally:   # (a closed stdout must not keep it alive either)
        os._exit(code)
