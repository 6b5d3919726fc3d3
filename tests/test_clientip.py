"""gateway.trusted_proxies: the client's address of a request that came through load balancers (pure, a table)."""

from __future__ import annotations

import ipaddress

import pytest

from orchestrator.gateway.clientip import ClientAddress

NETS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "192.0.2.7", "fd00::/8")]


@pytest.mark.parametrize("remote, headers, want", [
    # a connection from anywhere else is its own address, whatever it sends
    ("203.0.113.5", ["198.51.100.1"], "203.0.113.5"),
    # from a trusted proxy: the rightmost address that is not a trusted proxy's
    ("10.0.0.2", ["198.51.100.1, 203.0.113.9"], "203.0.113.9"),
    ("10.0.0.2", ["198.51.100.1, 203.0.113.9, 10.9.9.9, 192.0.2.7"], "203.0.113.9"),
    ("10.0.0.2", ["198.51.100.1", "203.0.113.9, 10.9.9.9"], "203.0.113.9"),   # (two headers: one list, in order)
    # no header, an empty one: the proxy's own
    ("10.0.0.2", [], "10.0.0.2"),
    ("10.0.0.2", [" , "], "10.0.0.2"),
    # every hop a trusted proxy: the first of them
    ("10.0.0.2", ["10.1.1.1, 192.0.2.7"], "10.1.1.1"),
    # ports and brackets as proxies write them; IPv6; an IPv4-mapped peer
    ("10.0.0.2", ["203.0.113.9:4711"], "203.0.113.9"),
    ("fd00::1", ["[2001:db8::5]:443"], "2001:db8::5"),
    ("fd00::1", ["2001:db8::5"], "2001:db8::5"),
    ("::ffff:10.0.0.2", ["203.0.113.9"], "203.0.113.9"),
    # what is no address ends the walk at the last one a trusted proxy named
    ("10.0.0.2", ["203.0.113.9, unknown, 10.1.1.1"], "10.1.1.1"),
    ("10.0.0.2", ["unknown"], "10.0.0.2"),
    # a unix socket's peer (None) or an odd one
    (None, ["203.0.113.9"], None),
    ("", ["203.0.113.9"], ""),
])
def test_the_client_is_the_rightmost_address_no_trusted_proxy_holds(remote, headers, want):
    assert ClientAddress(NETS).of(remote, headers) == want


def test_an_ipv4_mapped_network_holds_the_ipv4_peers_it_maps():
    mapped = ClientAddress([ipaddress.ip_network("::ffff:10.0.0.0/104")])
    assert mapped.of("10.1.2.3", ["203.0.113.9"]) == mapped.of("::ffff:10.1.2.3", ["203.0.113.9"]) == "203.0.113.9"
    assert mapped.of("11.0.0.1", ["203.0.113.9"]) == "11.0.0.1"


def test_without_trusted_proxies_the_header_names_nothing():
    assert ClientAddress().of("10.0.0.2", ["203.0.113.9"]) == "10.0.0.2"
