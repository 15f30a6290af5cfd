"""Elastic membership (`--nnodes MIN:MAX`) on torch.distributed.elastic's c10d rendezvous,
with the two things torchrun leaves to users in containers and network namespaces:

- who serves the rendezvous store: torchrun's agent serves it when this machine's *host
  name* resolves to the endpoint, which in a container or a namespace it seldom does (then
  no one serves it); here the host that holds the endpoint's address on one of its
  interfaces serves it;
- where the workers meet: torchrun advertises the host name (`socket.getfqdn()`), which the
  other hosts may not resolve, or resolve to another interface; here each host advertises
  the address of `--ifname`, else the one its route to the endpoint leaves from.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

from ddpcli.errors import runtime_error, usage_error
from ddpcli.launcher.rollcall import (
    CONNECT_TIMEOUT_S,
    MasterUnreachable,
    store_handshake,
    try_connect,
    wait_until_listening,
)
from ddpcli.network import address_for, list_interfaces, resolve_ip

# Once MIN hosts have met, how long the rendezvous waits for more, up to MAX: short, so a
# restart after a lost host is quick; a host that comes later joins at the next restart.
LAST_CALL_S = 3


def serves_store(endpoint_host: str) -> bool | None:
    """True when ENDPOINT_HOST is an address of this machine; None for a loopback endpoint
    (every node is on this machine: torch's own test decides, and one that finds the port
    taken becomes a client), False otherwise."""
    address = resolve_ip(endpoint_host)
    if address is None:
        return False
    if ipaddress.ip_address(address).is_loopback:
        return None
    return any(address in interface.ips for interface in list_interfaces())


def advertised_address(ifname: str | None, endpoint_host: str) -> str | None:
    """The address the other hosts reach this one at: --ifname's, else the route's source."""
    return address_for(ifname, resolve_ip(endpoint_host))


def c10d_settings(endpoint_host: str, timeout_s: int) -> dict[str, Any]:
    """The c10d rendezvous's own settings (torch's `rdzv_configs`)."""
    settings: dict[str, Any] = {
        "join_timeout": timeout_s,
        "last_call_timeout": LAST_CALL_S,
        "close_timeout": timeout_s,
    }
    host = serves_store(endpoint_host)
    if host is not None:
        settings["is_host"] = host
    return settings


def check_endpoint(host: str, port: int, timeout_s: float) -> None:
    """Before this host's agent meets the others at the c10d rendezvous HOST:PORT: the host
    that serves it finds the port free, the others find a PyTorch store there within
    TIMEOUT_S. Left to torch, a taken port or an endpoint not up yet ends in C++ stack
    traces, and a service that never answers a store's handshake in a wait with no end."""
    where = f"{host}:{port}"
    serves = serves_store(host)
    if serves:
        with listening(port, where, "--rdzv-endpoint, the same on every host"):
            return
    if serves is None and try_connect(host, port) != "open":
        return  # a loopback endpoint nothing listens on yet: this host serves it
    try:
        wait_until_listening(host, port, timeout_s)
    except MasterUnreachable as unreachable:
        raise runtime_error(
            f"could not reach the c10d rendezvous at {where} within {timeout_s:g}s: "
            f"{unreachable}; start the same command on the endpoint's host, which serves "
            "it, and check the address and that the port is open (ddpcli check-env "
            f"--master-addr {host} --master-port {port})"
        ) from None
    service = store_handshake(host, port)
    if service is not None:
        raise runtime_error(
            f"a non-PyTorch service answers at {where}, not the c10d rendezvous ({service}); "
            "give --rdzv-endpoint a free port on its host (the same on every host)"
        )


def check_served_here(host: str, port: int) -> None:
    """A one-node job given its store's address (--master-port, or --rdzv-endpoint without
    --nnodes MIN:MAX): its agent serves the store on PORT, and its workers reach it at
    HOST, so the port must be free here and HOST:PORT lead back to this machine. Else the
    workers would wait on another machine's service, or torch stop with a C++ error."""
    where = f"{host}:{port}"
    with listening(port, where, "--master-port or --rdzv-endpoint") as listener:
        listener.settimeout(CONNECT_TIMEOUT_S)
        reached = try_connect(host, port)
        here = reached == "open" and accepted(listener)
    if not here:
        elsewhere = "another machine" if reached == "open" else f"nothing ({reached})"
        raise usage_error(
            f"a one-node job serves its own store, but {where} leads to {elsewhere}, not "
            "this machine; drop that address (--master-addr or --rdzv-endpoint) or give one "
            "of this machine's, or run a multi-node job with --nnodes"
        )


def accepted(listener: socket.socket) -> bool:
    """Whether a connection came to LISTENER within its timeout."""
    try:
        connection, _ = listener.accept()
    except TimeoutError:
        return False
    connection.close()
    return True


@contextlib.contextmanager
def listening(port: int, where: str, flags: str) -> Iterator[socket.socket]:
    """A socket listening on PORT on every address, as the store would (exit 2 saying by
    what the port is taken), closed on leaving."""
    host = where.rsplit(":", 1)[0]
    family = socket.AF_INET6 if ":" in (resolve_ip(host) or "") else socket.AF_INET
    try:
        listener = socket.create_server(("", port), family=family)
    except OSError as error:
        raise usage_error(
            f"cannot serve the job's store on {where}: {taken_by(host, port, error)}; give "
            f"it a free port ({flags})"
        ) from None
    with listener:
        yield listener


def taken_by(host: str, port: int, error: OSError) -> str:
    if error.errno != errno.EADDRINUSE:
        return f"the port cannot be bound ({error.strerror})"
    if try_connect(host, port) != "open":
        return "the port is in use on this machine"
    service = store_handshake(host, port)
    owner = "another job's PyTorch store" if service is None else f"a service ({service})"
    return f"the port is in use on this machine, by {owner}"
