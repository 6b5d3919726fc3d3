"""Wiring: build every part once, run the named root tasks, shut down within a bound.

The fleet side (reconciler, engine scraper) publishes routing tables through a
:class:`~orchestrator.fleet.publisher.TablePublisher` to one gateway sink: the gateway in this process
(``gateway.workers: 1``) or the gateway worker processes; every gateway process's report lands in one
:class:`~orchestrator.fleet.reports.ReportHub` that drains, ``/metrics`` and status read.

Root tasks (each named, guarded, logged): ``reconcile`` (the control loop), ``autoscale`` (load samples and replica
targets of autoscaled models), ``scrape`` (engine metrics), ``signals`` (SIGHUP reloads, SIGTERM/SIGINT stop)
and one per gateway worker.  A root task that dies takes the daemon down cleanly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web

from .auth import KeySet
from .autoscaleconf import advisories
from .batches import BatchStore
from .batchfiles import FileStore
from .config import FleetConfig
from .configchecks import dial_host
from .configdiff import settings_changes
from .fleetfile import parse_config
from .fleet import preflight
from .fleet.admin import Admin, ensure_admin_key
from .fleet.batcharray import ArrayBatch
from .fleet.batchrun import BatchRunner
from .fleet.discovery import Discovery
from .fleet.elastic import Elastic
from .fleet.exitcancel import cancel_fleet_jobs
from .fleet.lastwrite import LastWrite
from .fleet.onloop import on_loop
from .fleet.probe import Prober
from .fleet.publisher import TablePublisher
from .fleet.reconciler import NodeMemory, Reconciler, Submitting
from .fleet.render import Renderer
from .fleet.reports import ReportHub
from .fleet.slurm import CliSlurm
from .fleet.tenancy import Tenancy
from .fleet.usage import UsageLedger
from .gateway.http import raise_open_files_limit
from .gateway.local import LocalGateway
from .gateway.processes import GatewayWorkers
from .observability.metrics import FreeSpace, Metrics, storage_stats
from .observability.scrape import EngineScraper
from .observability.status import fleet_status
from .procgc import settle
from .tlsfiles import ServerTls, scheme
from .statedir import StateDir, StateDirBusy, StateDirShared
from .yamlsrc import ConfigError, load_file

log = logging.getLogger("slurmfleet")
COLD_START_TICK_S = 1.0   # the tick interval, at most, while a request is held for a model with no READY replica
SCALE_WAIT_S = 5.0   # a scale waits this long for a reload being applied, then is refused (503: retry)


# settings a running daemon keeps until it restarts: a reload that changes one is refused, naming it
RESTART_ONLY = (("fleet",), ("state_dir",), ("gateway", "host"), ("gateway", "port"), ("gateway", "workers"),
                ("gateway", "shutdown_grace_s"), ("gateway", "keepalive_timeout_s"), ("gateway", "header_timeout_s"),
                ("gateway", "max_connections"), ("gateway", "tls"), ("daemon", "admin_host"), ("daemon", "admin_port"),
                ("daemon", "admin_tls"), ("cluster", "slurm_conf"))   # (another cluster's squeue: all resubmitted)


def _digest(cfg: FleetConfig) -> str:
    """The config's identity, for what must not outlive it (``slurmfleet scale`` pins)."""
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()


def _get(cfg, path: tuple[str, ...]):
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


