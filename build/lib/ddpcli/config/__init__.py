"""The validated configuration of each command, one module per command, built in one place
from flags (and, for `train`, a recipe): `common` holds what they share.

May import environments/ (torchrun's PET_ variables as flag defaults), models/ (the names
`--arch` accepts, from models.archs) and the shared top-level modules; what it imports at
module level (pydantic, errors, factories, models.archs) never imports torch: `--help` and
`--dry-run` stay light.
"""

from ddpcli.config.barrier import BarrierConfig, build_barrier_config
from ddpcli.config.checkenv import CheckEnvOptions, build_check_options
from ddpcli.config.common import Backend, describe_validation_error
from ddpcli.config.launch import ScriptLaunchConfig, build_launch_config
from ddpcli.config.train import TrainConfig, build_train_config, load_recipe

__all__ = [
    "Backend",
    "BarrierConfig",
    "CheckEnvOptions",
    "ScriptLaunchConfig",
    "TrainConfig",
    "build_barrier_config",
    "build_check_options",
    "build_launch_config",
    "build_train_config",
    "describe_validation_error",
    "load_recipe",
]
