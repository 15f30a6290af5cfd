"""One run's plan, made by one function: `plan_run(request, launcher) -> RunPlan`.

The request (`TrainConfig`: flags, recipe, launcher variables) is never rewritten; what this
machine settles becomes the plan (`ddpcli.config.plan.RunPlan`), in the order a run needs it:
1. the request checked against the disk and the network, every "auto" filled in, a requeue
   taken as `--resume auto`: no torch yet, so a typo is answered at once;
2. the GPUs torch can use, the precision and why, the rank's JPEG decoder (--decode gpu),
   the model built where the user's own code makes it, the resume file checked and stamped
   (torch from here on).
Every refusal is exit 2 with one line naming the flag: no worker has started. The CLI calls
it, and so do the tests. What a rank can only settle once it knows its world and data is
settled once, by the rank (`ddpcli.training.settle`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ddpcli.config import TrainConfig
from ddpcli.config.common import with_origins
from ddpcli.config.plan import RunPlan
from ddpcli.environments import LauncherEnv
from ddpcli.errors import DdpcliError
from ddpcli.launcher.resolve import (
    check_usable_gpus,
    checked_decoder,
    checked_settings,
    planned_precision,
)


def plan_run(
    request: TrainConfig,
    launcher: LauncherEnv | None,
    *,
    environ: Mapping[str, str] | None = None,
    origins: Mapping[str, str] | None = None,
    on_checked: Callable[[RunPlan], object] | None = None,
) -> RunPlan:
    """The run's plan. ORIGINS (where each setting came from) annotate the first stage's
    refusals; ON_CHECKED is called between the two stages, before torch is imported: the
    CLI starts the workers' fork server there, which then shares this process's torch
    import (ddpcli.launcher.fork)."""
    try:
        checked = RunPlan.model_validate(checked_settings(request, launcher, environ))
    except DdpcliError as error:
        raise with_origins(error, origins or {}) from None
    if on_checked is not None:
        on_checked(checked)
    # The second stage: these import torch.
    from ddpcli.checkpoint.schema import check_resume_source
    from ddpcli.training.preflight import preflight

    check_usable_gpus(checked)
    precision, precision_reason = planned_precision(checked)
    decode, decode_reason = checked_decoder(checked)
    return RunPlan.model_validate({
        **dict(checked),
        "precision": precision,
        "precision_reason": precision_reason,
        "decode": decode,
        "decode_reason": decode_reason,
        "model_facts": preflight(checked),  # the user's own code runs here first
        "resume_checked": check_resume_source(checked),
    })  # fmt: skip
