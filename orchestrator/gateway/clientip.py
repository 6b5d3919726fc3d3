"""Who a client is when the gateway sits behind a load balancer or an ingress: ``gateway.trusted_proxies``.

A request whose connection comes from a trusted proxy is from the address that proxy names last in
``X-Forwarded-For``, walking right to left past further trusted proxies (as nginx's ``real_ip_recursive``): the
rightmost address that is not a trusted proxy's.  A connection from anywhere else is its own address: a client
cannot name itself another by sending the header.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> Address | None:
    """An address as a peer or a header names it (``1.2.3.4``, ``1.2.3.4:5678``, ``[::1]:80``, ``::1``), an
    IPv4-mapped IPv6 address as its IPv4 one; None when it is none."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:text.find("]")] if "]" in text else text
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def _plain(n: Network) -> Network:
    """An IPv4-mapped IPv6 network (``::ffff:10.0.0.0/104``) as the IPv4 one it maps: peers are compared as such."""
    if n.version == 6 and n.prefixlen >= 96 and (v4 := n.network_address.ipv4_mapped) is not None:
        return ipaddress.IPv4Network((v4, n.prefixlen - 96))
    return n


class ClientAddress:
    """The client's address of a request, given the trusted proxies' networks."""

    def __init__(self, trusted: Sequence[Network] = ()) -> None:
        self.trusted = tuple(_plain(n) for n in trusted)

    def _trusted(self, ip: Address) -> bool:
        return any(ip.version == n.version and ip in n for n in self.trusted)

    def of(self, remote: str | None, forwarded_for: Iterable[str]) -> str | None:
        """The client of a connection from ``remote`` whose ``X-Forwarded-For`` headers are ``forwarded_for`` (in
        the order they came)."""
        if not self.trusted or remote is None or (ip := _ip(remote)) is None or not self._trusted(ip):
            return remote
        hops = [h for v in forwarded_for for h in v.split(",") if h.strip()]
        addr = remote
        for hop in reversed(hops):
            if (ip := _ip(hop)) is None:   # (not an address: what a trusted proxy named before it is the last word)
                return addr
            addr = str(ip)
            if not self._trusted(ip):
                return addr
        return addr   # (every hop a trusted proxy: the first of them)
