"""The daemon's own settings: its control loop, admin API and housekeeping (:class:`DaemonConfig`), and its
batch runner (:class:`BatchesConfig`).  Re-exported by :mod:`orchestrator.config`, where the whole schema is."""

from __future__ import annotations

from pydantic import Field

from .keys import Host, Secret, Strict


class DaemonConfig(Strict):
    """The control loop and the admin API."""

    tick_interval_s: float = Field(5.0, gt=0)
    admin_host: Host = "127.0.0.1"
    admin_port: int = Field(8081, ge=1, le=65535)   # (not 0, any free port: the CLI could never find it)
    admin_tls: bool = False
    """The admin API and ``/metrics`` over HTTPS, with ``gateway.tls``'s certificate (which it needs); the CLI
    then trusts that certificate.  A reload loads it again, as the gateway's."""
    admin_api_keys: list[Secret] = Field(default_factory=list)
    """Admin keys (plain or ``sha256:<hex>``); the env var SLURMFLEET_ADMIN_KEY adds one."""
    metrics_api_keys: list[Secret] = Field(default_factory=list)
    """Scrape keys (plain or ``sha256:<hex>``): with any set, ``/metrics`` asks for one of them or an admin key
    (they open nothing else); none (the default): ``/metrics`` is open to whoever reaches the admin port."""
    submit_confirm_s: float = Field(120.0, gt=0)
    """How long a submission whose sbatch failed oddly is awaited in squeue before it is retried."""
    rescancel_after_s: float = Field(30.0, gt=0)
    """A job SLURM still shows RUNNING this long after its scancel is cancelled again."""
    task_stop_timeout_s: float = Field(5.0, gt=0)
    """At shutdown, how long each root task (reconcile, scrape, ...) gets to stop after its cancel, and the usage
    ledger's last write (:mod:`orchestrator.fleet.lastwrite`)."""
    log_retention_s: float = Field(7 * 86400.0, ge=0)
    """A replica job's log (``<state_dir>/logs``) is removed once the job has left squeue and the file has not
    changed for this long (7 days; 0: logs are never removed)."""


class BatchesConfig(Strict):
    """Batch inference: the Batch API's runner (shared mode) and batches run as their own job arrays."""

    kv_high_ratio: float = Field(0.9, gt=0, le=1)
    """Shared mode: a batch's concurrency halves while a replica's KV cache use is above this."""
    max_parallel_shards: int | None = Field(None, ge=1)
    """Dedicated mode: tasks of a batch's job array running at once (the ``%`` limit); default all its shards."""
    max_shards_per_key: int = Field(1000, ge=0)
    """Dedicated mode: the array tasks one key's unfinished dedicated batches may have in all (1000: one batch
    of the most shards; 0: no key runs one unless its own ``max_shards`` lets it).  A batch past it is a 400."""
    max_task_retries: int = Field(2, ge=0)
    """Dedicated mode: a shard whose task ended without its output is run again this many times at most."""
    shard_poll_s: float = Field(5.0, gt=0)
    """Dedicated mode: how often squeue is asked about a batch's tasks."""
    retention_s: float = Field(30 * 86400.0, ge=0)
    """An ended batch's record (what ``GET /v1/batches`` lists) is removed this long after its end (30 days; 0:
    kept for ever).  Its output and error files are files of their own, kept until deleted or expired."""
    max_file_bytes_per_key: int = Field(100 * 1024 ** 3, ge=0)
    """The bytes one key's stored files (``/v1/files``, its batches' outputs included) may take in all: an upload
    that would pass it is refused (400 ``storage_limit_exceeded``); the batch runner's outputs are never refused,
    but count (100 GiB; 0: no limit).  Files past their expiry do not count."""
    file_expiry_s: int = Field(30 * 86400, ge=0)
    """An uploaded batch input file's ``expires_at`` when its upload asks none (``expires_after``): OpenAI's 30
    days (a client written for OpenAI never deletes them; 0: kept until deleted).  Expired, a file is not found,
    and removed once no batch reads it."""
    max_files_per_key: int = Field(10_000, ge=0)
    """The files one key may store (the same way: outputs count, only uploads are refused; 10,000; 0: no limit)."""
    min_free_bytes: int = Field(1024 ** 3, ge=0)
    """An upload is refused (507 ``insufficient_storage``) when it would leave less than this free on the state
    dir's file system, which the whole fleet's records share (1 GiB; 0: only a full disk refuses)."""
