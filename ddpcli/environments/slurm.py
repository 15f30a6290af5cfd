"""SLURM's srun: one task per GPU, ranks from SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID, the
master from the first host of the node list. srun sets no MASTER_ADDR or MASTER_PORT."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpcli.environments.world import LauncherEnv

# Set by SLURM when it requeues a job (`--requeue`, a preemption): how often it has.
RESTART_VARIABLE = "SLURM_RESTART_COUNT"


def detect(env: Mapping[str, str]) -> LauncherEnv | None:
    if "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return None  # a one-task allocation (salloc, sbatch's shell) is not a world
    nodelist = (
        env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_NODELIST")
        or env.get("SLURM_JOB_NODELIST", "")
    )
    return LauncherEnv(
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        world_size=int(env["SLURM_NTASKS"]),
        local_world_size=tasks_on_node(env),
        node_rank=int(env.get("SLURM_NODEID", 0)),
        master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
        master_port=master_port(env),
        launcher="slurm",
    )


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as `gpu[01-04,07],login1` -> `gpu01`
    (`node[1-2]-ib` -> `node1-ib`); rank 0 runs there. No list: this machine."""
    first = re.match(r"([^,\[]+)(?:\[([^\]]+)\]([^,\[]*))?", nodelist.strip())
    if not first:
        return "127.0.0.1"
    prefix, ranges, suffix = first.group(1), first.group(2), first.group(3) or ""
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def tasks_on_node(env: Mapping[str, str]) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node;
    SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE read like `4(x2),2`, one entry per node."""
    spec = (
        env.get("SLURM_NTASKS_PER_NODE")
        or env.get("SLURM_STEP_TASKS_PER_NODE")
        or env.get("SLURM_TASKS_PER_NODE", "")
    )
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not counts:
        return 1
    return counts[min(int(env.get("SLURM_NODEID", 0)), len(counts) - 1)]


def master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT if set; else one derived from the job id, so two jobs sharing a node
    do not both take 29500 (Lightning's rule)."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    job_id = env.get("SLURM_JOB_ID", "")
    return 15000 + int(job_id) % 10000 if job_id.isdigit() else 29500
