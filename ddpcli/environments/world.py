"""The answer every launcher environment gives: this process's place in the world."""

from __future__ import annotations

from pydantic import BaseModel


class LauncherEnv(BaseModel):
    """Rank information a launcher (torchrun, the legacy launcher, SLURM, or our own
    elastic agent) hands to a worker through environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    launcher: str = "torchrun"
    agent_store: bool = False  # the elastic agent serves a TCPStore at MASTER_ADDR:PORT
