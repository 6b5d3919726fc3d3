"""Named API keys (tenants), priority classes and the gateway's config.

A client key is configured in ``gateway.api_keys`` or in ``gateway.api_keys_file``, as a plain string
(the secret, or ``sha256:<hex>``) or as a :class:`KeyPolicy` mapping that names it and sets its limits,
models and priority class.  :meth:`GatewayConfig.keys` returns every key resolved (name and priority
filled in); :mod:`orchestrator.keysfile` reads a keys file and checks keys across the fleet.  A group's shared
budget is a :class:`GroupPolicy`.  :func:`period_start` and :func:`period_end` bound the UTC calendar periods of
token budgets.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (AfterValidator, AwareDatetime, BaseModel, ConfigDict, Discriminator, Field, IPvAnyNetwork,
                      NonNegativeInt, PrivateAttr, Tag, ValidationInfo, field_validator, model_validator)

from .auth import key_digest
from .configchecks import FieldError

HOST_RE = r"^[A-Za-z0-9:][A-Za-z0-9.:-]*$"   # an address (IPv4, IPv6 unbracketed) or a host name
KEY_NAME_RE = r"^[A-Za-z0-9_.-]{1,64}$"
ANONYMOUS = "anonymous"   # the one tenant of a gateway without keys
BATCHES = "_batches"      # the fleet's batch runner's tenant
RESERVED_NAMES = (ANONYMOUS, BATCHES)
BATCH_OWNER = "x-slurmfleet-batch-owner"   # the batch runner's header: whose batch a line is (usage is theirs)
Period = Literal["hour", "day", "week", "month"]
PERIODS: tuple[str, ...] = get_args(Period)
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")   # a browser's Origin
DEFAULT_PRIORITY_CLASSES = ("high", "normal", "low")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class Strict(BaseModel):
    """The base of every config model: unknown fields are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)   # (.inf s: a job never rendered)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: Any) -> Any:
        """``gpus_per_node: false`` is not 0 GPUs, nor ``replicas: true`` 1 replica: a number field refuses
        true and false (pydantic's lax mode reads them as 1 and 0).  A section left empty (``probe:``, its lines
        commented out: YAML's null) is that section's defaults, not "Input should be a valid dictionary"."""
        if isinstance(data, Mapping):
            empty = [n for n, f in cls.model_fields.items() if n in data and data[n] is None
                     and isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]
            data = {k: v for k, v in data.items() if k not in empty} if empty else data
            for name, f in cls.model_fields.items():
                if not isinstance(data.get(name), bool):
                    continue
                kinds = {get_args(k)[0] if get_origin(k) is Annotated else k   # (PositiveInt | None's int too)
                         for k in get_args(f.annotation) or (f.annotation,)}
                if bool not in kinds and {int, float} & kinds:
                    raise FieldError(name, f"{name} must be a number, not {str(data[name]).lower()}")
        return data


def _check_secret(v: str) -> str:
    if not v:
        raise ValueError("a key may not be empty")
    if v != v.strip():   # (HTTP drops a header value's surrounding spaces: such a key never matches)
        raise ValueError("a key may not start or end with spaces")
    if re.match(r"(?i)sha-?256\s*:", v) and not v.startswith("sha256:"):   # (else a plain key: the digest's own
        raise ValueError("a key's digest is written sha256:<hex>, in lowercase")   # text would open it, the key not)
    if v.startswith("sha256:") and not _SHA256.fullmatch(v[7:]):
        raise ValueError("sha256: must be followed by the 64 hex digits of the key's SHA-256")
    return v


Secret = Annotated[str, AfterValidator(_check_secret)]


def _check_host(v: str) -> str:
    if ":" in v:   # (IPv6's colons, not a port's: 127.0.0.1:8000 matched the pattern)
        try:
            ipaddress.IPv6Address(v)
        except ValueError:
            raise ValueError(f"{v!r} is no address: a host name or an IPv4 or IPv6 address, the port in its own "
                             "field") from None
    return v


Host = Annotated[str, Field(pattern=HOST_RE), AfterValidator(_check_host)]   # not a URL, no port
KeyName = Annotated[str, Field(pattern=KEY_NAME_RE)]
PositiveInt = Annotated[int, Field(ge=1)]


