"""`ddpcli check-env --probe`: a real collective among this node's processes and, with
--nnodes, across nodes, in stages that each have a short deadline, so the probe never hangs.

The parent (check-env on each node) plays the part of torchrun's agent: node 0's parent hosts
the rendezvous store on the master port and every node's parent answers a roll call on it
(ddpcli.launcher.rollcall), so a node that never comes is named. Each parent then runs its local
ranks (probe_ranks: `python -m ddpcli.checkenv.probe_worker REQUEST`), which join the
process group through that store, run the stages and log each one as it ends. The parents
swap their ranks' outcomes through the store, so that every node reports every rank.

The command runs this after ddpcli.checkenv.checks, with the facts the checks read.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpcli.checkenv.facts import Master, NodeFacts, comparable_facts
from ddpcli.checkenv.probe_plan import FACTS_FILE, ProbePlan, RankLayout, plan_probe
from ddpcli.checkenv.probe_ranks import run_local_ranks, unknown_outcomes
from ddpcli.checkenv.probe_rows import (
    STAGE_FIXES,
    consistency_rows,
    node_label,
    rank_rows,
    stage_rows,
)
from ddpcli.checkenv.report import Row, fail, ok
from ddpcli.config.checkenv import CheckEnvOptions
from ddpcli.errors import first_line
from ddpcli.launcher.rollcall import NotAStore, RollCall, open_store
from ddpcli.network import address_for, free_port, port_holder

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

NODE_PREFIX = "probe/node/"  # each node's record, under its node rank
OUTCOME_PREFIX = "probe/outcome/"  # each node's rank outcomes, under its node rank
READ_COUNTER = "probe/read"  # nodes that have read every outcome


def run_probe(
    options: CheckEnvOptions,
    facts: NodeFacts,
    master: Master,
    progress: Callable[[str], None],
) -> tuple[list[Row], dict]:
    """The probe's rows and its JSON document (`probe` in check-env's report)."""
    plan = plan_probe(options, facts, master)
    if isinstance(plan, Row):
        return [plan], {"ran": False, "reason": plan.detail}
    store, port, port_row = probe_store(plan, progress)
    if store is None:
        return [port_row], {"ran": False, "reason": port_row.detail}
    return probe_with_store(store, port, plan, facts, progress, port_row)


def probe_with_store(
    store: Store,
    port: int,
    plan: ProbePlan,
    facts: NodeFacts,
    progress: Callable[[str], None],
    port_row: Row,
) -> tuple[list[Row], dict]:
    record = node_record(facts, plan)
    try:
        nodes, nodes_row = join_nodes(store, plan, record)
    except Exception as error:  # node 0 went away while the nodes gathered
        detail = f"lost node 0's store: {first_line(error)}"
        nodes, nodes_row = None, fail("store rendezvous", detail, STAGE_FIXES["init"])
    rows = [port_row, nodes_row]
    document: dict[str, Any] = {
        "ran": True,
        "backend": plan.backend,
        "master": f"{plan.master_addr}:{port}",
        "nodes": nodes or [record],
    }
    if nodes is None:
        return rows, document
    layout = RankLayout([node["nproc"] for node in nodes])
    with tempfile.TemporaryDirectory(prefix="ddpcli-probe-") as workdir:
        node = nodes[plan.node_rank]
        local = run_local_ranks(plan, port, layout, node, Path(workdir), progress)
        gathered = read_json(Path(workdir) / FACTS_FILE)
    outcomes = exchange_outcomes(store, plan, layout, nodes, local)
    rows += stage_rows(outcomes) + rank_rows(outcomes)
    compared = gathered if isinstance(gathered, list) else nodes
    rows += consistency_rows(compared, nodes)
    document.update(
        world_size=layout.world_size,
        ranks=outcomes,
        facts=gathered,
        mismatches=[row.name for row in rows if row.name.startswith("mismatch")],
    )
    return rows, document


# --- The store and the nodes -----------------------------------------------------------------


def probe_store(
    plan: ProbePlan, progress: Callable[[str], None]
) -> tuple[TCPStore | None, int, Row]:
    """Node 0 listens on the master port; the others connect to it (the 'port open' row)."""
    if plan.hosts_store:
        port = plan.master_port
        try:
            store = open_store(plan.master_addr, port, 0, plan.join_timeout)
        except Exception as error:
            return None, port, busy_port_row(port, error)
        return store, store.port, ok("port open", f"the store listens on port {store.port}")
    port = plan.master_port or 0  # a joining node always has one (probe_plan)
    target = f"{plan.master_addr}:{port}"
    progress(f"probe: waiting up to {plan.join_timeout:g}s for node 0's store at {target}")
    started = time.monotonic()
    try:
        store = open_store(plan.master_addr, port, plan.node_rank, plan.join_timeout)
    except NotAStore as service:
        row = fail(
            "port open",
            f"a non-PyTorch service answers at {target}, not node 0's probe ({service})",
            "another service uses that port: give every node the same free --master-port, and "
            "check that --master-addr is node 0's",
        )
        return None, port, row
    except Exception as error:
        row = fail(
            "port open",
            f"could not reach node 0 at {target} within {plan.join_timeout:g}s: "
            f"{first_line(error)}",
            "start the probe on node 0 (--node-rank 0) too; check --master-addr, the route to "
            f"it and that TCP port {port} is open",
        )
        return None, port, row
    elapsed = time.monotonic() - started
    return store, port, ok("port open", f"reached {target} after {elapsed:.1f}s")


def busy_port_row(port: int, error: Exception) -> Row:
    holder = port_holder(port) if port else None
    held = f", held by {holder}" if holder else ""
    return fail(
        "port open",
        f"the store cannot listen on port {port}{held}: {first_line(error)}",
        f"pick a free port (--master-port {free_port()}) or stop the process that holds it",
    )


def node_record(facts: NodeFacts, plan: ProbePlan) -> dict:
    """What this node tells the others at the roll call."""
    names = sorted({gpu.name for gpu in facts.gpus if gpu.cuda_index is not None})
    return {
        "node_rank": plan.node_rank,
        "host": facts.host,
        "address": address_for(plan.ifname, plan.master_addr) or "",
        "nproc": plan.nproc,
        "nnodes": plan.nnodes,
        "pid": os.getpid(),
        "gpu": ", ".join(names) if plan.use_gpus else "cpu",
        **comparable_facts(facts.versions),
    }


def join_nodes(store: Store, plan: ProbePlan, record: dict) -> tuple[list[dict] | None, Row]:
    """Every node answers under its node rank; wait for all of them or name who is missing."""
    roll = RollCall(store, NODE_PREFIX, plan.nnodes, plan.node_rank)
    mine = json.dumps(record)
    taken = roll.answer(mine)
    if taken != mine:
        other = json.loads(taken)
        return None, fail(
            "store rendezvous",
            f"node rank {plan.node_rank} is already taken by {other['host']} ({other['address']})",
            "give every node its own --node-rank, 0..N-1",
        )
    roll.wait(plan.join_timeout)
    present = [json.loads(answer) for answer in roll.answers().values()]
    disagreeing = [node for node in present if node["nnodes"] != plan.nnodes]
    if disagreeing:
        return None, nnodes_disagreement_row(plan, disagreeing)
    if len(present) < plan.nnodes:
        return None, missing_nodes_row(plan, present)
    joined = ", ".join(f"{node_label(node)} × {node['nproc']}" for node in present)
    return present, ok("store rendezvous", f"{plan.nnodes} node(s) joined: {joined}")


def missing_nodes_row(plan: ProbePlan, present: list[dict]) -> Row:
    here = {node["node_rank"] for node in present}
    missing = [str(rank) for rank in range(plan.nnodes) if rank not in here]
    came = ", ".join(node_label(node) for node in present)
    hint = ""
    if "0" in missing and not plan.hosts_store:
        hint = " (something listens on the master port, but not node 0's probe: another job?)"
    return fail(
        "store rendezvous",
        f"the world never formed: node(s) {', '.join(missing)} of {plan.nnodes} did not join "
        f"within {plan.join_timeout:g}s{hint}; joined: {came}",
        "run the same command on every node with only --node-rank differing (0.."
        f"{plan.nnodes - 1}), and check --nnodes; raise --timeout if nodes start far apart",
    )


def nnodes_disagreement_row(plan: ProbePlan, disagreeing: list[dict]) -> Row:
    said = ", ".join(f"{node_label(node)} says --nnodes {node['nnodes']}" for node in disagreeing)
    return fail(
        "store rendezvous",
        f"the nodes disagree on the world: this node says --nnodes {plan.nnodes}, {said}",
        "run the same command on every node; only --node-rank differs",
    )


# --- The outcomes ----------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def exchange_outcomes(
    store: Store, plan: ProbePlan, layout: RankLayout, nodes: list[dict], local: list[dict]
) -> list[dict]:
    """Every node's ranks, swapped through the store; what never came is marked unknown."""
    if plan.nnodes == 1:
        return local
    roll = RollCall(store, OUTCOME_PREFIX, plan.nnodes, plan.node_rank)
    wait_s = 2 * plan.stage_timeout + 15  # the slowest node may still be timing a stage out
    outcomes = list(local)
    try:
        roll.answer(json.dumps(local))
        roll.wait(wait_s)
        answers = roll.answers()
        for node_rank in range(plan.nnodes):
            if node_rank == plan.node_rank:
                continue
            if node_rank in answers:
                outcomes += json.loads(answers[node_rank])
            else:
                outcomes += unknown_outcomes(layout, nodes[node_rank], "sent no report")
        store.add(READ_COUNTER, 1)
        if plan.hosts_store:  # keep the store up until every node has read the outcomes
            deadline = time.monotonic() + wait_s
            while store.add(READ_COUNTER, 0) < plan.nnodes and time.monotonic() < deadline:
                time.sleep(0.2)
    except Exception as error:  # node 0 went away: report what this node knows
        reached = {outcome["node_rank"] for outcome in outcomes}
        for node in nodes:
            if node["node_rank"] not in reached:
                reason = f"unknown: node 0's store closed ({first_line(error)})"
                outcomes += unknown_outcomes(layout, node, reason)
    return sorted(outcomes, key=lambda outcome: outcome["rank"])
