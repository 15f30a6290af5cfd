"""One training process: join the group, build the parts, train, leave cleanly.

Started by our elastic launcher as `python -m ddpcli.training.worker CONFIG.json`, or called
in-process when torchrun (or SLURM) already made this process a rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import signal
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch._dynamo  # noqa: F401 - DDP's constructor imports it: once, in the launcher, if forked

from ddpcli import ui
from ddpcli.collectives import record
from ddpcli.config.plan import RunPlan
from ddpcli.data.custom import custom_splits
from ddpcli.data.pipeline import DataPipeline
from ddpcli.data.sets import SKIPPED_IMAGES_FILE, load_splits
from ddpcli.dist import DistContext, init_distributed, shutdown
from ddpcli.environments import LauncherEnv, read_launcher_env
from ddpcli.errors import (
    INTERRUPTED,
    RUNTIME,
    STOPPED_FOR_PEER,
    USAGE,
    DdpcliError,
    agreed_error,
    debug_requested,
    first_line,
    gave_up_waiting,
    lost_a_peer,
    said_by_rank,
)
from ddpcli.files import write_text_atomic
from ddpcli.machine import cpu_count
from ddpcli.outputs.summary import SUMMARY_FILE, RunFiles, RunSummary, SkippedImages
from ddpcli.process import (
    collect_then_freeze,
    die_with_parent,
    end_quietly,
    exit_with_error,
    freeze_imported_objects,
    keep_freed_memory,
    record_for_agent,
    recorded,
    whole_lines,
)
from ddpcli.records import AGREED_STOP_FILE, LATER_ROUND_FILE, PEER_FAILED_FILE
from ddpcli.stacks import stack_output
from ddpcli.training.loop import Trainer
from ddpcli.training.settle import agreed_resume, settle_rank
from ddpcli.training.stopping import (
    Interrupted,
    note_failed_peers,
    note_interrupts,
    wait_if_terminating,
    was_interrupted,
)

DEVICE_DATA_FRACTION = 0.25  # of free device memory the uint8 set may take under `auto`


def keep_data_on_device(cfg: RunPlan, ctx: DistContext) -> bool:
    """True: the data set lives in device memory (`--data-path device`). `auto` does so for
    the synthetic set and STL-10 when they take at most DEVICE_DATA_FRACTION of the
    device's free memory; image folders stream through the loader unless `--data-path
    device` asks for the one-time decode (their size is unknown until decoded)."""
    if cfg.data_path != "auto":
        return cfg.data_path == "device"
    if cfg.dataset == "imagefolder" or cfg.custom_dataset:
        return False
    if ctx.device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(ctx.device)
    images = cfg.synthetic_size * 1.25 if cfg.dataset == "synthetic" else 13_000  # train + val
    return images * 3 * cfg.image_size**2 < DEVICE_DATA_FRACTION * free


def run_worker(cfg: RunPlan, env: LauncherEnv, later_round: bool = False) -> RunSummary:
    torch.set_num_threads(max(1, cpu_count() // max(1, env.local_world_size)))
    keep_freed_memory()
    ctx = init_distributed(
        env,
        want_gpu=not cfg.cpu,
        backend=cfg.backend,
        init_method=cfg.init_method,
        timeout_s=cfg.timeout,
    )
    resume = agreed_resume(cfg, env, ctx, later_round)
    try:
        summary = train_and_summarise(cfg, ctx, resume)
    except (KeyboardInterrupt, SystemExit):
        shutdown()  # Ctrl-C reaches every rank: they all leave here together
        raise
    # No teardown after an error: destroy_process_group waits for the NCCL work in flight,
    # maybe a collective the other ranks never join, until their watchdogs fire (--timeout).
    # The caller reports and ends this process at once instead (exit_for_error).
    shutdown()
    if ctx.is_main:  # only after a clean run: a failed one may still be debugged
        remove_init_file(cfg.init_method)
    return summary


def train_and_summarise(cfg: RunPlan, ctx: DistContext, resume: str | None) -> RunSummary:
    out = cfg.out
    device_resident = keep_data_on_device(cfg, ctx)
    splits = custom_splits(cfg) if cfg.custom_dataset else load_splits(cfg, ctx, device_resident)
    if ctx.is_main:  # a list an earlier run in this folder left would mislead
        skipped_file = out / SKIPPED_IMAGES_FILE
        skipped_file.unlink(missing_ok=True)
        if splits.skipped:
            skipped_file.write_text("\n".join(splits.skipped) + "\n")
    pipeline = DataPipeline(splits, cfg, ctx, device_resident)
    cfg = settle_rank(cfg, ctx, resume, pipeline.steps_per_epoch())
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    trainer = Trainer(cfg, ctx, pipeline)
    trained = trainer.fit()
    pipeline.close()
    summary = dataclasses.replace(
        trained,
        files=RunFiles.in_folder(out),
        skipped=skipped_images(cfg, splits.skipped, out),
        trackers=trainer.trackers.rows_report().get("trackers") if ctx.is_main else None,
    )
    if ctx.is_main:
        (out / SUMMARY_FILE).write_text(ui.json_text(summary.to_dict(), indent=2) + "\n")
        trainer.finish_trackers(summary)
    return summary


SKIPPED_NAMED = 10  # in summary.json; the file in --out lists every one


def skipped_images(cfg: RunPlan, skipped: list[str], out: Path) -> SkippedImages | None:
    """With --skip-bad-images: how many files were left out, the first few, and the list."""
    if not cfg.skip_bad_images:
        return None
    if not skipped:
        return SkippedImages(0)
    return SkippedImages(len(skipped), skipped[:SKIPPED_NAMED], str(out / SKIPPED_IMAGES_FILE))


def remove_init_file(init_method: str | None) -> None:
    """file:// init leaves its file behind, and the next run would hang on it."""
    if init_method and init_method.startswith("file://"):
        Path(init_method.removeprefix("file://")).unlink(missing_ok=True)


def end_interrupted(stop: BaseException | None, env: LauncherEnv, cfg: RunPlan) -> None:
    """Ctrl-C: the launcher says it once for the job, from what rank 0 leaves in --out."""
    if env.rank == 0 and isinstance(stop, Interrupted):
        with contextlib.suppress(OSError):
            (cfg.out / SUMMARY_FILE).write_text(ui.json_text(stop.record.to_dict()) + "\n")
    end_quietly(INTERRUPTED)


@recorded
def main(argv: list[str]) -> None:
    die_with_parent()
    whole_lines()
    freeze_imported_objects()
    # When the agent stops a stuck job (SIGTERM), where this rank was: in a file beside its
    # config, which the launcher's report says in a line (most often, the rank was not
    # stuck: another one failed, before the loop's own handling of the signal).
    stacks = stack_output(Path(argv[1]).parent)
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    record.arm_from_environment()
    note_interrupts()
    note_failed_peers(Path(argv[1]).with_name(PEER_FAILED_FILE))
    cfg = RunPlan.model_validate_json(Path(argv[1]).read_text())
    env = read_launcher_env()
    if env is None:
        exit_with_error("no launcher set RANK and WORLD_SIZE: run `ddpcli train`", USAGE)
    try:
        run_worker(cfg, env, later_round=Path(argv[1]).with_name(LATER_ROUND_FILE).exists())
        collect_then_freeze()
    except KeyboardInterrupt as stop:
        end_interrupted(stop, env, cfg)
    except Exception as error:
        record.dump_if_armed(error)  # for the verdict, if ranks stopped agreeing
        wait_if_terminating()  # a peer that left on the same SIGTERM: no news
        if was_interrupted():  # a peer that stopped first: a consequence of the Ctrl-C
            end_interrupted(None, env, cfg)
        if debug_requested() and not isinstance(error, DdpcliError):
            raise  # @recorded prints the traceback and hands it to the agent
        if not isinstance(error, DdpcliError) and (
            lost_a_peer(str(error)) or gave_up_waiting(error) or STOPPED_FOR_PEER in str(error)
        ):  # A consequence: the launcher names the rank that failed first, and why.
            record_for_agent(error)
            end_quietly(RUNTIME)
        error = in_our_words(error)
        speaks = True
        if isinstance(error, DdpcliError) and error.every_rank:
            speaks = says_agreed_stop(error, Path(argv[1]).with_name(AGREED_STOP_FILE))
        exit_for_error(error, env.rank, speaks)


def in_our_words(error: Exception) -> Exception:
    """DDP's advice for a parameter that got no gradient names its constructor's keyword:
    say the flag that sets it. Every rank meets it at the same step."""
    if isinstance(error, DdpcliError) or "find_unused_parameters=True" not in str(error):
        return error
    return agreed_error(
        "some of the model's parameters took no part in the loss (a branch it does not always "
        "take), and DDP waits for their gradients: add --find-unused-parameters"
    )


def says_agreed_stop(error: DdpcliError, record: Path) -> bool:
    """A stop every rank found together (a non-finite loss, a batch larger than a shard) is
    said once per node, not once per rank: each rank leaves the same words in RECORD (its
    launcher's private folder; each replaces it whole) for its launcher to say. Not rank 0
    alone: the agent may stop it before it gets there. True where this rank must say it
    itself (the record could not be written)."""
    words = ui.json_text({"failed": error.message, "exit_code": error.exit_code})
    try:
        write_text_atomic(record, words)
    except OSError:
        return True
    return False


def exit_for_error(error: Exception, rank: int, speaks: bool = True) -> NoReturn:
    """A failed rank's one line, then out at once: its process group is left as it is, so
    no teardown waits on peers that will never answer. SPEAKS false: another rank or the
    launcher says what ended the job."""
    if isinstance(error, DdpcliError):
        if not speaks:
            end_quietly(error.exit_code)
        exit_with_error(said_by_rank(rank, error.message), error.exit_code)
    record_for_agent(error)
    exit_with_error(f"rank {rank}: {type(error).__name__}: {first_line(error)}", 1)


if __name__ == "__main__":
    main(sys.argv)
