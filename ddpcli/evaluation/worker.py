"""One rank of `ddpcli eval`, as started by the elastic launcher:
`python -m ddpcli.evaluation.worker REQUEST.json WORKDIR`. Rank 0 leaves its report in
WORKDIR/result.json for the launching process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Validation's view of image files resizes with torchvision: imported once, in the fork
# server that CPU ranks are forked from, not by each rank on its first batch.
import torchvision.transforms.v2  # noqa: F401

from ddpcli import ui
from ddpcli.collectives import record
from ddpcli.config.eval import EvalConfig
from ddpcli.environments import read_launcher_env
from ddpcli.errors import (
    RUNTIME,
    USAGE,
    DdpcliError,
    first_line,
    gave_up_waiting,
    lost_a_peer,
    said_by_rank,
)
from ddpcli.evaluation.plan import RESULT_FILE, EvalPlan
from ddpcli.evaluation.rank import run_rank
from ddpcli.files import write_text_atomic
from ddpcli.process import (
    collect_then_freeze,
    die_with_parent,
    end_quietly,
    exit_with_error,
    record_for_agent,
    recorded,
    whole_lines,
)


@recorded
def main(argv: list[str]) -> None:
    die_with_parent()
    whole_lines()
    record.arm_from_environment()
    request = json.loads(Path(argv[1]).read_text())
    cfg = EvalConfig.model_validate(request["config"])
    plan = EvalPlan(**request["plan"])
    env = read_launcher_env()
    if env is None:
        exit_with_error("no launcher set RANK and WORLD_SIZE: run `ddpcli eval`", USAGE)
    try:
        report = run_rank(cfg, plan, env)
        if report is not None:
            write_text_atomic(Path(argv[2]) / RESULT_FILE, ui.json_text(report))
        collect_then_freeze()
    except DdpcliError as error:
        exit_with_error(said_by_rank(env.rank, in_eval_words(error.message)), error.exit_code)
    except Exception as error:
        record.dump_if_armed(error)  # for the verdict, if ranks stopped agreeing
        record_for_agent(error)  # the launcher names the rank that failed first, and why
        if lost_a_peer(str(error)) or gave_up_waiting(error):  # a consequence: said there
            end_quietly(RUNTIME)
        exit_with_error(f"rank {env.rank}: {type(error).__name__}: {first_line(error)}", 1)


def in_eval_words(message: str) -> str:
    """Training's advice for an unreadable image names a flag eval does not have: every
    image counts here, so the file must be fixed or the folder evaluated without it."""
    return message.replace(
        ", or pass --skip-bad-images to leave such files out", " (every image is counted)"
    )


if __name__ == "__main__":
    main(sys.argv)
