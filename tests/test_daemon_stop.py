"""The daemon's stop on a hung state dir (NFS, Lustre): bounded, and logged (no SLURM: the reconciler is idle)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest

from conftest import free_port
from orchestrator.daemon import Daemon
from orchestrator.fleet.reconciler import Reconciler
from orchestrator.fleet.usage import UsageLedger
from orchestrator.fleetfile import load_config_text
from orchestrator.statedir import StateDir, StateDirBusy


async def test_a_usage_ledger_write_stuck_on_a_hung_state_dir_does_not_hold_the_stop(tmp_path, monkeypatch, caplog):
    """The usage ledger's last write (``<state_dir>/usage.sqlite3``) ran on the event loop: a state dir that hung
    as the daemon stopped held the stop for ever.  Now it runs in a thread, waited for daemon.task_stop_timeout_s,
    then logged, naming the file, and left behind; the state dir's lock is kept while it may still land."""
    caplog.set_level(logging.INFO, logger="slurmfleet")
    state = tmp_path / "s"
    cfg = load_config_text(f"fleet: f\nstate_dir: {state}\n"
                           f"daemon: {{admin_port: {free_port()}, task_stop_timeout_s: 1}}\n"
                           f"gateway: {{port: {free_port()}, shutdown_grace_s: 0}}\nmodels: []\n", "f.yaml", {})

    async def idle(self) -> None:
        pass
    monkeypatch.setattr(Reconciler, "tick", idle)
    daemon = Daemon(tmp_path / "f.yaml", cfg)
    run = asyncio.create_task(daemon.run())
    for _ in range(400):
        if "gateway on" in caplog.text or run.done():
            break
        await asyncio.sleep(0.05)
    assert not run.done() and "gateway on" in caplog.text, caplog.text

    hung, close = threading.Event(), UsageLedger.close

    def stuck(self) -> None:   # the file system stops answering as the daemon stops
        hung.wait(10)   # (not for ever: on the event loop it held the test too)
        close(self)
    monkeypatch.setattr(UsageLedger, "close", stuck)
    t0 = time.monotonic()
    daemon.stop.set()
    try:
        code = await asyncio.wait_for(run, 60)
        took = time.monotonic() - t0
        assert code == 0 and took < 5, f"the stop took {took:.1f}s"
        assert f"usage ledger {state / 'usage.sqlite3'}: its last write did not finish within 1s" in caplog.text
        assert "stopped in" in caplog.text
        with pytest.raises(StateDirBusy):   # (no daemon starts beside the write left behind)
            StateDir(state).lock()
    finally:
        hung.set()
        for fd in os.listdir("/proc/self/fd"):   # (the lock the process's end would release)
            if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(state / "daemon.lock"):
                os.close(int(fd))
