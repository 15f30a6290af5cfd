"""The data paths behind one interface: `DataPipeline` picks the path in one place, and each
path answers for its own resume state, so the loop and its checkpoints never ask which."""

from __future__ import annotations

import pytest
import torch
from test_speed_paths import tiny_config

from ddpcli.config.plan import RunPlan
from ddpcli.data import sets
from ddpcli.data.pipeline import DataPath, DataPipeline, DevicePath, LoaderPath
from ddpcli.dist import DistContext


def context(rank: int = 0, world_size: int = 1) -> DistContext:
    return DistContext(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo")


def in_memory(size: int) -> sets.MemorySplits:
    images = torch.randint(0, 256, (size, 3, 8, 8), dtype=torch.uint8)
    image_set = sets.ImageSet(images, torch.arange(size) % 10)
    return sets.MemorySplits(image_set, image_set, 10, [f"c{i}" for i in range(10)])


def config(tmp_path, **overrides) -> RunPlan:
    settings = {"image_size": 8, "per_gpu_batch": 4, "synthetic_size": 32, "seed": 3}
    return tiny_config(tmp_path, **{**settings, **overrides})


@pytest.mark.parametrize(
    "device_resident,kind,name", [(True, DevicePath, "device"), (False, LoaderPath, "loader")]
)
def test_the_pipeline_picks_one_path_per_kind_of_data(tmp_path, device_resident, kind, name):
    data = DataPipeline(in_memory(32), config(tmp_path), context(), device_resident)
    assert type(data) is kind and isinstance(data, DataPath)
    assert data.device_resident is device_resident
    assert data.path_name.startswith(name)
    assert data.steps_per_epoch() == 8 and len(list(data.train_batches(0))) == 8
    data.close()


def test_a_sampled_path_keeps_no_stream_position_and_resumes_from_the_offset(tmp_path):
    """The in-memory paths' resume state is the sample offset the TrainState holds: their
    stream position stays None (the checkpoint's `stream_position`, unchanged), and loading
    one changes nothing about the rest of an epoch re-dealt from an offset."""
    data = DataPipeline(in_memory(32), config(tmp_path), context(1, 2), True)
    assert data.state_dict(batch_in_epoch=2, epoch_start=0) is None
    before = [labels.tolist() for _, labels in data.train_batches(0, start=8)]
    data.load_state_dict(None)
    after = [labels.tolist() for _, labels in data.train_batches(0, start=8)]
    assert after == before and sum(map(len, after)) == 12  # this rank's half of the other 24
