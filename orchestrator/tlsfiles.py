"""HTTPS on the gateway's port (``gateway.tls``): its PEM files read and checked with the config (a certificate
that does not load, or a key that is not its own, is a problem at its line: a reload keeps the old fleet and
the old certificate), the gateway processes' server context (loaded again at each reload: a certificate
renewed in place is served to the connections that come after it), and the context of slurmfleet's own clients
of the gateway (the batch CLI), which trust the configured certificate itself."""

from __future__ import annotations

import logging
import re
import ssl
from pathlib import Path

from .keys import GatewayConfig, TlsConfig
from .yamlsrc import Problem, Source

log = logging.getLogger("slurmfleet.gateway")


def resolve_tls(gw: GatewayConfig, src: Source) -> list[Problem]:
    """Resolve ``gw.tls``'s paths (relative to ``src``'s directory) and load them once; the problems found."""
    t = gw.tls
    if t is None:
        return []
    paths = tuple(str(Path(src.file).parent / Path(p).expanduser()) for p in (t.cert_file, t.key_file))
    for field, path in zip(("cert_file", "key_file"), paths):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            return [src.problem(("gateway", "tls", field), f"cannot read {path}: {exc.strerror or exc}")]
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(*paths)
    except (ssl.SSLError, ValueError) as exc:
        return [src.problem(("gateway", "tls", "cert_file"), f"the certificate {paths[0]} and the key {paths[1]} "
                                                             f"do not load as a pair (PEM): {exc}")]
    t._paths = paths   # type: ignore[assignment]
    return []


def _paths(t: TlsConfig) -> tuple[str, str]:
    return t._paths or (t.cert_file, t.key_file)   # (a config not read by parse_config: as written)


class ServerTls:
    """A gateway process's server context (None: plain HTTP), its certificate loaded again by :meth:`reload`."""

    def __init__(self, gw: GatewayConfig, on: bool = True):
        self.context: ssl.SSLContext | None = None
        if on and gw.tls is not None:
            self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.context.load_cert_chain(*_paths(gw.tls))

    def reload(self, gw: GatewayConfig) -> None:
        """The new config's files into the same context (new connections get them; TLS on or off: a restart)."""
        if self.context is not None and gw.tls is not None:
            try:
                self.context.load_cert_chain(*_paths(gw.tls))
            except (OSError, ValueError) as exc:   # (changed since the reload read them: the last pair goes on)
                log.error("gateway.tls: cannot load %s and %s (%s): serving the certificate loaded before",
                          *_paths(gw.tls), exc)


PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def client_context(gw: GatewayConfig) -> ssl.SSLContext | None:
    """For slurmfleet's own clients of this gateway (None: plain HTTP): the configured certificate is the one
    trusted, whatever the name dialled (they dial the gateway's address, not the certificate's host name).  Only
    the file's first certificate, the gateway's own: its chain's CAs, trusted too, let any certificate they issued,
    for any name, pass for the gateway's (a man in the middle then read the admin key, or a client's)."""
    if gw.tls is None:
        return None
    first = PEM_CERT.search(Path(_paths(gw.tls)[0]).read_text(encoding="ascii", errors="replace"))
    if first is None:   # (checked with the config: a reload keeps the old fleet)
        raise ssl.SSLError(f"no certificate in {_paths(gw.tls)[0]}")
    ctx = ssl.create_default_context(cadata=first.group(0))
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN   # (a CA-issued certificate trusted as itself)
    return ctx


def scheme(gw: GatewayConfig) -> str:
    return "https" if gw.tls is not None else "http"
