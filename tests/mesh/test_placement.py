"""Placement reports and the gloo interface choice, without a process group (pure parts).

The across-two-network-stacks behaviour is tests/mesh/test_two_hosts.py's.
"""

from __future__ import annotations

import socket

import pytest

from hybridsp.launch._gloo_interface import choose_gloo_interface, interface_addresses, interface_for
from hybridsp.mesh._hybrid_mesh import MeshShape
from hybridsp.mesh._placement import Placement


def _placement(hosts: list[str], ulysses: int, ring: int) -> Placement:
    members = MeshShape(len(hosts), ulysses, ring).group_members()
    return Placement(hosts, members["ulysses"], members["ring"])


def test_two_hosts_of_four_with_u4_r2_keep_ulysses_inside():
    placement = _placement(["a/10.0.0.1"] * 4 + ["b/10.0.0.2"] * 4, 4, 2)
    assert placement.ulysses_crossing_hosts() == []
    assert placement.describe() == (
        "placement: 2 host(s): a/10.0.0.1 ranks 0-3; b/10.0.0.2 ranks 4-7; "
        "2 Ulysses groups each inside one host; ring groups span 2 host(s)"
    )


def test_ulysses_across_hosts_is_named():
    placement = _placement(["a/1"] * 4 + ["b/2"] * 4, 8, 1)
    assert placement.ulysses_crossing_hosts() == [list(range(8))]
    assert "1 of 1 Ulysses groups CROSS hosts: [[0, 1, 2, 3, 4, 5, 6, 7]]" in placement.describe()
    interleaved = _placement(["a/1", "b/2"] * 2, 2, 2)  # a launcher that deals ranks round-robin
    assert "ranks 0,2" in interleaved.describe() and len(interleaved.ulysses_crossing_hosts()) == 2


def test_loopback_is_found_and_a_loopback_master_needs_no_interface():
    assert interface_addresses()["lo"] == "127.0.0.1"
    assert interface_for("127.0.0.1") == "lo"
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert choose_gloo_interface(env) is None and "GLOO_SOCKET_IFNAME" not in env


def test_an_explicit_interface_is_kept():
    env = {"MASTER_ADDR": "10.1.2.3", "GLOO_SOCKET_IFNAME": "ib0"}
    assert choose_gloo_interface(env) == "ib0" and env["GLOO_SOCKET_IFNAME"] == "ib0"


def test_a_master_elsewhere_gets_the_routing_interface_when_the_name_is_loopback(monkeypatch):
    # this machine's name may resolve anywhere: make it resolve to loopback, as in the namespaces
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.0.1", 0))])
    routes = {name: address for name, address in interface_addresses().items() if name != "lo"}
    if not routes:
        pytest.skip("no interface but loopback on this machine: nothing to route through")
    name, address = next(iter(routes.items()))
    env = {"MASTER_ADDR": address}
    assert choose_gloo_interface(env) == name == env["GLOO_SOCKET_IFNAME"]
