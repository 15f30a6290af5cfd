"""torchrun, `python -m torch.distributed.launch`, our own elastic agent, and any launcher
that sets the env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpcli.environments.pods import pet_variables
from ddpcli.environments.world import LauncherEnv

# Set by torchrun's agent in each worker: how often it has restarted the workers.
RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"


def detect(env: Mapping[str, str]) -> LauncherEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    if pet_variables(env):  # a Kubeflow operator's pod index and pod count, not a worker's
        return None
    world_size = int(env["WORLD_SIZE"])
    return LauncherEnv(
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=world_size,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
        node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
        master_addr=env.get("MASTER_ADDR"),
        master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
        restart_count=int(env.get(RESTART_VARIABLE, 0)),
        launcher="elastic" if "TORCHELASTIC_RUN_ID" in env else "env",
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )
