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

import ipaddress
from typing import Any

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
