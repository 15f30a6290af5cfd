"""The network's checks: each interface, the host name Gloo advertises, the master's
address and placement, the interface named with --ifname, and the master port."""

from __future__ import annotations

import ipaddress

from ddpcli.checkenv.facts import SOCKET_IFNAME_VARIABLES, Master, NodeFacts, hosts_master
from ddpcli.checkenv.report import Row, fail, ok, warn
from ddpcli.config.checkenv import CheckEnvOptions, is_loopback
from ddpcli.launcher.rollcall import CONNECT_TIMEOUT_S, try_connect
from ddpcli.network import (
    RESOLVE_TIMEOUT_S,
    Interface,
    free_port,
    port_holder,
    port_is_free,
)

# --- Checks: interfaces, host name, master --------------------------------------------------


def network_rows(facts: NodeFacts, options: CheckEnvOptions, master: Master) -> list[Row]:
    rows = [interface_row(iface, master) for iface in facts.interfaces]
    rows.append(hostname_row(facts, options))
    rows.extend(several_interfaces_rows(facts, options, master))
    rows.extend(master_rows(options, master))
    if options.ifname:
        rows.extend(ifname_rows(facts, options, master))
    return rows


def interface_row(iface: Interface, master: Master) -> Row:
    state = "up" if iface.up else "down"
    addresses = ", ".join(iface.addresses) or "no address"
    route = " · the route to the master leaves here" if master.interface == iface.name else ""
    return ok(f"interface {iface.name}", f"{state} · {addresses}{route}")


def socket_ifname_chosen(options: CheckEnvOptions, facts: NodeFacts) -> bool:
    return bool(options.ifname) or any(
        name in facts.environment for name in SOCKET_IFNAME_VARIABLES
    )


def hostname_row(facts: NodeFacts, options: CheckEnvOptions) -> Row:
    name = "host name"
    chosen = socket_ifname_chosen(options, facts)
    if facts.host_address is None:
        detail = f"{facts.host} does not resolve; Gloo needs it unless an interface is named"
        if chosen:
            return ok(name, detail)
        return warn(name, detail, "pass --ifname IFACE (or export GLOO_SOCKET_IFNAME=IFACE)")
    detail = f"{facts.host} → {facts.host_address}"
    if not is_loopback(facts.host_address):
        return ok(name, detail)
    if options.multi_node and not chosen:
        return warn(
            name,
            f"{detail} (loopback): without an interface Gloo advertises that address, which "
            "other nodes cannot reach",
            "pass --ifname IFACE (or export GLOO_SOCKET_IFNAME=IFACE NCCL_SOCKET_IFNAME=IFACE)",
        )
    return ok(name, f"{detail} (loopback: fine on one node; on several, name an interface)")


def several_interfaces_rows(
    facts: NodeFacts, options: CheckEnvOptions, master: Master
) -> list[Row]:
    candidates = [i.name for i in facts.interfaces if i.up and not i.loopback and i.ipv4]
    if len(candidates) < 2 or socket_ifname_chosen(options, facts):
        return []
    best = master.interface if master.interface in candidates else candidates[0]
    return [
        warn(
            "interface choice",
            f"{len(candidates)} interfaces carry IPv4 ({', '.join(candidates)}) and none is "
            "named: Gloo and NCCL may pick one the other nodes cannot reach",
            f"pass --ifname {best} (or export GLOO_SOCKET_IFNAME={best} NCCL_SOCKET_IFNAME={best})",
        )
    ]


def master_rows(options: CheckEnvOptions, master: Master) -> list[Row]:
    name = "master address"
    if master.ip is None:
        return [
            fail(
                name,
                f"{master.addr} does not resolve (within {RESOLVE_TIMEOUT_S:g}s)",
                "give node 0's IP address as --master-addr (or MASTER_ADDR)",
            )
        ]
    shown = master.addr if master.addr == master.ip else f"{master.addr} ({master.ip})"
    where = "this node" if master.this_node else f"another host, reached through {master.interface}"
    rows = [ok(name, f"{shown}:{master.port} · {where}")]
    rows.extend(master_placement_rows(options, master, shown))
    if ipaddress.ip_address(master.ip).is_global:
        rows.append(
            warn(
                "master exposure",
                f"{master.ip} is a public address, and the rendezvous store (TCPStore) on port "
                f"{master.port} has no authentication: anyone who reaches it can join or stall "
                "the job",
                "use node 0's private address (a cluster network), or firewall the master port",
            )
        )
    return rows


