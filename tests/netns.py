"""Two "hosts" on one machine, for multi-node tests: two network namespaces joined by a
veth pair, each with its own address and a loopback that is up.

    from netns import two_hosts

    def test_two_nodes():
        with two_hosts() as pair:
            node0, node1 = pair.hosts
            subprocess.run(node1.command(sys.executable, "-m", "ddpcli", "check-env",
                                         "--master-addr", node0.address, ...), timeout=60)

or take the `host_pair` fixture (import it into the test module). The namespaces are
deleted when the block ends, even when the test fails. Needs root and iproute2; the test is
skipped with the reason otherwise. Names carry the pid and a counter, so concurrent test
runs never collide. Processes a test leaves running inside a namespace are not killed by
deleting it: give every subprocess a timeout.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

IP_TIMEOUT_S = 10
_counter = itertools.count()


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # e.g. 192.0.2.1
    prefix: int  # e.g. 24
    ifname: str  # the veth end inside this namespace
    # (namespace, name) of the veth's other end: the peer host's, or the bridge's port
    peer: tuple[str, str] | None = None

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class HostPair:
    hosts: tuple[Host, Host]

    @property
    def master(self) -> Host:
        return self.hosts[0]


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")


def _delete(namespace: str) -> None:
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=IP_TIMEOUT_S)


@contextlib.contextmanager
def two_hosts(subnet: str = "192.0.2.0/24") -> Iterator[HostPair]:
    """Yield two namespaces joined by a veth pair holding the first two addresses of
    `subnet` (TEST-NET-1 by default, which routes nowhere); always delete them after."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    network = ipaddress.ip_network(subnet)
    first, second = itertools.islice(network.hosts(), 2)
    stem = f"ddp{os.getpid()}n{next(_counter)}"
    hosts = (
        Host(f"{stem}a", str(first), network.prefixlen, "veth0", peer=(f"{stem}b", "veth1")),
        Host(f"{stem}b", str(second), network.prefixlen, "veth1", peer=(f"{stem}a", "veth0")),
    )
    created: list[str] = []
    try:
        for host in hosts:
            try:
                _ip("netns", "add", host.namespace)
            except (RuntimeError, subprocess.SubprocessError) as error:
                pytest.skip(f"cannot create a network namespace here: {error}")
            created.append(host.namespace)
        _connect(hosts)
        yield HostPair(hosts)
    finally:
        for namespace in created:
            _delete(namespace)


def _connect(hosts: tuple[Host, Host]) -> None:
    a, b = hosts
    # Both ends are created inside their namespaces, so the names never clash on the host.
    _ip("link", "add", a.ifname, "netns", a.namespace, "type", "veth",
        "peer", "name", b.ifname, "netns", b.namespace)  # fmt: skip
    for host in hosts:
        _ip(
            "-n", host.namespace, "addr", "add", f"{host.address}/{host.prefix}", "dev", host.ifname
        )
        _ip("-n", host.namespace, "link", "set", host.ifname, "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")


@pytest.fixture
def host_pair() -> Iterator[HostPair]:
    """Two namespaces joined by a veth pair, deleted after the test (see two_hosts)."""
    with two_hosts() as pair:
        yield pair


@contextlib.contextmanager
def bridged_hosts(count: int = 3, subnet: str = "192.0.2.0/24") -> Iterator[tuple[Host, ...]]:
    """COUNT namespaces, each with a veth whose other end sits on a bridge in one more
    namespace (a switch), holding the first COUNT addresses of SUBNET; all deleted after."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    network = ipaddress.ip_network(subnet)
    addresses = list(itertools.islice(network.hosts(), count))
    stem = f"ddp{os.getpid()}s{next(_counter)}"
    switch = f"{stem}sw"
    hosts = tuple(
        Host(f"{stem}{index}", str(address), network.prefixlen, "veth0", (switch, f"port{index}"))
        for index, address in enumerate(addresses)
    )
    created: list[str] = []
    try:
        for namespace in (switch, *(host.namespace for host in hosts)):
            try:
                _ip("netns", "add", namespace)
            except (RuntimeError, subprocess.SubprocessError) as error:
                pytest.skip(f"cannot create a network namespace here: {error}")
            created.append(namespace)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in hosts:
            port = host.peer[1]  # type: ignore[index]
            _ip("link", "add", host.ifname, "netns", host.namespace, "type", "veth",
                "peer", "name", port, "netns", switch)  # fmt: skip
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{host.prefix}",
                "dev", host.ifname)  # fmt: skip
            _ip("-n", host.namespace, "link", "set", host.ifname, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace in created:
            _delete(namespace)
