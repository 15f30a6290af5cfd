"""What a run finds and records beside its settings, never given: `RunFacts`, the part of
the plan (ddpcli.config.plan.RunPlan) that no flag or recipe sets. A request that gives one
is refused, in the words each field carries (ddpcli.config.common.refuse_resolved)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ddpcli.config.common import PER_NODE, Resolved


class RunFacts(BaseModel):
    """Found by the launcher's plan or settled by a rank; `config.json` keeps them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # --lr scaled to the global batch of the world that really runs (the launcher's for
    # --dry-run, each rank's from its process group), so that config.json holds the rate the
    # optimizer used.
    peak_lr: Annotated[
        float,
        Resolved(
            "the run computes it from lr, lr_base_batch and lr_scaling (set lr_scaling = "
            '"none" to use lr as given)',
            says_where=True,
        ),
    ]
    # Why `--precision auto` became what `precision` holds (the header says it;
    # ddpcli.training.precision decides it).
    precision_reason: Annotated[
        str | None, PER_NODE, Resolved("the run states why it chose one")
    ] = None
    # Why `--decode` became what `decode` holds (the header says it; ddpcli.launcher.resolve
    # decides it, ddpcli.launcher.plan checks the decoder is there).
    decode_reason: Annotated[str | None, PER_NODE, Resolved("the run states why it chose one")] = (
        None
    )
    # The command's --accumulate when a resume's batch policy set another to keep the global
    # batch (ddpcli.training.settle); the checkpoint keeps it, so that the next restart at the
    # same world keeps the policy's value.
    requested_accumulate: Annotated[int | None, Resolved("set accumulate")] = None
    # --per-gpu-batch auto, planned: per_gpu_batch holds each process's share of the global
    # batch (accumulate 1), which each rank runs in micro-batches that fit its device
    # (ddpcli.training.microbatch).
    batch_auto: Annotated[bool, Resolved('set per_gpu_batch = "auto"')] = False
    # The --resume file as the launcher found it when it checked its SHA-256
    # (ddpcli.checkpoint.loading.file_stamp): a rank that finds that same file does not read
    # it all again to hash it.
    resume_checked: Annotated[str | None, PER_NODE, Resolved("the launcher records its check")] = (
        None
    )
    # What --dry-run shows of a model the user's own code builds (its class, parameters);
    # not a setting of the run, so never in config.json.
    model_facts: Annotated[
        dict[str, Any], Resolved("the dry run shows what the model check found")
    ] = Field(default_factory=dict, exclude=True)