def master_placement_rows(options: CheckEnvOptions, master: Master, shown: str) -> list[Row]:
    if not options.multi_node:
        return []
    if master.loopback:
        return [
            fail(
                "master address",
                f"{shown} is loopback: the other {options.nnodes - 1} node(s) cannot reach it",
                "give node 0's address on the network the nodes share",
            )
        ]
    if options.node_rank == 0 and not master.this_node:
        return [
            fail(
                "node rank",
                f"--node-rank 0 makes this node the master, but {shown} is not one of its "
                "addresses",
                "run --node-rank 0 on the node that holds --master-addr, or fix the address",
            )
        ]
    if options.node_rank > 0 and master.this_node:
        return [
            fail(
                "node rank",
                f"{shown} belongs to this node, but --node-rank {options.node_rank} says "
                "another node is the master",
                "use --node-rank 0 here, or point --master-addr at node 0",
            )
        ]
    return []


def ifname_rows(facts: NodeFacts, options: CheckEnvOptions, master: Master) -> list[Row]:
    if options.ifname is None:  # nothing to check without --ifname
        return []
    iface = facts.interface(options.ifname)
    name = f"--ifname {options.ifname}"
    if iface is None:  # the kernel knows it, `ip` did not list it
        return [warn(name, "exists, but its state and addresses could not be read", "ip addr")]
    others = ", ".join(i.name for i in facts.interfaces if i.up and i.addresses and i is not iface)
    if not iface.up:
        fix = f"ip link set {iface.name} up, or choose one of: {others}"
        return [fail(name, f"{iface.name} is down", fix)]
    if not iface.addresses:
        fix = f"choose one that has an address: {others}"
        return [fail(name, f"{iface.name} is up but holds no address", fix)]
    rows = [ok(name, f"up · {', '.join(iface.addresses)} · {ifname_effect(iface.name, facts)}")]
    if iface.loopback and options.multi_node:
        rows.append(
            fail(name, "loopback cannot reach other nodes", "name the interface the nodes share")
        )
    elif master.interface and master.interface != iface.name and not master.loopback:
        rows.append(
            warn(
                "route to the master",
                f"traffic to the master {master.ip} leaves through {master.interface}, not "
                f"{iface.name}",
                f"use --ifname {master.interface}, or fix the route to {master.ip}",
            )
        )
    return rows


def ifname_effect(ifname: str, facts: NodeFacts) -> str:
    overridden = [
        f"{name}={facts.environment[name]}"
        for name in SOCKET_IFNAME_VARIABLES
        if facts.environment.get(name, ifname) != ifname
    ]
    effect = f"a run sets GLOO_SOCKET_IFNAME={ifname} and NCCL_SOCKET_IFNAME={ifname}"
    return effect + (f" (replacing {', '.join(overridden)})" if overridden else "")


# --- Checks: the master port -----------------------------------------------------------------


def port_rows(options: CheckEnvOptions, master: Master) -> list[Row]:
    name = f"master port {master.port}"
    if hosts_master(options, master):
        return [local_port_row(name, master.port)]
    if options.probe or master.ip is None:
        return []  # the probe waits for the master itself; an unresolved name is already failed
    return [remote_port_row(name, master, master.ip)]


def local_port_row(name: str, port: int) -> Row:
    if port_is_free(port):
        return ok(name, f"port {port} is free on this node (the master listens there)")
    holder = port_holder(port)
    held = f", held by {holder}" if holder else ""
    stop = f", or stop {holder}" if holder else ""
    return fail(
        name,
        f"port {port} is busy on this node{held}: the master cannot listen there",
        f"pick a free port (--master-port {free_port()} / MASTER_PORT){stop}",
    )


def remote_port_row(name: str, master: Master, ip: str) -> Row:
    """IP: the master's address, which port_rows has checked resolves."""
    result = try_connect(ip, master.port)
    target = f"{master.addr}:{master.port}"
    if result == "open":
        return ok(name, f"{target} is reachable and something listens (the master is up)")
    if result == "refused":
        return ok(name, f"{master.addr} answers; nothing listens on {master.port} yet (normal "
                  "before node 0 starts)")  # fmt: skip
    return fail(
        name,
        f"{target} cannot be reached ({result}) within {CONNECT_TIMEOUT_S:g}s",
        f"check --master-addr and the route to it; open TCP port {master.port} (and the ports "
        "Gloo/NCCL pick) between the nodes",
    )
