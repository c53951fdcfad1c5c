"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair (root only).

    with two_hosts() as hosts:                      # skips the test where namespaces are unavailable
        job = hosts.popen(1, ["python", ...])       # runs inside host B's network stack
        hosts.pids(1)                               # every process inside host B

Each host has its own network stack: ``lo`` and one veth end with the address assigned here
(``10.77.0.1/24`` on host A, ``10.77.0.2/24`` on host B, only inside the namespaces), an empty
``resolv.conf`` (no name server: lookups fail at once instead of timing out against one the
namespaces cannot reach) and the machine's ``/etc/hosts``. Traffic can only flow between the two
namespaces. Names are unique per use; on exit every process inside either namespace is killed
and the namespaces and their files are removed, whatever happened.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ADDRESSES = ("10.77.0.1", "10.77.0.2")
_COUNTER = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable_reason() -> str | None:
    """Why two network namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "needs the 'ip' command (iproute2) to create network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    name = f"hspprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    _ip("netns", "del", name, check=False)
    if made.returncode != 0:
        return f"network namespaces are unavailable here: {made.stderr.strip()}"
    return None


@dataclass
class Hosts:
    """Two namespaces (``names``), their veth ends (``interfaces``) and addresses (``ADDRESSES``)."""

    names: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str] = ADDRESSES

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` inside host ``host``'s network stack, in a new session (killable as a group)."""
        return subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)

    def pids(self, host: int) -> list[int]:
        """Every process inside host ``host``'s network namespace."""
        found = _ip("netns", "pids", self.names[host], check=False).stdout.split()
        return [int(pid) for pid in found if pid.isdigit()]

    def kill_all(self, host: int) -> None:
        """SIGKILL every process of host ``host`` (repeated until none is left, 10 s at most)."""
        deadline = time.monotonic() + 10
        while (pids := self.pids(host)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def unplug(self, host: int) -> None:
        """Take host ``host``'s network link down: its peers hear nothing more, not even a reset."""
        _ip("-n", self.names[host], "link", "set", self.interfaces[host], "down")


def _make(names: tuple[str, str], interfaces: tuple[str, str]) -> None:
    for name in names:
        _ip("netns", "add", name)
        Path("/etc/netns", name).mkdir(parents=True, exist_ok=True)
        Path("/etc/netns", name, "resolv.conf").write_text("# no name server inside the test's namespaces\n")
    _ip("link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
    for name, interface, address in zip(names, interfaces, ADDRESSES):
        _ip("link", "set", interface, "netns", name)
        _ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "link", "set", interface, "up")


def _remove(hosts: Hosts) -> None:
    for host, name in enumerate(hosts.names):
        hosts.kill_all(host)
        _ip("netns", "del", name, check=False)  # deletes the veth end inside it, and so the pair
        shutil.rmtree(Path("/etc/netns", name), ignore_errors=True)
    _ip("link", "del", hosts.interfaces[0], check=False)  # in case it never moved into a namespace


@contextlib.contextmanager
def two_hosts():
    """The two namespaces for the duration of the block (pytest.skip where they cannot be made)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}{next(_COUNTER)}"
    hosts = Hosts((f"hspA{tag}", f"hspB{tag}"), (f"hspva{tag}", f"hspvb{tag}"))
    try:
        _make(hosts.names, hosts.interfaces)
        yield hosts
    finally:
        _remove(hosts)
