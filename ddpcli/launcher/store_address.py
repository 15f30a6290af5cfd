"""A job's store address, checked before torch meets it: the host that serves the store
finds its port free, the others find a PyTorch store there, and a one-node job's address
leads back to its own machine. Left to torch, a taken port or an endpoint that is not up
yet ends in C++ stack traces, and another service on it, or a one-node job given another
machine's address, in a wait with no end. (Static jobs of several nodes meet at the roll
call, which checks the same: ddpcli.launcher.rollcall.)
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator

from ddpcli.errors import runtime_error, usage_error
from ddpcli.launcher.membership import serves_store
from ddpcli.launcher.rollcall import (
    CONNECT_TIMEOUT_S,
    MasterUnreachable,
    store_handshake,
    try_connect,
    wait_until_listening,
)
from ddpcli.network import resolve_ip


def check_endpoint(host: str, port: int, timeout_s: float) -> None:
    """Before this host's agent meets the others at the c10d rendezvous HOST:PORT: the host
    that serves it finds the port free, the others find a PyTorch store there within
    TIMEOUT_S."""
    where = f"{host}:{port}"
    serves = serves_store(host)
    if serves:
        with listening(host, port, "--rdzv-endpoint, the same on every host"):
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
    with listening(host, port, "--master-port or --rdzv-endpoint") as listener:
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
def listening(host: str, port: int, flags: str) -> Iterator[socket.socket]:
    """A socket listening on PORT on every address, as the store at HOST:PORT would (exit 2
    saying by what the port is taken, and which FLAGS give another), closed on leaving."""
    family = socket.AF_INET6 if ":" in (resolve_ip(host) or "") else socket.AF_INET
    try:
        listener = socket.create_server(("", port), family=family)
    except OSError as error:
        raise usage_error(
            f"cannot serve the job's store on {host}:{port}: {taken_by(host, port, error)}; give "
            f"it a free port ({flags})"
        ) from None
    with listener:
        yield listener


def taken_by(host: str, port: int, error: OSError) -> str:
    """Why PORT cannot be bound, in words: by what it is taken, asked at HOST:PORT."""
    if error.errno != errno.EADDRINUSE:
        return f"the port cannot be bound ({error.strerror})"
    if try_connect(host, port) != "open":
        return "the port is in use on this machine"
    service = store_handshake(host, port)
    owner = "another job's PyTorch store" if service is None else f"a service ({service})"
    return f"the port is in use on this machine, by {owner}"
