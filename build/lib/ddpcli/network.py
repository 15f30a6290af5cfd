"""This node's network as check-env and the launcher see it: interfaces and their addresses
(from `ip`, or the kernel when iproute2 is missing), the route to an address, name
resolution with a deadline, and the master port (free here? who holds it?). Stdlib only."""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import threading
from dataclasses import dataclass

from ddpcli.machine import network_interfaces, run_tool

RESOLVE_TIMEOUT_S = 3.0


@dataclass
class Interface:
    name: str
    up: bool
    loopback: bool
    addresses: list[str]  # CIDR, IPv4 first

    @property
    def ips(self) -> list[str]:
        return [address.split("/")[0] for address in self.addresses]

    @property
    def ipv4(self) -> list[str]:
        return [ip for ip in self.ips if ":" not in ip]


@dataclass
class Route:
    dev: str
    source: str | None


# --- Interfaces ------------------------------------------------------------------------------


def list_interfaces() -> list[Interface]:
    listing = run_tool(["ip", "-j", "addr"])
    if listing:
        try:
            return [interface_from_ip(entry) for entry in json.loads(listing)]
        except (ValueError, KeyError):
            pass
    return interfaces_from_sysfs()


def interface_from_ip(entry: dict) -> Interface:
    flags = entry.get("flags", [])
    addresses = [
        f"{info['local']}/{info['prefixlen']}"
        for info in sorted(entry.get("addr_info", []), key=lambda info: info["family"] != "inet")
        if "local" in info
    ]
    return Interface(
        name=entry["ifname"],
        up="UP" in flags and "NO-CARRIER" not in flags,
        loopback="LOOPBACK" in flags,
        addresses=addresses,
    )


def interfaces_from_sysfs() -> list[Interface]:
    """Without iproute2: names from the kernel, state from /sys, the IPv4 address by ioctl."""
    interfaces = []
    for name in network_interfaces():
        flags = read_sysfs_flags(name)
        address = ipv4_by_ioctl(name)
        interfaces.append(
            Interface(
                name=name,
                up=bool(flags & 0x1) and bool(flags & 0x40),  # IFF_UP and IFF_RUNNING
                loopback=bool(flags & 0x8),  # IFF_LOOPBACK
                addresses=[f"{address}/32"] if address else [],
            )
        )
    return interfaces


def read_sysfs_flags(name: str) -> int:
    try:
        with open(f"/sys/class/net/{name}/flags") as handle:
            return int(handle.read().strip(), 16)
    except (OSError, ValueError):
        return 0


def ipv4_by_ioctl(name: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


# --- Routes and names ------------------------------------------------------------------------


def route_to(ip: str) -> Route | None:
    """The interface (and source address) the kernel uses to reach `ip`."""
    listing = run_tool(["ip", "-j", "route", "get", ip])
    if listing:
        try:
            entry = json.loads(listing)[0]
            return Route(entry["dev"], entry.get("prefsrc"))
        except (ValueError, KeyError, IndexError):
            pass
    return route_by_socket(ip)


def route_by_socket(ip: str) -> Route | None:
    """Fallback: connecting a UDP socket sends nothing but picks the source address."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))
            source = probe.getsockname()[0]
    except OSError:
        return None
    holder = next((i for i in list_interfaces() if source in i.ips), None)
    return Route(holder.name, source) if holder else None


def resolve_ip(host: str) -> str | None:
    """The address `host` stands for, IPv4 first; None if it does not resolve in time."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    answer: list[str] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            infos.sort(key=lambda info: info[0] != socket.AF_INET)
            answer.append(str(infos[0][4][0]))  # the host of (host, port, ...)
        except (OSError, IndexError):
            pass

    # A daemon thread: a name server that never answers must not hold check-env up.
    worker = threading.Thread(target=lookup, daemon=True)
    worker.start()
    worker.join(RESOLVE_TIMEOUT_S)
    return answer[0] if answer else None


def address_for(ifname: str | None, master_ip: str | None) -> str | None:
    """The address this node talks from: the interface's, or the route's source."""
    if ifname:
        iface = next((i for i in list_interfaces() if i.name == ifname), None)
        if iface is None:
            return None
        addresses = iface.ipv4 or iface.ips
        return addresses[0] if addresses else None
    route = route_to(master_ip) if master_ip else None
    return route.source if route else None


# --- Ports -----------------------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    """Can the rendezvous store listen on `port` on every address? The store sets
    SO_REUSEADDR, so a connection left in TIME_WAIT does not count as busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str | None:
    """'python (pid 123)' for the process listening on `port`, when the system tells."""
    listing = run_tool(["ss", "-Hltnp", f"sport = :{port}"])
    found = re.search(r'\("([^"]+)",pid=(\d+)', listing or "")
    return f"{found.group(1)} (pid {found.group(2)})" if found else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