class Daemon:
    def __init__(self, config_path: str | Path, cfg: FleetConfig, *, cancel_jobs_on_exit: bool = False,
                 scale_overrides: dict[str, int] | None = None, settle_gc: bool = False):
        self.scale_overrides, self.settle_gc = dict(scale_overrides or {}), settle_gc
        self.config_path = str(config_path)
        self.cfg = cfg
        self.cancel_jobs_on_exit = cancel_jobs_on_exit
        self.cancel_deadline_s = 20.0   # for those: a squeue (half of it at most) and all the scancels, together
        self.stop, self.hup = asyncio.Event(), asyncio.Event()   # (SIGTERM/SIGINT, SIGHUP)
        self.wake = asyncio.Event()
        self.hub = ReportHub(on_urgent=self._held)
        self.metrics = Metrics(request_stats=self.hub.stats_snapshots)
        self.free_space = FreeSpace(Path(cfg.state_dir))   # the state dir's, sampled by the scrape loop (never on a scrape)
        self.exit_code = 0
        self.batch_key = secrets.token_urlsafe(32)   # the batch runner's key at the gateway, new every start
        self.reloading = asyncio.Lock()
        self.admin: Admin | None = None
        cfg.gateway._batch_key = self.batch_key

    async def reload(self) -> dict:
        """Re-read the config file, apply it as a diff (a problem leaves the fleet as it was), one at a time."""
        async with self.reloading:
            return await self.metrics.recorded_reload(self._reload())

    async def _reload(self) -> dict:
        try:
            src = await asyncio.to_thread(load_file, self.config_path)
            cfg = await asyncio.to_thread(parse_config, src)   # (a keys file on a slow file system: off the loop)
            for path in RESTART_ONLY:
                new, old = _get(cfg, path), _get(self.cfg, path)
                if new != old:
                    raise ConfigError([src.problem(path, f"cannot change on reload (running with {old!r}); "
                                                         "restart the daemon")])
            warnings = await preflight.vet_reload(self.slurm, self.reconciler.renderer, self.cfg, cfg, src)
            for w in (found := advisories(cfg.models, cfg.gateway.workers)):
                log.warning("%s", w)
            warnings += found
        except ConfigError as exc:
            for p in exc.problems:
                log.error("reload rejected, fleet unchanged: %s", p)
            return {"ok": False, "invalid": True, "errors": [str(p) for p in exc.problems]}
        except Exception as exc:  # noqa: BLE001 - whatever the file did, the running fleet stays
            log.exception("reload rejected, fleet unchanged")
            return {"ok": False, "invalid": False, "errors": [f"{self.config_path}: {type(exc).__name__}: {exc}"]}
        cfg.gateway._batch_key = self.batch_key
        if self.admin is not None:   # a key taken out of daemon.admin_api_keys no longer opens the admin API
            self.admin.keys = KeySet(ensure_admin_key(StateDir(cfg.state_dir), cfg.daemon.admin_api_keys,
                                                      os.environ.get("SLURMFLEET_ADMIN_KEY")))
            self.admin.metrics_keys = KeySet(cfg.daemon.metrics_api_keys)
            self.admin.reload_tls(cfg.gateway)   # (daemon.admin_tls: a certificate renewed in place)
        try:   # (pins dropped: the file is the truth again; an unwritable state dir must not half-apply the reload)
            await self._save_pins(cfg, {})
        except OSError as exc:
            log.error("could not remove the scale pins of %s: %s", cfg.state_dir, exc)
        changes = settings_changes(self.cfg, cfg) + self.reconciler.apply_config(cfg)
        self.gateway.set_config(cfg)
        self.tenancy.set_config(cfg)
        self.slurm.timeout_s = self.reconciler.discovery.timeout_s = cfg.cluster.command_timeout_s
        self.batches.timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.gateway.connect_timeout_s)
        self.cfg = cfg
        for c in changes:
            log.info("reload: %s", c)
        log.info("reload applied (%d changes)", len(changes))
        self.wake.set()
        return {"ok": True, "config": self.config_path, "changes": changes,
                **({"warnings": warnings} if warnings else {})}

    async def run(self) -> int:
        state = StateDir(self.cfg.state_dir)
        try:
            state.create()
            lock = state.lock()
        except (StateDirBusy, StateDirShared) as exc:
            log.error("%s", exc)
            return 1
        loop, threads = asyncio.get_running_loop(), ThreadPoolExecutor(thread_name_prefix="slurmfleet")
        loop.set_default_executor(threads)   # (to_thread's)
        # from the start (a SIGHUP or SIGTERM while the workers started ended it): reload once serving, stop once started
        for sig, event in ((signal.SIGHUP, self.hup), (signal.SIGTERM, self.stop), (signal.SIGINT, self.stop)):
            loop.add_signal_handler(sig, self._signalled, sig, event)
        try:
            return await self._serve(state)
        finally:
            if lock is not None and not getattr(getattr(self, "last_write", None), "left_behind", False):
                os.close(lock)   # (a write left behind keeps it to the process's end: no daemon starts beside it)
            # asyncio.run's end would wait for these threads for ever (a GPU file on a hung NFS): exit_bounded does
            loop.set_default_executor(ThreadPoolExecutor(1))
            threads.shutdown(wait=False, cancel_futures=True)

    async def _serve(self, state: StateDir) -> int:
        cfg = self.cfg
        soft, hard = raise_open_files_limit()
        log.info("open-files limit %d (hard %d)", soft, hard)
        for w in advisories(cfg.models, cfg.gateway.workers):
            log.warning("%s", w)
        gw = cfg.gateway
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, ssl=False)   # (its gateway's)
        timeout = aiohttp.ClientTimeout(total=gw.request_timeout_s, sock_connect=gw.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            self.slurm = CliSlurm(cfg.job_name, cfg.cluster.slurm_conf, cfg.cluster.command_timeout_s,
                                  observer=self.metrics.observe_slurm)
            if gw.workers > 1:  # the daemon holds no gateway objects: the workers serve every client
                self.gateway = GatewayWorkers(cfg, self.hub, on_restart=self.metrics.worker_restarts.inc)
            else:
                self.gateway = LocalGateway(cfg, self.config_path, self.hub)
                self.hub.attach(0, self.gateway.report)
            self.metrics.gateway_processes.set_function(lambda: self.gateway.processes)
            self.publisher = TablePublisher(self.gateway, self.hub)
            ledger, loop = UsageLedger(state.root / "usage.sqlite3", spool=state.usage_spool), asyncio.get_running_loop()
            self.tenancy = Tenancy(cfg, self.hub, ledger, self.publisher.on_allowances)
            self.last_write = LastWrite(self.tenancy, ledger)   # (the ledger's at shutdown: off the loop, bounded)
            self.metrics.key_usage = lambda: self.tenancy.key_usage(self.hub.reports())
            self.metrics.storage = lambda: storage_stats(self.free_space, ledger, self.cfg.batches.min_free_bytes)
            renderer, discovery = Renderer(), Discovery(state, cfg.cluster.command_timeout_s)
            submitting = Submitting(state.submitting, cfg.daemon.submit_confirm_s, io=discovery)   # (its I/O thread)
            self.reconciler = Reconciler(cfg, self.slurm, renderer, discovery, Prober(session), self.metrics,
                                         inflight=self.hub.inflight, on_update=self.publisher.on_routes, submitting=submitting,
                                         nodes=NodeMemory(state.nodes, discovery.pool))
            host = dial_host(gw.host)
            files = FileStore(state.files)
            files.drop_uploads()   # (its gateway processes' uploads in progress ended with the last daemon)

            def dedicated(rec: dict, output: Path, errors: Path) -> ArrayBatch:
                c = self.cfg
                model = c.model((rec.get("models") or [""])[0])
                if model is None:
                    raise ValueError(f"model {(rec.get('models') or [''])[0]!r} is not in the fleet any more")

                def lines():   # opened only when the input is split (not again after a restart)
                    yield from files.open_lines(rec["input_file_id"])
                return ArrayBatch(rec, c, model, lines(),
                                  state.root / "batches" / f"{rec['id']}.array", output, errors, self.slurm,
                                  rec["shards"], c.batches.max_parallel_shards, c.batches.max_task_retries,
                                  c.batches.shard_poll_s, renderer=renderer)
            self.batches = BatchRunner(
                BatchStore(state.root / "batches"), files,
                url=lambda: f"{scheme(gw)}://{host}:{self.gateway.port}", secret=self.batch_key, session=session,
                table=lambda: self.publisher.table, queued=self.hub.queued,
                max_inflight=lambda m: (self.cfg.model(m).max_inflight_per_replica if self.cfg.model(m) else 1),
                kv_high=lambda: self.cfg.batches.kv_high_ratio, dedicated=dedicated,
                slots=lambda name: getattr(self.cfg.model(name), "engine_slots", None),   # (none: a removed model)
                charge=lambda ref, owner, model, counts, write=True: on_loop(loop, lambda: ledger.charge_upto(
                    ref, owner, self.tenancy.ledger_groups.get(owner), model, counts, write), False),   # (a batch's
                # end runs in a thread: the ledger's counters and charges are the loop's; False: not written now)
                budget=self.tenancy.budget_left, refusal=self.tenancy.owner_refusal,
                in_fleet=lambda m: self.cfg.model(m) is not None,
                connect_timeout_s=gw.connect_timeout_s, cancel_job=self.slurm.cancel,
                batch_jobs=lambda bid: self.slurm.list_array_tasks(f"{self.cfg.job_name}-{bid}"),
                retention_s=lambda: self.cfg.batches.retention_s)
            self.metrics.batch_stats = self.batches.stats
            self.elastic = Elastic(self.reconciler, self.hub, lambda: self.publisher.table, self.metrics,
                                   wake_fleet=self.wake.set, batch_pending=self.batches.pending)
            for model, n in {**state.load_pins(_digest(cfg)), **self.scale_overrides}.items():
                if cfg.model(model) is not None:   # (`slurmfleet scale` pins of a run killed on this config)
                    self.reconciler.scale(model, n)
            self.scraper = EngineScraper(
                session, self.metrics, targets=lambda: [r for m in self.publisher.table.models.values()
                                                        for r in m.replicas],
                on_loads=self.publisher.on_loads, state=state, running=lambda: [
                    (f.job_id, f.model, f.slot) for f in self.reconciler.replicas.values() if f.slurm_state == "RUNNING"])
            keys = ensure_admin_key(state, cfg.daemon.admin_api_keys, os.environ.get("SLURMFLEET_ADMIN_KEY"))
            admin = self.admin = Admin(keys, self.metrics, status=lambda: fleet_status(
                              self.reconciler, self.hub, self.publisher.loads, gpus=self.metrics.gpus,
                              gateway={"processes": self.gateway.processes, "worker_restarts": self.gateway.restarts},
                              last_reload=self.metrics.last_reload),
                          reload=self.reload, drain=self._drain, scale=self._scale,
                          metrics_keys=cfg.daemon.metrics_api_keys, tls=ServerTls(gw, cfg.daemon.admin_tls))
            admin_runner = web.AppRunner(admin.app(), access_log=None, shutdown_timeout=2.0)
            await admin_runner.setup()
            try:
                await web.TCPSite(admin_runner, cfg.daemon.admin_host, cfg.daemon.admin_port, reuse_address=True,
                                  ssl_context=admin.tls.context).start()
            except OSError as exc:
                log.error("cannot listen on %s:%d (daemon.admin_port in %s): %s", cfg.daemon.admin_host,
                          cfg.daemon.admin_port, self.config_path, exc.strerror)
                await admin_runner.cleanup()
                return 1
            self.tenancy.turn()   # (the workers' first table says which keys' budgets are spent)
            if not await self.gateway.start():
                if gw.workers > 1:
                    log.error("cannot start the gateway workers on %s:%d (gateway.port in %s)", gw.host, gw.port,
                              self.config_path)
                await admin_runner.cleanup()
                return 1
            roots = [("reconcile", self._reconcile_loop()), ("autoscale", self.elastic.run()),
                     ("scrape", self._scrape_loop()), ("tenancy", self.tenancy.run()), ("batches", self.batches.run()),
                     ("signals", self._signals())]
            log.info("gateway on http://%s:%d (%d process%s), admin on http://%s:%d, %d models", gw.host, gw.port, gw.workers,
                     "es" if gw.workers > 1 else "", cfg.daemon.admin_host, cfg.daemon.admin_port, len(cfg.models))
            if self.settle_gc:   # (this process's own daemon: what its start built lives as long as it)
                settle()
            tasks = {asyncio.create_task(self._guard(name, coro), name=name) for name, coro in roots}
            # the gateway workers' tasks run on until their processes end (they carry the last reports)
            gateway_tasks = {asyncio.create_task(self._guard(name, coro), name=name)
                             for name, coro in self.gateway.root_tasks()}
            await self.stop.wait()
            log.info("shutting down: gateway stops accepting, open streams get %.0fs", gw.shutdown_grace_s)
            t0 = time.monotonic()
            self.gateway.closing()
            # the usage of the streams that end in the grace is written down as they end (a SIGKILL that cuts
            # the grace short loses only the last seconds): the tenancy loop stops after the gateway
            tenancy = {t for t in tasks if t.get_name() == "tenancy"}
            stop_s = self.cfg.daemon.task_stop_timeout_s
            await self._stop_tasks(tasks - tenancy, stop_s)
            try:
                await asyncio.wait_for(self.gateway.stop(gw.shutdown_grace_s), gw.shutdown_grace_s + 10)
            except asyncio.TimeoutError:
                log.error("gateway did not close within %.0fs", gw.shutdown_grace_s + 10)
            if gateway_tasks:
                done, pending = await asyncio.wait(gateway_tasks, timeout=stop_s)
                for t in pending:
                    t.cancel()
            await self._stop_tasks(tenancy, stop_s)
            await admin_runner.cleanup()   # (first: its /metrics and a reload read the ledger being written)
            await self.last_write.stop(stop_s)   # the last counts of every gateway process, written down
            if self.cancel_jobs_on_exit:
                await self._cancel_all()
            else:
                log.info("leaving %d jobs running for the next start to adopt", len(self.reconciler.replicas))
            discovery.close()
            log.info("stopped in %.1fs", time.monotonic() - t0)
        return self.exit_code

    @staticmethod
    async def _stop_tasks(tasks: set[asyncio.Task], stop_s: float) -> None:
        for t in tasks:
            t.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=stop_s)
            for t in pending:
                log.error("root task %s did not stop within %.0fs", t.get_name(), stop_s)

    def _held(self) -> None:
        """A gateway process holds a request for a model with no READY replica: the autoscaler samples now (a
        cold start's sbatch), and the reconcile loop ticks now and then every second (its replica's start is
        seen at once, whether a target moved or not: a replica already starting, a model not autoscaled)."""
        self.elastic.poke()
        self.wake.set()

    async def _drain(self, job_id: str, replace: bool = False) -> str | None:
        ok = await self.reconciler.request_drain(job_id, replace)
        self.wake.set()
        return ok

    async def _save_pins(self, cfg: FleetConfig, pins: dict[str, int]) -> None:
        """The pins written (fsynced) off the event loop; OSError past the command timeout (a hung state dir)."""
        t = cfg.cluster.command_timeout_s
        try:
            await asyncio.wait_for(asyncio.to_thread(StateDir(cfg.state_dir).save_pins, _digest(cfg), pins), t)
        except asyncio.TimeoutError:
            raise OSError(f"{cfg.state_dir} did not answer within {t:.0f}s (the pins may land later)") from None

    async def _scale(self, name: str, n: int | None) -> str:   # (a served name or an alias: the served name)
        async with asyncio.timeout(SCALE_WAIT_S):   # (TimeoutError: a 503, "retry"; the CLI waits longer)
            await self.reloading.acquire()   # (one sent while a reload waits on SLURM: after it, not dropped by it)
        try:
            if (model := next((m.name for m in self.cfg.models if name in m.served_names), None)) is None:
                raise KeyError(name)
            pins = {m.name: p for m in self.cfg.models
                    if (p := n if m.name == model else self.reconciler.runtime(m.name).desired_override) is not None}
            await self._save_pins(self.cfg, pins)   # durable before the answer
            self.reconciler.scale(model, n)
        finally:
            self.reloading.release()
        self.elastic.poke()
        self.wake.set()
        return model

    async def _guard(self, name: str, coro) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            log.debug("root task %s cancelled", name)
            raise
        except Exception:
            log.exception("root task %s crashed; stopping the daemon", name)
            self.exit_code = 1
            self.stop.set()

    async def _reconcile_loop(self) -> None:
        while True:
            t0 = time.monotonic()
            self.wake.clear()   # before the tick: a wake during it (a cold start, a reload) starts the next at once
            try:
                await self.reconciler.tick()
            except Exception:  # one bad tick must not kill the loop; the next tick heals
                log.exception("reconcile tick failed")
            try:   # (not wait_for: on 3.11 it drops a cancel that meets the wake, and the loop went on)
                async with asyncio.timeout(max(0.0, self._tick_interval() - (time.monotonic() - t0))):
                    await self.wake.wait()
            except TimeoutError:
                pass

    def _tick_interval(self) -> float:
        """The tick interval, or at most ``COLD_START_TICK_S`` while a request is held for a model with no READY
        replica: its replica's start (RUNNING, endpoint, first good probe) is seen within a second, not a tick."""
        interval = self.cfg.daemon.tick_interval_s
        held = [m for m, q in self.hub.queued().items() if q.depth] if interval > COLD_START_TICK_S else []
        if held and any(not self.publisher.table.ready(m) for m in held):
            return COLD_START_TICK_S
        return interval

    async def _scrape_loop(self) -> None:
        while True:
            try:
                self.free_space.sample()
                await self.scraper.scrape_once()
            except Exception:  # one bad scrape (a GPU file, a full descriptor table) must not stop the daemon
                log.exception("engine/GPU scrape failed")
            await asyncio.sleep(min(5.0, self.cfg.daemon.tick_interval_s))

    def _signalled(self, sig: int, event: asyncio.Event) -> None:
        """A second SIGTERM or SIGINT ends the process now, without its orderly stop, once the usage its gateway
        processes reported is written down (what workers serve after it they spool as they end, as after a KILL)."""
        if sig != signal.SIGHUP and self.stop.is_set():
            log.warning("%s again: exiting now, without waiting for the orderly stop", signal.Signals(sig).name)
            if (last := getattr(self, "last_write", None)) is not None:   # (the reports in, one transaction)
                last.now(self.cfg.daemon.task_stop_timeout_s)
            asyncio.get_running_loop().remove_signal_handler(sig)
            signal.raise_signal(sig)
        event.set()

    async def _signals(self) -> None:
        while True:
            await self.hup.wait()
            self.hup.clear()
            log.info("SIGHUP: reloading %s", self.config_path)
            try:
                await self.reload()
            except Exception:  # noqa: BLE001 - a reload that failed while applying must not stop the daemon
                log.exception("reload failed")

    async def _cancel_all(self) -> None:
        await cancel_fleet_jobs(self.reconciler, self.slurm, self.cfg, self.cancel_deadline_s)
