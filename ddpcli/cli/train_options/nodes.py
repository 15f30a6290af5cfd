"""`ddpcli train`'s Multi-node panel: how the nodes of one job find each other, and how long
they wait."""

from __future__ import annotations

from typing import Annotated

from ddpcli.cli.train_options import train_option
from ddpcli.environments.world import DEFAULT_MASTER_PORT

PANEL = "Multi-node"

Nnodes = Annotated[
    str | None,
    train_option(
        "nnodes",
        "Nodes: N, or MIN:MAX to run on as many as come (c10d rendezvous, the same "
        "command on every host, no --node-rank; a lost host leaves a smaller world).",
        PANEL,
    ),
]

NodeRank = Annotated[int | None, train_option("node_rank", panel=PANEL)]

MasterAddr = Annotated[str | None, train_option("master_addr", panel=PANEL)]

MasterPort = Annotated[
    int | None,
    train_option(
        "master_port", panel=PANEL, default=f"a free port; {DEFAULT_MASTER_PORT} on several nodes"
    ),
]

RdzvBackend = Annotated[
    str | None,
    train_option(
        "rdzv_backend",
        "How the nodes meet: static (fixed --node-rank) or c10d (any order, no ranks).",
        PANEL,
        default="c10d for --nnodes MIN:MAX, else static",
    ),
]

RdzvEndpoint = Annotated[
    str | None,
    train_option(
        "rdzv_endpoint",
        "HOST[:PORT] where the nodes meet; the host that holds this address serves it.",
        PANEL,
        default="--master-addr:--master-port",
    ),
]

RdzvId = Annotated[
    str | None,
    train_option("rdzv_id", "The job's name in the rendezvous.", PANEL, default="ddpcli"),
]

InitMethod = Annotated[
    str | None,
    train_option(
        "init_method", "env:// | tcp://HOST:PORT | file:///PATH.", PANEL, default="env://"
    ),
]

Ifname = Annotated[
    str | None,
    train_option(
        "ifname", "Network interface for Gloo/NCCL.", PANEL, default="the one Gloo/NCCL pick"
    ),
]

Timeout = Annotated[float | None, train_option("timeout", panel=PANEL)]

MaxRestarts = Annotated[int | None, train_option("max_restarts", panel=PANEL)]