def secret_digest(secret: str) -> str:
    """The SHA-256 hex of a configured key (plain, or given as ``sha256:<hex>``)."""
    return secret[7:].lower() if secret.startswith("sha256:") else key_digest(secret)


class KeyPolicy(Strict):
    """One client key: who it is, what it may use, how much, and how urgently it is served."""

    name: KeyName | None = None
    """Unique name (usage is counted by it); default ``key-`` and the first 8 hex digits of its SHA-256."""
    key: Secret
    """The secret: plain, or ``sha256:<hex>`` of it."""
    group: KeyName | None = None
    """A group the key's usage can be summed under (a team, a project)."""
    models: list[str] | None = Field(None, min_length=1)
    """Served names or aliases the key may use; default every model."""
    rpm: PositiveInt | None = None
    """Requests per minute at most."""
    tpm: PositiveInt | None = None
    """Tokens (prompt + completion) per minute at most."""
    max_concurrent: PositiveInt | None = None
    """Requests in flight at most."""
    budget_tokens: PositiveInt | None = None
    """Tokens (prompt + completion) per ``budget_period`` at most."""
    budget_period: Period = "day"
    """The budget's UTC calendar period (a week starts on Monday)."""
    priority: str | None = None
    """A class of ``gateway.priority_classes``; default ``gateway.default_priority``."""
    max_file_bytes: NonNegativeInt | None = None
    """Bytes the key's stored files (uploads, its batches' outputs) may take in all; default
    ``batches.max_file_bytes_per_key`` (0: no limit)."""
    max_files: NonNegativeInt | None = None
    """Files the key may store; default ``batches.max_files_per_key`` (0: no limit)."""
    max_shards: NonNegativeInt | None = None
    """SLURM array tasks the key's unfinished dedicated batches may have in all; default
    ``batches.max_shards_per_key`` (0: the key may run no dedicated batch)."""
    expires_at: AwareDatetime | None = None
    """When the key stops working (ISO 8601 with its zone: ``2027-01-31T23:59:59Z``), no reload needed: then a
    401 that says so; its batches stop as a revoked key's.  Default never."""

    @property
    def digest(self) -> str:
        """SHA-256 hex of the secret (lowercase)."""
        return secret_digest(self.key)

    def resolved(self, default_priority: str) -> KeyPolicy:
        """This key with its name and priority filled in."""
        if self.name is not None and self.priority is not None:
            return self
        return self.model_copy(update={"name": self.name or f"key-{self.digest[:8]}",
                                       "priority": self.priority or default_priority})


class GroupPolicy(Strict):
    """A group's shared token budget: every key whose ``group`` names it draws on it, beside its own limits."""

    budget_tokens: PositiveInt
    """Tokens (prompt + completion) the group's keys may use in all per ``budget_period``."""
    budget_period: Period = "day"
    """The budget's UTC calendar period (a week starts on Monday)."""


def as_policy(item: str | KeyPolicy) -> KeyPolicy:
    """A configured key item as a policy (a plain string is a key with no name and no limits)."""
    return item if isinstance(item, KeyPolicy) else KeyPolicy(key=item)


# an item of api_keys is a string or a mapping; the tags hold "[" so that errors leave them out of the field path
KeyItem = Annotated[Annotated[Secret, Tag("key[str]")] | Annotated[KeyPolicy, Tag("key[policy]")],
                    Discriminator(lambda v: "key[policy]" if isinstance(v, (Mapping, KeyPolicy)) else "key[str]")]


# -- UTC calendar periods -----------------------------------------------------------------------------------
def _start(period: str, t: datetime) -> datetime:
    if period == "hour":
        return t.replace(minute=0, second=0, microsecond=0)
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    raise ValueError(f"unknown period {period!r}; one of: {', '.join(PERIODS)}")


def period_start(period: str, now_epoch_s: float) -> float:
    """Start (epoch seconds) of the UTC calendar ``period`` (hour, day, week from Monday, month) holding now."""
    return _start(period, datetime.fromtimestamp(now_epoch_s, UTC)).timestamp()


def period_end(period: str, now_epoch_s: float) -> float:
    """End (epoch seconds, exclusive: the next period's start) of the period holding now."""
    s = _start(period, datetime.fromtimestamp(now_epoch_s, UTC))
    if period == "month":
        return (s.replace(year=s.year + 1, month=1) if s.month == 12 else s.replace(month=s.month + 1)).timestamp()
    return (s + {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(weeks=1)}[period]).timestamp()


