"""A run's loader workers end with its training, not at interpreter exit: a GPU run (pinned
memory) stopped mid-epoch by --max-steps sat 80 s after its last line (pytorch#81794)."""

import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, clean_env

from ddpcli.data.loader import LoaderBatches


class BlankImages(torch.utils.data.Dataset):
    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        return torch.zeros(3, 8, 8, dtype=torch.uint8), key[0] % 2


def test_close_ends_the_workers_of_a_loader_stopped_mid_epoch():
    loader = LoaderBatches(
        BlankImages(64), 4, torch.device("cpu"), [0.5] * 3, [0.2] * 3, 2, False, True
    )
    batches = iter(loader.for_epoch(list(range(64)), 0))
    next(batches)  # a run stopped here, with batches still prefetched
    workers = list(loader.loader._iterator._workers)
    assert workers and all(worker.is_alive() for worker in workers)
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 5
    assert not any(worker.is_alive() for worker in workers)


@pytest.mark.gpu
def test_a_gpu_run_on_the_loader_path_ends_soon_after_its_last_line(tmp_path):
    command = [
        sys.executable, "-m", "ddpcli", "train", "--gpus", "0", "--data-path", "loader",
        "--workers", "4", "--synthetic-size", "2048", "--image-size", "64", "--max-steps", "10",
        "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=clean_env(), cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        last_line_at = None
        for line in process.stderr:
            if "stopped by --max-steps" in line:
                last_line_at = time.monotonic()
        code = process.wait(timeout=120)
    finally:
        process.kill()
    assert code == 0 and last_line_at is not None
    assert time.monotonic() - last_line_at < 15, "the run's process outlived its last line"
