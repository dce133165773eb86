"""The namespace hosts themselves: hosts reach each other over their link and nothing else,
a link taken down cuts them apart, and every namespace goes away afterwards."""

from __future__ import annotations

import subprocess
import sys

import netns_hosts
import pytest

SERVER = ("import socket, sys; s = socket.create_server((sys.argv[1], 5999)); print('up', flush=True); "
          "c, _ = s.accept(); c.sendall(c.recv(64).upper())")
CLIENT = ("import socket, sys; c = socket.create_connection((sys.argv[1], 5999), timeout=2); "
          "c.sendall(b'across'); print(c.recv(64).decode())")


@pytest.fixture(scope="module")
def usable():
    reason = netns_hosts.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def test_hosts_talk_over_their_link_and_are_removed(usable):
    net = netns_hosts.create_network(2, tag="t")
    names = set(net.namespaces)
    try:
        a, b = net.hosts
        assert names <= _namespaces() and len(names) == 3
        server = b.popen(sys.executable, "-c", SERVER, b.address, stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        rx0, _ = b.link_bytes()
        assert a.run(sys.executable, "-c", CLIENT, b.address).stdout.strip() == "ACROSS"
        assert server.wait(10) == 0
        assert b.link_bytes()[0] > rx0
        # each host has its own loopback: b's server address is not on a's
        assert b.address not in a.run("ip", "-o", "addr").stdout
        # link down: a cannot reach b (its route to the network is gone)
        a.set_link(False)
        down = a.run(sys.executable, "-c", CLIENT, b.address, check=False)
        assert down.returncode != 0 and "unreachable" in down.stderr.lower(), down.stderr[-300:]
    finally:
        assert net.close() == []
    assert not names & _namespaces()


def test_leftovers_of_dead_runs_are_removed(usable):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = f"{netns_hosts.PREFIX}{gone.pid}-h0"  # as a run whose process died would leave it
    subprocess.run(["ip", "netns", "add", stale], check=True)
    net = netns_hosts.create_network(2, tag="l")  # this (live) process's: kept
    try:
        removed = netns_hosts.remove_leftovers()
        assert stale in removed and stale not in _namespaces()
        assert set(net.namespaces) <= _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        net.close()
