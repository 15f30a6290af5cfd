"""One rank of `ddpcli bench-barrier`, as started by the elastic launcher:
`python -m ddpcli.barrier.worker CONFIG.json WORKDIR`. Rank 0 leaves its report in
WORKDIR/result.json; a rank that times out at a barrier leaves hang-RANK.json there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpcli.barrier.rank import BarrierTimeout
from ddpcli.barrier.run import run_rank
from ddpcli.config import BarrierConfig
from ddpcli.environments import read_launcher_env
from ddpcli.errors import USAGE, DdpcliError, said_by_rank
from ddpcli.process import (
    collect_then_freeze,
    die_with_parent,
    exit_with_error,
    recorded,
    whole_lines,
)


@recorded
def main(argv: list[str]) -> None:
    die_with_parent()
    whole_lines()
    cfg = BarrierConfig.model_validate_json(Path(argv[1]).read_text())
    env = read_launcher_env()
    if env is None:
        exit_with_error("no launcher set RANK and WORLD_SIZE: run `ddpcli bench-barrier`", USAGE)
    try:
        run_rank(cfg, env, workdir=Path(argv[2]))
        collect_then_freeze()
    except BarrierTimeout as error:
        # Quiet: the launching process sums up what every rank left behind.
        os._exit(error.exit_code)  # the group is stuck: skip teardown that would wait on it
    except DdpcliError as error:
        exit_with_error(said_by_rank(env.rank, error.message), error.exit_code)


if __name__ == "__main__":
    main(sys.argv)
