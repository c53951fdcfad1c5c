"""Which network interface gloo should use to reach the other hosts.

Note [gloo interface]: without ``GLOO_SOCKET_IFNAME`` gloo resolves the host's *name* and
advertises that address to every peer. Where ``/etc/hosts`` maps the name to a loopback
address (``127.0.1.1 node1`` is Debian's default; containers often write ``127.0.0.1 vm``),
each host tells the others to connect to 127.0.x.x: on one machine that works by accident,
across two network stacks every rank fails in ``connectFullMesh`` with "Connection refused"
(seen the first time the main job ran across two network namespaces, see
``tests/mesh/test_two_hosts.py``). :func:`choose_gloo_interface` fixes exactly that case: when
``GLOO_SOCKET_IFNAME`` is unset, ``MASTER_ADDR`` is not a loopback address and the host name
does not resolve to an address of this host other than loopback, it sets
``GLOO_SOCKET_IFNAME`` to the interface the kernel routes ``MASTER_ADDR`` through. A name
that already resolves to a usable address, or an explicit setting, is left alone. NCCL
chooses its own interface (``NCCL_SOCKET_IFNAME``; it skips ``lo`` by default).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from typing import MutableMapping, cast

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def route_source_address(target: str) -> str | None:
    """The local IPv4 address the kernel would send from to reach ``target`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return cast(str, probe.getsockname()[0])  # an AF_INET socket's name is (host, port)
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """``{interface name: IPv4 address}`` of this network stack's configured interfaces."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_for(target: str) -> str | None:
    """The name of the interface that carries traffic to ``target``, or None."""
    source = route_source_address(target)
    if source is None:
        return None
    names = [name for name, address in interface_addresses().items() if address == source]
    return names[0] if names else None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def hostname_is_usable() -> bool:
    """Whether this host's name resolves to one of its own non-loopback addresses (gloo's default)."""
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        return False
    local = set(interface_addresses().values())
    return any(address in local and not _is_loopback(address) for address in resolved)


def choose_gloo_interface(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Note [gloo interface]: set ``GLOO_SOCKET_IFNAME`` where gloo's default would advertise loopback.

    Returns the interface now in force (the user's, the one chosen, or None for gloo's default).
    """
    env = os.environ if environ is None else environ
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    master = env.get("MASTER_ADDR")
    if not master or _is_loopback(master) or master == "localhost" or hostname_is_usable():
        return None
    try:
        master = socket.gethostbyname(master)
    except OSError:
        return None
    name = interface_for(master)
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name
    return name
