"""The probe's rows, from the outcomes of every rank: one row per stage (its failures
grouped by reason, with a hint when the error gives the cause away), one per rank, and
one per setting that differs between nodes."""

from __future__ import annotations

import re

from ddpcli.checkenv.facts import PROBE_TAG_VARIABLE
from ddpcli.checkenv.probe_plan import BARRIER_ITERATIONS, STAGES
from ddpcli.checkenv.report import FAIL, WARN, Row, fail, ok, warn
from ddpcli.launcher.rollcall import describe_values, disagreements, group_labels

STAGE_TITLES = {
    "start": "worker start",
    "init": "process group",
    "all_reduce": "all_reduce result",
    "facts": "rank facts",
    "barrier": "barrier latency",
    "bandwidth": "all_reduce bandwidth",
    "p2p": "GPU peer-to-peer",
}
STAGE_FIXES = {
    "start": "the worker could not start: its last lines are above; the same Python environment "
    "must exist on every node",
    "init": "every rank must reach the store and then every other rank: start the probe on all "
    "nodes at once, name the interface the nodes share (--ifname) and open the ports between "
    "them (docs/troubleshooting.md)",
    "all_reduce": "the network or backend corrupts data: isolate the transport with "
    "NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1, and check that every node has the same MTU",
    "facts": "a rank dropped out of the group: see the rank rows below",
    "barrier": "a rank dropped out of the group: see the rank rows below",
    "bandwidth": "a large message did not get through in time: a slow or lossy link (MTU "
    "mismatch?); retry with a larger --stage-timeout to measure it",
    "p2p": "export NCCL_P2P_DISABLE=1 (slower, through host memory); check `nvidia-smi topo -m` "
    "and turn off PCIe ACS / the IOMMU for GPU peer access",
}

HOST_MEMORY_FIX = (
    "`nvidia-smi topo -m` shows each pair's path (pairs across CPU sockets have no peer "
    "path); turn off PCIe ACS / the IOMMU for GPU peer access, or place a job's ranks on GPUs "
    "that share a switch or NVLink"
)


def node_label(node: dict) -> str:
    address = f", {node['address']}" if node.get("address") else ""
    return f"node {node['node_rank']} ({node['host']}{address})"


def stage_rows(outcomes: list[dict]) -> list[Row]:
    rows = []
    for stage in (*STAGES, "exit", "report"):
        results = [
            (outcome, record)
            for outcome in outcomes
            for record in outcome["stages"]
            if record["stage"] == stage
        ]
        if not results:
            continue
        failed = [(outcome, record) for outcome, record in results if not record["ok"]]
        title = STAGE_TITLES.get(stage, stage)
        if failed:
            fix = failure_hint(failed) + STAGE_FIXES.get(stage, "")
            rows.append(fail(title, describe_failures(failed), fix))
        elif stage == "p2p":
            rows.append(peer_to_peer_row(title, results))
        elif stage != "start":
            rows.append(ok(title, summarize(stage, results)))
    return rows


def describe_failures(failed: list[tuple[dict, dict]]) -> str:
    """Ranks that failed the same way share one line: 'ranks 0,1 on node 0 (...): why'."""
    by_reason: dict[str, list[dict]] = {}
    for outcome, record in failed:
        by_reason.setdefault(clean_detail(record["detail"] or ""), []).append(outcome)
    shown = [f"{ranks_on_nodes(outcomes)}: {reason}" for reason, outcomes in by_reason.items()]
    more = f"; and {len(shown) - 3} more" if len(shown) > 3 else ""
    return "; ".join(shown[:3]) + more


def clean_detail(detail: str) -> str:
    """Drop what the row already says (the rank) and C++ source locations."""
    detail = re.sub(r"^rank \d+: ", "", detail)
    return re.sub(r"\[(enforce fail at )?/[^\]]*\]\s*", "", detail)


def ranks_on_nodes(outcomes: list[dict]) -> str:
    by_node: dict[str, list[str]] = {}
    for outcome in outcomes:
        by_node.setdefault(node_label(outcome), []).append(str(outcome["rank"]))
    return ", ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {','.join(ranks)} on {node}"
        for node, ranks in by_node.items()
    )


def failure_hint(failed: list[tuple[dict, dict]]) -> str:
    """The cause some error messages give away, said in the user's terms."""
    details = " ".join(record["detail"] or "" for _, record in failed)
    addresses = " ".join(outcome.get("address") or "" for outcome, _ in failed)
    if re.search(r"remote=\[(127\.|::1\])", details) or re.search(r"\b127\.", addresses):
        return (
            "a rank advertised a loopback address, which other nodes cannot reach: pass --ifname "
            "with the interface the nodes share. "
        )
    if "Unable to find address for" in details:
        return "the interface named for Gloo/NCCL holds no address or is down: name another. "
    return ""


