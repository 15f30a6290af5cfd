"""SLURM's srun: one task per GPU, ranks from SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID, the
master from the first host of the node list. srun sets no MASTER_ADDR or MASTER_PORT.

Only srun's tasks are a world. The shell of an sbatch script or of salloc also has SLURM_*
variables (SLURM_PROCID=0 and the job's SLURM_NTASKS in a batch script), and so has an
environment copied from a task; taken for rank 0 of the job's tasks, ddpcli would wait for
ranks nobody starts. srun sets the step's own variables in each task it starts
(SLURM_STEP_ID, SLURM_STEP_NUM_TASKS, ...; slurm's env_array_for_step), and neither shell
has them: without SLURM_STEP_ID the variables are not a world, and the run's header says they
were left aside. The world is the step's (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS): a
one-task step, such as `srun --pty bash`, is not one either.

Lightning decides otherwise (SLURMEnvironment: SLURM_NTASKS set and a job name other than
"bash" or "interactive"): that takes a batch script's shell for a world, and misses srun's
tasks in an allocation whose job is named "interactive". torch itself reads no SLURM
variable (torchrun ignores them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpcli.environments.world import (
    DEFAULT_MASTER_PORT,
    LauncherEnv,
    rank_below,
    set_variables,
    whole_number,
)
from ddpcli.environments.world import master_port as given_master_port

# Set by SLURM when it requeues a job (`--requeue`, a preemption): how often it has.
RESTART_VARIABLE = "SLURM_RESTART_COUNT"
# Set by srun in each task of a step, never in the batch or salloc shell.
STEP_VARIABLE = "SLURM_STEP_ID"
# What makes the world, in the order the run's header names them.
WORLD_VARIABLES = (
    "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
    STEP_VARIABLE, "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
FIX = (
    "srun sets it in each task; start ddpcli through srun, or unset the SLURM_* variables "
    "for ddpcli to start its own processes"
)


def detect(env: Mapping[str, str]) -> LauncherEnv | None:
    if "SLURM_PROCID" not in env or STEP_VARIABLE not in env:
        return None  # not a task of srun: a batch script's or salloc's shell (see above)
    world_variable = step_tasks_variable(env)
    world_size = whole_number(env, world_variable, FIX, 1, least=1)
    if world_size == 1:
        return None  # a one-task step (`srun --pty bash`) is not a world
    nodelist = (
        env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_NODELIST")
        or env.get("SLURM_JOB_NODELIST", "")
    )
    return LauncherEnv(
        rank=rank_below(env, "SLURM_PROCID", world_size, world_variable, FIX),
        local_rank=whole_number(env, "SLURM_LOCALID", FIX, 0),
        world_size=world_size,
        local_world_size=tasks_on_node(env),
        node_rank=whole_number(env, "SLURM_NODEID", FIX, 0),
        master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
        master_port=master_port(env),
        launcher="slurm",
        variables=set_variables(env, WORLD_VARIABLES),
    )


def step_tasks_variable(env: Mapping[str, str]) -> str:
    """The step's task count: srun's SLURM_STEP_NUM_TASKS, else SLURM_NTASKS."""
    return "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS", "") != "" else "SLURM_NTASKS"


def left_aside(env: Mapping[str, str]) -> str | None:
    """`SLURM_PROCID=0 SLURM_NTASKS=4 left aside: ...` when SLURM's variables would have
    made a world of several tasks but no srun started this process; else None."""
    tasks = env.get("SLURM_NTASKS", "").strip()
    if STEP_VARIABLE in env or not (tasks.isdigit() and int(tasks) > 1):
        return None
    shown = " ".join(
        f"{name}={value}" for name, value in set_variables(env, WORLD_VARIABLES).items()
    )
    return (
        f"{shown} left aside: without srun's {STEP_VARIABLE} this process is no task of srun "
        "(`srun ddpcli train ...` makes each task one rank)"
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
    port = given_master_port(env)
    if port is not None:
        return port
    job_id = env.get("SLURM_JOB_ID", "")
    return 15000 + int(job_id) % 10000 if job_id.isdigit() else DEFAULT_MASTER_PORT
