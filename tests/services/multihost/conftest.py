"""Test hosts (``loadtest.fixtures.netns_hosts``): each test module makes its own network of
hosts and must leave nothing behind (no namespace, no link, no process), which its teardown
checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from loadtest.fixtures import netns_hosts
from loadtest.fixtures.netns_hosts import HostNetwork


@pytest.fixture(scope="module")
def host_network() -> Iterator[Callable[[Sequence[str]], HostNetwork]]:
    """Factory: ``host_network(["router", "prefill", ...])`` creates the hosts; removed at the
    end of the module, and checked gone."""
    reason = netns_hosts.available()
    if reason is not None:
        pytest.skip(reason)
    made: list[HostNetwork] = []

    def make(names: Sequence[str]) -> HostNetwork:
        network = HostNetwork(names).create()
        made.append(network)
        return network

    yield make
    pids = [pid for network in made for name in network.hosts for pid in network.pids(name)]
    for network in made:
        network.remove()
    assert netns_hosts.leftovers() == []
    assert [pid for pid in pids if netns_hosts.is_alive(pid)] == []