def summarize(stage: str, results: list[tuple[dict, dict]]) -> str:
    ranks = len(results)
    data = [record.get("data") or {} for _, record in results]
    seconds = max(record.get("seconds") or 0 for _, record in results)
    if stage == "init":
        return f"{ranks} rank(s) joined ({results[0][1]['detail']}) in {seconds:.1f}s"
    if stage == "all_reduce":
        return f"the sum over {ranks} rank(s) is exact on every rank"
    if stage == "facts":
        nodes = len({outcome["node_rank"] for outcome, _ in results})
        return f"gathered from {ranks} rank(s) on {nodes} node(s)"
    if stage == "barrier":
        p50 = max(item.get("p50_us", 0) for item in data)
        worst = max(item.get("max_us", 0) for item in data)
        return f"p50 {p50:.0f} µs, max {worst:.0f} µs (slowest rank, {BARRIER_ITERATIONS} barriers)"
    if stage == "bandwidth":
        return results[0][1]["detail"]
    return f"{ranks} rank(s) passed"


def peer_to_peer_row(title: str, results: list[tuple[dict, dict]]) -> Row:
    """Every pair swapped data intact; the transport says how: a pair without CUDA peer
    access passes too, through host memory, which is what this row warns about."""
    per_node = {o["node_rank"]: (r.get("data") or {}).get("node_pairs", 0) for o, r in results}
    intact = (
        f"every pair of GPUs on each node ({sum(per_node.values())} pair(s)) swapped data intact"
    )
    slow = pairs_named(results, "host_memory")
    unknown = pairs_named(results, "unknown")
    if slow:
        return warn(
            title,
            f"{intact}, but {slow} have no CUDA peer access: NCCL moves their data through host "
            "memory, at a fraction of NVLink's or PCIe's peer bandwidth",
            HOST_MEMORY_FIX,
        )
    transport = "direct peer access (NVLink or PCIe) on every pair"
    if unknown:
        transport = f"peer access unknown for {unknown} (not visible to one process)"
    return ok(title, f"{intact}; transport: {transport}")


def pairs_named(results: list[tuple[dict, dict]], kind: str) -> str:
    """'GPUs 0-1, 2-3 on node 0' for the pairs the ranks reported under `kind`."""
    named = []
    for outcome, record in results:
        for first, second in (record.get("data") or {}).get(kind, []):
            named.append((outcome["node_rank"], f"{first}-{second}"))
    if not named:
        return ""
    nodes = sorted({node for node, _ in named})
    by_node = [f"{', '.join(p for n, p in named if n == node)} on node {node}" for node in nodes]
    return "GPU pair(s) " + "; ".join(by_node)


def rank_rows(outcomes: list[dict]) -> list[Row]:
    rows = []
    for outcome in outcomes:
        marks = " ".join(
            f"{record['stage']} {'✓' if record['ok'] else '✗'}"
            for record in outcome["stages"]
            if record["stage"] != "start" or not record["ok"]
        )
        name, detail = f"rank {outcome['rank']}", f"{node_label(outcome)} · {marks}"
        if all(record["ok"] for record in outcome["stages"]):
            rows.append(ok(name, detail))
        else:
            rows.append(fail(name, detail, "see the failed stage above"))
    return rows


FACT_RULES = (
    ("torch", "torch", FAIL, "install the same torch build on every node (one container image)"),
    ("cuda", "CUDA", FAIL, "install the same torch build (same CUDA) on every node"),
    ("nccl", "NCCL", FAIL, "use the torch wheel's own NCCL everywhere (check LD_LIBRARY_PATH)"),
    ("cudnn", "cuDNN", WARN, "install the same torch build on every node"),
    ("python", "Python", WARN, "use the same Python version on every node"),
    ("gpu", "GPU model", WARN, "mixed GPU models run at the pace of the slowest one"),
    ("tag", PROBE_TAG_VARIABLE, FAIL, "every node should run the same image or release"),
)


def consistency_rows(records: list[dict], nodes: list[dict]) -> list[Row]:
    """Flag every setting that differs between nodes (or, for the GPU model, between ranks)."""
    rows = []
    for key, title, status, fix in FACT_RULES:
        values = values_by_origin(records, key)
        if len(values) > 1:
            rows.append(Row(f"mismatch: {title}", status, describe_values(values), fix))
    rows.extend(settings_rows(records))
    nprocs = {node_label(node): str(node["nproc"]) for node in nodes}
    if len(set(nprocs.values())) > 1:
        rows.append(
            Row(
                "mismatch: processes per node",
                WARN,
                describe_values(group_labels(nprocs)),
                "give every node the same --nproc unless the nodes differ on purpose",
            )
        )
    if rows:
        return rows
    first = records[0]
    return [
        ok(
            "same on every node",
            f"torch {first['torch']}, CUDA {first['cuda'] or 'none'}, NCCL "
            f"{first['nccl'] or 'none'}, Python {first['python']} on {len(nodes)} node(s)",
        )
    ]


def values_by_origin(records: list[dict], key: str) -> dict[str, list[str]]:
    by_origin = {}
    for record in records:
        origin = node_label(record)
        if key == "gpu" and "rank" in record:  # one node may hold different GPU models
            origin = f"rank {record['rank']} on {origin}"
        by_origin[origin] = str(record.get(key) or "unset")
    return group_labels(by_origin)


def settings_rows(records: list[dict]) -> list[Row]:
    differing = disagreements({node_label(r): r.get("settings", {}) for r in records})
    return [
        Row(
            f"mismatch: {name}",
            WARN,
            describe_values(values),
            f"set {name} the same way on every node (or nowhere): nodes that disagree "
            "may pick different transports and hang at init",
        )
        for name, values in differing.items()
    ]
