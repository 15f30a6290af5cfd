"""torchrun, `python -m torch.distributed.launch`, our own elastic agent, and any launcher
that sets the env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpcli.environments.pods import pet_variables
from ddpcli.environments.world import (
    LauncherEnv,
    master_port,
    rank_below,
    set_variables,
    whole_number,
)

# Set by torchrun's agent in each worker: how often it has restarted the workers.
RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"
# What makes the world, in the order the run's header names them.
WORLD_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
FIX = "a launcher sets it; unset RANK and WORLD_SIZE for ddpcli to start its own processes"


def detect(env: Mapping[str, str]) -> LauncherEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    if pet_variables(env):  # a Kubeflow operator's pod index and pod count, not a worker's
        return None
    world_size = whole_number(env, "WORLD_SIZE", FIX, least=1)
    local_world_size = whole_number(env, "LOCAL_WORLD_SIZE", FIX, world_size, least=1)
    return LauncherEnv(
        rank=rank_below(env, "RANK", world_size, "WORLD_SIZE", FIX),
        local_rank=rank_below(env, "LOCAL_RANK", local_world_size, "LOCAL_WORLD_SIZE", FIX, 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=whole_number(env, node_rank_variable(env), FIX, 0),
        master_addr=env.get("MASTER_ADDR"),
        master_port=master_port(env),
        restart_count=whole_number(env, RESTART_VARIABLE, FIX, 0),
        launcher="elastic" if "TORCHELASTIC_RUN_ID" in env else "env",
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        variables=set_variables(env, WORLD_VARIABLES),
    )


def node_rank_variable(env: Mapping[str, str]) -> str:
    """torchrun's GROUP_RANK, else the NODE_RANK other launchers set."""
    return "GROUP_RANK" if env.get("GROUP_RANK", "") != "" else "NODE_RANK"
