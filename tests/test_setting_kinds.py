"""A setting's kind is marked on its field (ddpcli.config.common.Kind), and the lists other
parts keep are read from the marks: these tests hold the marks to the lists as they were."""

from __future__ import annotations

import inspect

import pytest

from ddpcli.config.common import (
    CHANGES_RESULT,
    PER_NODE,
    Kind,
    flag_settings,
    resolved_settings,
    settings_of_kind,
)
from ddpcli.config.eval import EvalConfig
from ddpcli.config.facts import RunFacts
from ddpcli.config.train import TrainConfig, build_train_config
from ddpcli.errors import DdpcliError


def test_the_per_node_settings_are_the_launchers_lists():
    """The launchers' hand-kept lists as they stood (train's, then eval's): the marks must
    give them exactly. Train's are the plan's: what the run found is compared too."""
    from ddpcli.config.plan import RunPlan

    assert set(settings_of_kind(RunPlan, PER_NODE)) == {
        "node_rank", "gpus", "data_dir", "data_path", "workers", "download", "out", "resume",
        "log_dir", "trace_samples", "ifname", "master_addr", "master_port", "init_method",
        "timeout", "world_from", "precision_reason", "slow_data", "resume_checked", "fake_oom",
        "decode", "decode_reason",
    }  # fmt: skip
    assert set(settings_of_kind(EvalConfig, PER_NODE)) == {
        "checkpoint", "data_dir", "out", "node_rank", "gpus", "workers", "ifname", "master_addr",
        "master_port", "init_method", "timeout",
    }  # fmt: skip


def test_the_settings_a_resume_compares_are_those_that_change_the_result():
    from ddpcli.checkpoint.schema import RESULT_SETTINGS

    assert set(RESULT_SETTINGS) == {
        "arch", "model_args", "dataset", "image_size", "synthetic_size", "epochs",
        "per_gpu_batch", "accumulate", "lr", "lr_base_batch", "lr_scaling", "optimizer", "betas",
        "momentum", "weight_decay", "warmup_epochs", "label_smoothing", "seed", "precision",
        "augment", "norm_weight_decay", "sync_bn", "ema", "ema_decay", "ema_steps",
        "mixup_alpha", "cutmix_alpha", "auto_augment", "random_erase", "ra_reps",
        "train_crop_size", "val_resize_size", "val_crop_size", "grad_compression",
        "powersgd_start_step", "global_batch",
    }  # fmt: skip
    assert settings_of_kind(TrainConfig, CHANGES_RESULT) == RESULT_SETTINGS
    assert "max_steps" not in RESULT_SETTINGS  # where a run stops; a resume may change it


def test_the_kinds_are_read_from_the_class_that_declares_them():
    """A subclass (the run's plan) has its parent's marks and its own."""
    from typing import Annotated

    from ddpcli.config.common import Resolved

    class Planned(TrainConfig):
        planned: Annotated[int | None, PER_NODE, Resolved("the planner sets it")] = None

    assert "planned" in settings_of_kind(Planned, PER_NODE)
    assert "planned" in resolved_settings(Planned)
    assert "planned" not in flag_settings(Planned)
    assert set(settings_of_kind(TrainConfig, PER_NODE)) < set(settings_of_kind(Planned, PER_NODE))


def test_a_field_narrowed_by_a_subclass_keeps_its_kinds():
    from ddpcli.config.facts import RunFacts
    from ddpcli.config.plan import RunPlan  # arch, out, lr...: None settled

    for kind in Kind:
        request_and_facts = settings_of_kind(TrainConfig, kind) + settings_of_kind(RunFacts, kind)
        assert set(settings_of_kind(RunPlan, kind)) == set(request_and_facts), kind
    assert resolved_settings(RunPlan) == resolved_settings(RunFacts)


def test_every_flag_of_train_sets_a_flag_setting():
    from ddpcli.cli.train import train

    parameters = set(inspect.signature(train).parameters)
    assert set(flag_settings(TrainConfig)) <= parameters
    not_flags = set(TrainConfig.model_fields) - set(flag_settings(TrainConfig))
    assert not not_flags & parameters


@pytest.mark.parametrize("name", list(resolved_settings(RunFacts)))
def test_a_resolved_setting_given_in_a_recipe_is_refused(tmp_path, name):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"{name} = 1\n")
    with pytest.raises(DdpcliError, match=f"{name} is not a setting; ") as error:
        build_train_config({}, recipe)
    assert error.value.exit_code == 2


def test_the_refusals_keep_their_words_and_their_order(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('peak_lr = 0.3\nprecision_reason = "x"\n')
    with pytest.raises(DdpcliError) as error:
        build_train_config({}, recipe)
    assert error.value.message == (
        "precision_reason is not a setting; the run states why it chose one"
    )
    with pytest.raises(DdpcliError) as error:
        build_train_config({"peak_lr": 0.3}, None)
    assert error.value.message == (
        "the flags: peak_lr is not a setting; the run computes it from lr, lr_base_batch and "
        'lr_scaling (set lr_scaling = "none" to use lr as given)'
    )
    recipe.write_text("peak_lr = 0.3\n")
    with pytest.raises(DdpcliError, match=f"^recipe {recipe}: peak_lr is not a setting"):
        build_train_config({}, recipe)


# `ddpcli train --help` in a process whose constants were changed before the CLI is imported.
CHANGED_CONSTANTS = """
import sys
import ddpcli.config.data as data
import ddpcli.config.train as train
import ddpcli.environments.world as world

data.BUFFER_MEMORY_FRACTION, data.BUFFER_BOUNDS = 1 / 4, (32, 5000)
train.REFERENCE_LR, train.BUILTIN_NET_LR, train.ADAMW_LR = 0.3, 0.7, 0.004
train.OPTIMIZER_DEFAULTS["sgd"].update(momentum=0.8, weight_decay=0.0004, lr_scaling="sqrt")
train.OPTIMIZER_DEFAULTS["adamw"].update(betas=[0.8, 0.99], weight_decay=0.06)
train.POWERSGD_DEFAULT_RANK = 7
world.DEFAULT_MASTER_PORT = 29511
from ddpcli.cli import main

sys.argv = ["ddpcli", "train", "--help"]
main()
"""


def test_help_reads_the_constants_it_states():
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "COLUMNS": "400"}
    result = subprocess.run(
        [sys.executable, "-c", CHANGED_CONSTANTS],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
    )  # fmt: skip
    help_text = " ".join(result.stdout.split())
    for stated in (
        "1/4 of it over its streams, 32 to 5000 samples",
        "sgd 0.3 (0.7 for smallcnn/tinycnn); adamw 0.004",
        "0.8 with sgd",
        "0.8,0.99 with adamw",
        "0.0004 sgd, 0.06 adamw",
        "sqrt for sgd, sqrt for adamw",
        "(powersgd: rank 7)",
        "29511 on several nodes",
    ):
        assert stated in help_text, stated