# -- the gateway's config -----------------------------------------------------------------------------------
class TlsConfig(Strict):
    """HTTPS on the gateway's port: PEM files (the certificate with its chain, and its private key); a relative
    path is relative to the config file's directory.  Read at start and at each reload: a certificate renewed in
    place is served from the next reload on (turning TLS on or off takes a restart)."""

    cert_file: str
    key_file: str
    _paths: tuple[str, str] | None = PrivateAttr(None)   # (resolved by fleetfile.parse_config)


class GatewayConfig(Strict):
    """The OpenAI-compatible endpoint."""

    host: Host = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tls: TlsConfig | None = None
    """HTTPS for clients (none: plain HTTP, as behind a proxy that terminates TLS)."""
    priority_classes: list[KeyName] = Field(default_factory=lambda: list(DEFAULT_PRIORITY_CLASSES), min_length=1)
    """Priority classes, most urgent first; vLLM's per-request ``priority`` is a class's index (with a model's
    ``scheduling_policy: priority``)."""
    default_priority: str = Field("normal", validate_default=True)
    """The class of a key that names none (one of ``priority_classes``)."""
    api_keys: list[KeyItem] = Field(default_factory=list)
    """Client keys: a plain string (the key, or ``sha256:<hex>``) or a :class:`KeyPolicy` mapping.  Neither this
    nor a keys file set: no auth (set, even empty, a key is asked: see :attr:`open`)."""
    api_keys_file: str | None = None
    """More keys: one plain key per line (``#`` comments), or a YAML list of the same items as ``api_keys``;
    a relative path is relative to the config file's directory."""
    groups: dict[KeyName, GroupPolicy] = Field(default_factory=dict)
    """Budgets shared by the keys of a group (its keys' ``group``): name -> :class:`GroupPolicy`."""
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """A proxied request's body at most (a 413 past it): 32 MiB, room for a 25 MB audio file (vLLM's and
    OpenAI's limit for one) or a few base64 images; also a batch input's line at most."""
    queue_timeout_s: float = Field(30.0, ge=0)
    max_queue_per_model: int = Field(256, ge=0)
    request_timeout_s: float = Field(600.0, gt=0)
    """A replica's whole answer is due within this long, except a stream's (see ``stream_idle_timeout_s``)."""
    stream_idle_timeout_s: float = Field(120.0, gt=0)
    """A streamed answer (SSE) may run as long as it goes on: once its first bytes came, it fails only after
    this long without a byte while the client keeps up (a stuck engine), not at ``request_timeout_s`` (a long
    generation).  Before its first bytes (vLLM sends a stream's headers at once: its queue and the prefill
    come after them) ``request_timeout_s`` holds."""
    first_byte_timeout_s: float = Field(300.0, gt=0)
    """A replica that sends no response headers within this long is treated as hung (retried elsewhere)."""
    connect_timeout_s: float = Field(3.0, gt=0)
    max_retries: int = Field(2, ge=0, le=5)
    retry_budget_ratio: float = Field(0.1, ge=0, le=1)
    shutdown_grace_s: float = Field(30.0, ge=0)
    keepalive_timeout_s: float = Field(75.0, gt=0)
    """An idle keep-alive connection from a client is closed after this long."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A new client connection that has not sent a whole request head after this long is closed."""
    access_log: bool = True
    """One JSON line per request on the ``slurmfleet.access`` logger (INFO): its id, client, key name, model,
    replica, status, retries, time to first token and duration; false: none (the metrics count them)."""
    max_connections: int = Field(10_000, ge=16)
    """Client connections per gateway process; more are closed at once (never more than the open-files
    limit, raised to its hard value at start, minus 256 kept for replicas, files and subprocesses)."""
    eject_after_failures: int = Field(3, ge=1)
    """Consecutive failed requests after which a replica is ejected from routing (never more than half of
    a model's replicas at once)."""
    eject_base_s: float = Field(2.0, gt=0)
    """First ejection's length; each further ejection of the same replica doubles it..."""
    eject_max_s: float = Field(60.0, gt=0)
    """...up to this. A replica that served well for this long starts again from ``eject_base_s``."""
    worker_restart_base_s: float = Field(1.0, gt=0)
    """Back-off before restarting a gateway worker that died; doubles per death..."""
    worker_restart_max_s: float = Field(30.0, gt=0)
    """...up to this; a worker that lived a minute starts again from ``worker_restart_base_s``."""
    workers: int = Field(1, ge=1, le=64)
    """Gateway processes. 1: the daemon serves clients itself. More: that many worker processes share
    the port (SO_REUSEPORT, uvloop) and the daemon feeds them the READY replicas. One process proxies
    roughly 15k small requests/s on one core; use about one worker per core the gateway may use."""
    cors_allowed_origins: list[str] = Field(default_factory=list)
    """Web pages that may call the API from a browser (CORS): origins such as ``https://chat.example.org``
    (scheme, host and port, no path), or ``"*"`` for any.  Empty (the default, as vLLM's): none; clients that
    are not browsers need no CORS.  Preflights are answered without a key; the calls themselves still need one."""
    trusted_proxies: list[IPvAnyNetwork] = Field(default_factory=list)
    """Load balancers or ingresses in front of the gateway (addresses or networks: ``10.0.0.0/8``,
    ``192.0.2.7``): a request whose connection comes from one is from the rightmost address of its
    ``X-Forwarded-For`` that is not one of them (the access log's ``client``).  Empty (the default): every
    request is from its connection's address, whatever it sends."""
    _file_keys: list[str | KeyPolicy] | None = PrivateAttr(None)
    _batch_key: str | None = PrivateAttr(None)
    # the daemon's batch runner's own key (random per daemon start, set by the daemon): its requests are the
    # gateway's ``_batches`` tenant, below every priority class
    # the keys file's items, read and checked by fleetfile.parse_config (they travel with a pickled config)

    @field_validator("priority_classes")
    @classmethod
    def _unique_classes(cls, v: list[str]) -> list[str]:
        dup = sorted({c for c in v if v.count(c) > 1})
        if dup:
            raise ValueError(f"priority class {', '.join(map(repr, dup))} is listed twice")
        return v

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for origin in v:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin: scheme://host[:port] without a path (or \"*\" for any), "
                                 "e.g. https://chat.example.org")
        return [o.lower() for o in v]   # (as browsers send them)

    @field_validator("default_priority")
    @classmethod
    def _known_default(cls, v: str, info: ValidationInfo) -> str:
        classes = info.data.get("priority_classes")
        if classes is not None and v not in classes:
            raise ValueError(f"{v!r} is not a priority class; one of: {', '.join(classes)}")
        return v

    @model_validator(mode="after")
    def _workers_need_a_fixed_port(self) -> GatewayConfig:
        if self.workers > 1 and self.port == 0:
            raise FieldError(("port", "workers"), "gateway.workers > 1 needs a fixed port (port 0 would give each worker its own)")
        return self

    @property
    def open(self) -> bool:
        """No client key is asked: neither ``api_keys`` nor ``api_keys_file`` is set.  One set but holding no key
        (the last key revoked by a reload) lets nobody in: it opened the gateway to every client."""
        return not {"api_keys", "api_keys_file"} & self.model_fields_set   # (an empty path too: "${KEYS:-}")

    def keys(self) -> list[KeyPolicy]:
        """Every client key (``api_keys``, then the keys file's), with its name and priority filled in.  Without
        :func:`~orchestrator.fleetfile.parse_config` the file is read here (relative to the working directory)."""
        if self._file_keys is None and self.api_keys_file:
            from .keysfile import read_keys_file   # (the file's reader imports this module)
            self._file_keys = read_keys_file(self.api_keys_file)
        return [as_policy(k).resolved(self.default_priority) for k in [*self.api_keys, *(self._file_keys or [])]]


def key_advisories(gw: GatewayConfig, now_epoch_s: float) -> list[str]:
    """What ``validate`` warns of in keys that are valid but do nothing: a group budget no key draws on (a
    misspelt name?), a key already expired."""
    keys = gw.keys()
    members = {k.group for k in keys}
    out = [f"gateway.groups.{g}: no key has group {g!r}: its budget limits nothing" for g in gw.groups
           if g not in members]
    return out + [f"key {k.name}: expired at {k.expires_at.isoformat()}: its requests get 401" for k in keys
                  if k.expires_at is not None and k.expires_at.timestamp() <= now_epoch_s]

