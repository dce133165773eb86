"""Hosts as network namespaces: a small private network inside this machine.

:func:`create_network` makes ``n`` namespaces (the "hosts"), each with ``lo``
up and one veth link to a bridge in one more namespace (the "switch"), each
host with its own address in ``10.77.0.0/24``. Every link is created directly
inside the namespaces (never in the caller's namespace), so deleting the
namespaces removes everything; :meth:`Network.close` does that, and
:func:`remove_leftovers` deletes the namespaces of runs whose process died
(names carry the creating process's id: ``kvbn<pid>-h0``, ``kvbn<pid>-sw``).

Traffic stays inside: a host reaches only the other hosts of its network and
its own loopback; nothing is routed to or from the machine's own network.

:func:`enter` moves the calling thread (the main thread of a freshly started
process, before it opens any socket or starts a thread) into a host, which is
how engine processes are placed (see ``netns_cluster``); :meth:`Host.cmd`
wraps a command in ``ip netns exec``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "kvbn"
SUBNET = "10.77.0"  # host i: 10.77.0.(i + 1)/24
DEV = "eth0"  # each host's link to the switch (the same name in every namespace)
_NAME = re.compile(rf"^{PREFIX}(\d+)[a-z]*-")
_CLONE_NEWNET = 0x40000000


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (the reason is the message)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


@dataclass(frozen=True)
class Host:
    """One network namespace with one address on the network's bridge."""

    name: str
    address: str
    dev: str = DEV

    def cmd(self, *args: str) -> list[str]:
        """``args`` as a command line run inside this host."""
        return ["ip", "netns", "exec", self.name, *args]

    def run(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside this host and wait for it (output captured as text)."""
        return subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout, check=check)

    def popen(self, *args: str, **kw) -> subprocess.Popen:
        """Start a command inside this host."""
        return subprocess.Popen(self.cmd(*args), **kw)

    def set_link(self, up: bool) -> None:
        """Take this host's link to the switch down, or bring it back up."""
        _ip("-n", self.name, "link", "set", self.dev, "up" if up else "down")

    def limit_rate(self, mbit: int | None) -> None:
        """Shape what this host sends on its link to ``mbit`` Mbit/s (a token bucket), or
        remove the limit (None)."""
        if mbit is None:
            _ip("-n", self.name, "link", "show", self.dev)  # the host exists
            subprocess.run(self.cmd("tc", "qdisc", "del", "dev", self.dev, "root"), capture_output=True,
                           timeout=30)  # fails when no limit is set: nothing to remove
            return
        self.run("tc", "qdisc", "replace", "dev", self.dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", "64kb", "latency", "1s")

    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes counted on this host's link so far."""
        out = _ip("-n", self.name, "-j", "-s", "link", "show", "dev", self.dev).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


@dataclass
class Network:
    """The hosts and the switch of one :func:`create_network`; :meth:`close` removes them."""

    hosts: list[Host]
    switch: str
    namespaces: list[str] = field(default_factory=list)  # everything created, in order

    def close(self) -> list[str]:
        """End the processes still inside the namespaces, then delete the namespaces (which
        removes their links). Returns what went wrong (nothing, normally)."""
        return _delete(self.namespaces)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _delete(names: list[str]) -> list[str]:
    problems = []
    for ns in reversed(names):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # only processes inside this run's own namespace
            try:
                os.kill(int(pid), 9)
                problems.append(f"process {pid} was still running in {ns}: killed")
            except (ProcessLookupError, ValueError):
                pass
        out = _ip("netns", "del", ns, check=False)
        if out.returncode != 0 and ns in _ip("netns", "list", check=False).stdout.split():
            problems.append(f"cannot delete namespace {ns}: {out.stderr.strip()}")
    return problems


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_leftovers() -> list[str]:
    """Delete namespaces named by this module whose creating process is gone; returns them."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its run is still going
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _delete([name])
        gone.append(name)
    return gone


def create_network(n: int = 2, tag: str = "") -> Network:
    """``n`` hosts (``kvbn<pid><tag>-h<i>``, address 10.77.0.<i + 1>) on a bridge in a switch
    namespace; ``tag`` (lowercase letters) tells apart networks of one process. Raises
    :class:`NetnsUnavailable` when namespaces cannot be made."""
    if not re.fullmatch("[a-z]*", tag):
        raise ValueError(f"tag must be lowercase letters, got {tag!r}")
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    base = f"{PREFIX}{os.getpid()}{tag}"
    net = Network([], f"{base}-sw")
    try:
        for ns in (net.switch, *(f"{base}-h{i}" for i in range(n))):
            if ns in _ip("netns", "list").stdout.split():
                _delete([ns])  # a leftover of this process (an earlier network not closed)
            _ip("netns", "add", ns)
            net.namespaces.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.switch, "link", "set", "br0", "up")
        for i in range(n):
            host = Host(f"{base}-h{i}", f"{SUBNET}.{i + 1}")
            port = f"p{i}"
            _ip("-n", host.name, "link", "add", DEV, "type", "veth", "peer", "name", port,
                "netns", net.switch)
            _ip("-n", net.switch, "link", "set", port, "master", "br0")
            _ip("-n", net.switch, "link", "set", port, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", DEV)
            _ip("-n", host.name, "link", "set", DEV, "up")
            net.hosts.append(host)
    except BaseException:
        net.close()
        raise
    return net


def enter(host_name: str) -> None:
    """Move the calling thread into the namespace ``host_name`` (call it first thing in a new
    process: threads started later inherit it, threads already running do not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{host_name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {host_name}: {os.strerror(err)}")
    finally:
        os.close(fd)
