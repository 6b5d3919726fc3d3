"""The gateway worker processes' supervisor (``orchestrator/gateway/processes.py``): a port another daemon
listens on, a worker that cannot be forked again, and stragglers at shutdown."""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import time

import pytest

from orchestrator.fleetfile import load_config_text
from orchestrator.gateway import processes
from orchestrator.gateway.processes import GatewayWorkers, Worker, port_taken


def config(tmp_path, port: int, **gateway):
    extra = "".join(f", {k}: {v}" for k, v in gateway.items())
    return load_config_text(f"fleet: f\nstate_dir: {tmp_path}\nmodels: []\ngateway: {{workers: 2, port: {port}"
                            f"{extra}}}\n", "f.yaml", {})


def reuse_port_listener() -> socket.socket:
    """What another daemon's gateway worker holds: the port bound with SO_REUSEPORT."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


async def test_a_port_another_daemons_workers_listen_on_is_refused_before_any_worker_starts(tmp_path, caplog):
    """Workers bind with SO_REUSEPORT, which the kernel grants a second daemon of the same user as well: it
    started and took half the clients' connections (the other fleet's models and keys).  A plain bind first."""
    other = reuse_port_listener()
    port = other.getsockname()[1]
    workers = GatewayWorkers(config(tmp_path, port, host="127.0.0.1"), None)
    spawned: list[int] = []

    async def spawn(process: int):
        spawned.append(process)
        raise AssertionError("no worker may start")
    workers._spawn = spawn
    with caplog.at_level(logging.ERROR, "slurmfleet.workers"):
        assert await workers.start() is False
    assert spawned == [] and workers.processes == 0
    assert f"cannot listen on 127.0.0.1:{port} (gateway.port)" in caplog.text
    other.close()
    assert port_taken("127.0.0.1", port) is None and port_taken("0.0.0.0", port) is None


def test_an_address_family_the_host_lacks_is_no_taken_port(monkeypatch):
    """A host with IPv6 turned off: "localhost" or "" still resolve to "::1"/"::" too, whose socket fails
    (EAFNOSUPPORT) or bind does (EADDRNOTAVAIL).  The workers' own bind skips those; the check raised (the daemon
    died) or said the port was taken."""
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *a, **kw):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *a, **kw)
    monkeypatch.setattr(socket, "socket", no_ipv6)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **kw: [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::", 18000, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))])
    assert port_taken("", 18000) is None


def test_the_port_is_free_to_a_daemon_whose_last_workers_only_finish_their_streams():
    """A killed daemon's workers stop listening and serve their streams to the end: their connections are no
    listener, so the next daemon starts."""
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    port = lst.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = lst.accept()
    assert port_taken("127.0.0.1", port) is not None
    lst.close()
    try:
        assert port_taken("127.0.0.1", port) is None
    finally:
        client.close()
        conn.close()


async def test_a_worker_that_cannot_be_forked_again_is_retried_not_the_daemons_end(tmp_path):
    """A respawn that meets EAGAIN (a process limit on a shared login node) raised OSError out of the worker's
    root task, which stops the daemon: it is an attempt that failed, retried with back-off."""
    workers = GatewayWorkers(config(tmp_path, 18000, worker_restart_base_s=0.01, worker_restart_max_s=0.02), None)
    tries: list[int] = []

    async def cannot(process: int):
        tries.append(process)
        raise BlockingIOError(11, "Resource temporarily unavailable")
    workers._spawn = cannot
    task = asyncio.create_task(workers.watch(1))
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(tries) >= 5 and workers.restarts == len(tries)


class Stuck:
    """A worker process that does not stop until it is killed."""

    def __init__(self, pid: int):
        self.pid, self.returncode, self.killed = pid, None, asyncio.Event()

    async def wait(self) -> int:
        await self.killed.wait()
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9
        self.killed.set()


class Closed:
    def is_closing(self) -> bool:
        return True


async def test_every_worker_that_does_not_stop_is_killed_within_one_deadline(tmp_path, monkeypatch):
    """Stragglers were waited for one after the other, each for the grace and 5 s, inside the daemon's own limit
    of the grace and 10 s: the second was never killed (left serving, its last counts unreported)."""
    monkeypatch.setattr(processes, "STOP_EXTRA_S", 1.0)
    workers = GatewayWorkers(config(tmp_path, 18000), None)
    procs = [Stuck(100 + i) for i in range(1, 4)]
    workers.workers = {i: Worker(i, p, Closed(), None, 0.0) for i, p in enumerate(procs, 1)}
    # the daemon's limit is the grace and 10 s, a worker's the grace and 5: here 1.8 s against 1 s (in turn, three
    # would take 3 s)
    await asyncio.wait_for(workers.stop(0), 1.8)
    assert all(p.returncode == -9 for p in procs)


class Piped:
    """A worker's end of the socket pair: it hears the "stop" (then exits after ``ends_s``, its streams done, unless
    ``ends_s`` is None: it hangs) and sends nothing until it exits."""

    def __init__(self, proc: Stuck, ends_s: float | None):
        self.proc, self.ends_s, self.told, self.eof = proc, ends_s, [], asyncio.Event()
        self.proc.killed = self.eof   # (killed or exited: its socket closes)

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.told.append(pickle.loads(data[4:])["t"])
        if self.told[-1] == "stop" and self.ends_s is not None:
            asyncio.get_running_loop().call_later(self.ends_s, self.exit)

    def exit(self) -> None:
        if self.proc.returncode is None:
            self.proc.returncode = 0
            self.eof.set()

    def close(self) -> None:
        pass

    async def readexactly(self, n: int) -> bytes:
        await self.eof.wait()
        raise asyncio.IncompleteReadError(b"", n)


def late_worker(tmp_path, monkeypatch, extra_s: float, pid: int, ends_s: float | None):
    """Workers whose next start (a worker that died, started again) is up once ``up`` is set: (workers, up, the
    new worker's process, its pipe); a stop kills workers ``extra_s`` after its grace."""
    monkeypatch.setattr(processes, "STOP_EXTRA_S", extra_s)
    sink = type("Sink", (), {"receive": lambda self, r: None, "retire": lambda self, p: None})()
    workers = GatewayWorkers(config(tmp_path, 18000), sink)
    up, late = asyncio.Event(), Stuck(pid)
    pipe = Piped(late, ends_s)

    async def spawn(process: int) -> Worker:
        await up.wait()
        return Worker(process, late, pipe, pipe, time.monotonic())
    workers._spawn = spawn
    return workers, up, late, pipe


@pytest.mark.parametrize("ends_s", [0.3, None])
async def test_a_worker_started_again_as_the_daemon_stops_is_stopped_too(tmp_path, monkeypatch, ends_s):
    """A worker that died was being started again (seconds of Python start-up) as the stop began: stop() told and
    waited for only the workers it had, the new one was never told, waited for or killed (nor taken for hung):
    it served on after the others closed their listeners (every new connection went to it) until the daemon
    exited, and its usage was lost.  It is told to stop as it is up, stop() waits for it, and it is killed at the
    same deadline as the others."""
    workers, up, late, pipe = late_worker(tmp_path, monkeypatch, 1.0, 201, ends_s)
    watch = asyncio.create_task(workers.watch(1))   # worker 1 died: started again
    await asyncio.sleep(0.05)
    workers.closing()
    stop = asyncio.create_task(workers.stop(0))
    await asyncio.sleep(0.05)
    up.set()
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.shield(stop), 3)
    assert late.returncode == (0 if ends_s else -9), "stop() returned with the new worker still there"
    await asyncio.wait_for(watch, 1)
    assert pipe.told == ["stop"] and time.monotonic() - t0 < (0.3 + 0.5 if ends_s else 1.5)


