"""Fixtures of the namespace-host tests: a private network of two hosts, removed afterwards."""

from __future__ import annotations

import netns_hosts
import pytest


@pytest.fixture(scope="session")
def network():
    """Two hosts (prefill on ``hosts[0]`` 10.77.0.1, decode on ``hosts[1]`` 10.77.0.2) on one
    bridge; skipped with the reason where namespaces cannot be made. Every namespace (and with
    it every link) is deleted afterwards, whatever the tests did."""
    reason = netns_hosts.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    gone = netns_hosts.remove_leftovers()
    if gone:
        print(f"removed namespaces left by earlier runs: {gone}")
    net = netns_hosts.create_network(2)
    try:
        yield net
    finally:
        problems = net.close()
        if problems:
            print("netns cleanup:", *problems, sep="\n  ")


@pytest.fixture
def hosts(network):
    """(prefill host, decode host), their links up and unshaped (a test that takes one down
    or limits its rate is undone afterwards, even when it fails)."""
    yield tuple(network.hosts)
    for h in network.hosts:  # leave the links up and unshaped for the next test, even after a failure
        h.set_link(True)
        h.limit_rate(None)
