"""The roll call: before any worker starts, every node reports to node 0 on a TCPStore at
the master's address, so a node that never comes is named after a timeout instead of
everyone waiting forever. `ddpcli train`/`launch` (launch.py) and check-env's probe both
gather their nodes this way; each words its own messages from what this module returns.

Every wait here polls: a Ctrl-C must not sit behind a blocking C++ store call, and the
store client's own connection retries print C++ stack traces and overrun their timeout.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import struct
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

CONNECT_TIMEOUT_S = 3.0
PORT_POLL_S = 0.5
ROLL_POLL_S = 0.2
VERDICT_ACK_S = 3.0  # how long node 0 waits for the others to read its verdict
HANDSHAKE_S = 10.0  # a store answers its handshake at once; a busy node 0 gets some time
# The first bytes every TCPStore client sends (torch 2.x): VALIDATE with the store's magic
# number, then PING with a nonce that the store sends back.
STORE_VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
STORE_PING = b"\x0d"


class MasterUnreachable(Exception):
    """Nothing listened on the master's port within the timeout."""


class NotAStore(Exception):
    """Something answers on the master's port, but not as a PyTorch store."""


class NodeZeroGaveUp(Exception):
    """Node 0 posted a verdict (why it stopped waiting) before every node had answered."""


def try_connect(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """'open', 'refused', 'timeout' or the OS's reason, within `timeout_s`."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as error:
        return errno.errorcode.get(error.errno or 0, "") or str(error)


def wait_until_listening(host: str, port: int, timeout_s: float) -> None:
    """Return once something listens on host:port; MasterUnreachable after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (result := try_connect(host, port)) != "open":
        if time.monotonic() > deadline:
            raise MasterUnreachable(f"nothing listens there ({result})")
        time.sleep(PORT_POLL_S)


def store_handshake(host: str, port: int, timeout_s: float = HANDSHAKE_S) -> str | None:
    """None when a PyTorch TCPStore answers on host:port as its own clients see it; else
    how what answers there is not one, in words. The bytes sent are exactly those a store
    client sends first, so a real store sees an ordinary client come and go. A connection
    that fails here is left to the store client to report."""
    nonce = struct.pack("<I", os.getpid() & 0xFFFFFFFF)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as connection:
            connection.sendall(STORE_VALIDATE + STORE_PING + nonce)
            reply = receive(connection, len(nonce))
            if reply == nonce:
                return None
            if reply:
                connection.settimeout(0.5)  # the rest of its answer, if it says more
                reply += receive(connection, 60)
    except TimeoutError:
        return f"it did not answer a PyTorch store's handshake within {timeout_s:g} s"
    except OSError:
        return None
    if not reply:
        return "it closed the connection at a PyTorch store's handshake"
    first_line = reply.decode("ascii", errors="replace").splitlines()[0]
    shown = "".join(char if char.isprintable() else "." for char in first_line)
    return f"it answered {shown!r} to a PyTorch store's handshake"


def receive(connection: socket.socket, size: int) -> bytes:
    """Up to SIZE bytes, fewer if the peer closes or goes quiet (after the first)."""
    data = b""
    while len(data) < size:
        try:
            chunk = connection.recv(size - len(data))
        except TimeoutError:
            if data:
                break
            raise
        if not chunk:
            break
        data += chunk
    return data


def open_store(
    host: str, port: int, node_rank: int, timeout_s: float, *, multi_tenant: bool = False
) -> TCPStore:
    """Node 0 listens on host:port (port 0: a free one, see `store.port`); the others wait
    until it does, then connect. Raises MasterUnreachable, or the store's own error."""
    from torch.distributed import TCPStore

    if node_rank == 0:
        return TCPStore(
            host, port, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    started = time.monotonic()
    wait_until_listening(host, port, timeout_s)
    # A store client that meets another service retries for the whole timeout, and longer,
    # printing C++ stack traces: find out first what answers.
    service = store_handshake(host, port)
    if service is not None:
        raise NotAStore(service)
    left = max(5.0, timeout_s - (time.monotonic() - started))
    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=left))


class RollCall:
    """Node ranks 0..nnodes-1 each answer once under `prefix`; everyone waits for all."""

    def __init__(self, store: Store, prefix: str, nnodes: int, node_rank: int):
        self.store = store
        self.prefix = prefix
        self.nnodes = nnodes
        self.node_rank = node_rank

    def key(self, node_rank: int) -> str:
        return f"{self.prefix}{node_rank}"

    @property
    def verdict_key(self) -> str:
        return f"{self.prefix}verdict"

    def answer(self, value: str) -> str:
        """Report this node. Returns what its key now holds: `value`, or the answer of an
        earlier node that gave the same node rank."""
        return self.store.compare_set(self.key(self.node_rank), "", value).decode()

    def answered(self) -> list[int]:
        return [rank for rank in range(self.nnodes) if self.store.check([self.key(rank)])]

    def answers(self) -> dict[int, str]:
        return {rank: self.store.get(self.key(rank)).decode() for rank in self.answered()}

    def wait(self, timeout_s: float) -> list[int]:
        """Poll until every node has answered or `timeout_s` passed; return the node ranks
        that answered. On the other nodes a verdict from node 0 raises NodeZeroGaveUp."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.node_rank != 0 and self.store.check([self.verdict_key]):
                self.acknowledge()
                raise NodeZeroGaveUp(self.store.get(self.verdict_key).decode())
            present = self.answered()
            if len(present) == self.nnodes or time.monotonic() > deadline:
                return present
            time.sleep(ROLL_POLL_S)

    def acknowledge(self) -> None:
        """Tell node 0, which waits for it before closing the store, that this node has
        read what it needs and goes its own way."""
        self.store.set(f"{self.prefix}ack/{self.node_rank}", "read")

    def post_verdict(self, verdict: str, present: list[int]) -> None:
        """Node 0 says why it gives up before it closes the store, so the nodes that came
        can say the same instead of failing on a lost connection; it waits a moment for
        them to read it."""
        self.store.set(self.verdict_key, verdict)
        waiting = [f"{self.prefix}ack/{rank}" for rank in present if rank != 0]
        deadline = time.monotonic() + VERDICT_ACK_S
        while waiting and time.monotonic() < deadline:
            time.sleep(0.1)
            waiting = [key for key in waiting if not self.store.check([key])]


# --- Comparing what the nodes said ---------------------------------------------------------


def group_labels(by_origin: dict[str, str]) -> dict[str, list[str]]:
    """{who: value} -> {value: [who, ...]}, in the order the values first appear."""
    grouped: dict[str, list[str]] = {}
    for origin, value in by_origin.items():
        grouped.setdefault(value, []).append(origin)
    return grouped


def describe_values(values: dict[str, list[str]]) -> str:
    return "; ".join(f"{value} on {', '.join(origins)}" for value, origins in values.items())


def disagreements(by_origin: dict[str, dict[str, str]]) -> dict[str, dict[str, list[str]]]:
    """{who: {name: value}} -> {name: {value: [who, ...]}} for every name whose value is not
    the same everywhere (a name some lack counts as "unset" there)."""
    names = sorted({name for values in by_origin.values() for name in values})
    found = {}
    for name in names:
        grouped = group_labels(
            {origin: values.get(name, "unset") for origin, values in by_origin.items()}
        )
        if len(grouped) > 1:
            found[name] = grouped
    return found