async def test_a_worker_up_only_after_the_stops_deadline_is_killed_as_it_is_up(tmp_path, monkeypatch):
    """(a start slower than the grace and STOP_EXTRA_S: stop() gave up waiting for it; its watch kills it)"""
    workers, up, late, pipe = late_worker(tmp_path, monkeypatch, 0.2, 202, None)
    watch = asyncio.create_task(workers.watch(1))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(workers.stop(0), 1)
    up.set()
    await asyncio.wait_for(watch, 1)
    assert late.returncode == -9 and pipe.told == ["stop"]


async def test_a_worker_that_stops_reporting_is_killed_and_started_again(tmp_path, monkeypatch):
    """A worker whose event loop stopped (SIGSTOP, a stuck handler) kept its share of the clients' connections
    hanging and its last report forever (drains waited their whole timeout, scale-downs never came): one silent
    for SILENT_S is killed, and another started."""
    import os
    import signal

    from conftest import free_port

    async def wait_for_async(pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)
    monkeypatch.setattr(processes, "SILENT_S", 1.5)
    received: list = []
    sink = type("Sink", (), {"receive": lambda self, r: received.append(r), "retire": lambda self, p: None})()
    workers = GatewayWorkers(config(tmp_path, free_port(), host="127.0.0.1", shutdown_grace_s=0,
                                    worker_restart_base_s=0.1), sink)
    assert await workers.start()
    tasks = [asyncio.create_task(coro, name=name) for name, coro in workers.root_tasks()]
    try:
        first = workers.workers[1].proc.pid
        await wait_for_async(lambda: len(received) >= 4, 15, "reports from both workers")
        os.kill(first, signal.SIGSTOP)
        await wait_for_async(lambda: 1 in workers.workers and workers.workers[1].proc.pid != first, 20,
                             "the silent worker replaced")
        assert workers.restarts == 1 and workers.workers[2].proc.returncode is None
    finally:
        workers.closing()
        await workers.stop(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_worker_started_after_the_code_changed_under_the_daemon_says_so(tmp_path, caplog):
    """A worker started again after an upgrade under the running daemon read the daemon's pickled config and
    routing tables as the new code's classes (a field added to the contract: objects without it, or fields
    shifted).  It compares the daemon's code fingerprint with its own first, and refuses with a message that says
    what to do; with the same code it starts."""
    from conftest import free_port
    workers = GatewayWorkers(config(tmp_path, free_port(), host="127.0.0.1"), None)
    assert workers.code == processes.code_fingerprint()
    workers.code = "0" * 64   # (what a daemon started before the change would have)
    with caplog.at_level(logging.ERROR, "slurmfleet.workers"):
        try:
            await workers._spawn(1)
            raise AssertionError("the worker started")
        except RuntimeError as exc:
            assert processes.CODE_CHANGED in str(exc) and "restart the daemon" in str(exc)
    workers.code = processes.code_fingerprint()
    w = workers.workers[1] = await workers._spawn(1)
    try:
        assert w.proc.returncode is None
    finally:
        await workers.stop(0.5)
    assert w.proc.returncode is not None


async def test_workers_run_the_daemons_copy_of_the_package_whatever_their_folder(tmp_path, monkeypatch):
    """Workers were started with ``python -m`` in the daemon's folder, which puts that folder first on their path:
    a daemon started from a checkout of another version ran its workers on the checkout's package."""
    from conftest import free_port
    other = tmp_path / "checkout" / "orchestrator"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('the checkout, not the daemon')\n")
    monkeypatch.chdir(other.parent)
    workers = GatewayWorkers(config(tmp_path, free_port(), host="127.0.0.1"), None)
    w = workers.workers[1] = await workers._spawn(1)
    try:
        assert w.proc.returncode is None
    finally:
        await workers.stop(0.5)
