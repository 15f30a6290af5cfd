"""The recipe's per-image and per-batch draws (--auto-augment, --random-erase, Mixup/CutMix)
come from private generators: torch's global generators, the GPUs' among them (dropout,
stochastic depth), never move or restart. On the device path these options change a batch
at once, with no host synchronisation: the `meta` device stands in for a GPU on the CPU
(every copy to it and every read from it is visible), and the `gpu` tests check on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddpcli.data import autoaugment, device, erasing, mixing, sets
from ddpcli.data.augment import STREAM_AUTO_AUGMENT, stream_seeds

META = torch.device("meta")
POLICIES = ["ta_wide", "randaugment", "autoaugment"]


def tiny_set(count: int = 32, side: int = 16) -> sets.ImageSet:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, side, side), dtype=torch.uint8, generator=generator)
    return sets.ImageSet(images, torch.arange(count) % 3)


def device_batches(target: torch.device, policy: str, erase: float, count: int = 32):
    """An epoch of device-resident training batches with POLICY and erasing, as the pipeline
    builds it (ddpcli.data.pipeline.train_batches)."""
    batches = device.DeviceResidentBatches(
        tiny_set(count), list(range(count)), 16, target, [0.5] * 3, [0.2] * 3, "crop-flip",
        seed=1, epoch=0, auto_augment=autoaugment.policy_transform(policy), drop_last=True,
    )  # fmt: skip
    return erasing.ErasedBatches(batches, list(range(count)), 1, 0, erase)


# --- No host synchronisation ----------------------------------------------------------------


class HostSyncs(TorchDispatchMode):
    """Every operation that would make the host wait for a GPU: a read of a device tensor's
    value (.item(), bool(), .tolist()), a blocking copy between the host and the device, or
    an operation mixing host tensors (not scalars) with device ones (an implicit copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type != "cpu"]
        name = str(func.overloadpacket.__name__)
        if name == "_local_scalar_dense" and on_device:
            self.found.append("a read of a device value")
            return torch.zeros((), dtype=tensors[0].dtype).item()  # meta holds no value
        moved_to = kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
        if name == "_to_copy" and moved_to is not None and tensors[0].device != moved_to:
            if blocking:
                self.found.append(f"a blocking copy of {tuple(tensors[0].shape)}")
        elif name == "copy_" and len({t.device.type for t in tensors[:2]}) > 1:
            if blocking or len(args) < 3 or not args[2]:
                self.found.append(f"a blocking copy of {tuple(args[1].shape)}")
        elif on_device and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            self.found.append(f"{name} of a host tensor on the device")
        return func(*args, **kwargs)


@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_policies_and_erasing_on_the_device_path_never_wait_for_the_device(policy):
    batches = device_batches(META, policy, erase=0.5)
    with HostSyncs() as syncs:
        shapes = [tuple(images.shape) for images, _ in batches]
    assert shapes == [(16, 3, 16, 16)] * 2
    assert syncs.found == []  # each one stalls the GPU's queue, once per image before


def test_mixing_never_waits_for_the_device():
    images = torch.empty(8, 3, 16, 16, device=META)
    labels = torch.empty(8, dtype=torch.long, device=META)
    batch_mixing = mixing.BatchMixing(0.2, 1.0, num_classes=10, seed=0)
    with HostSyncs() as syncs:
        for key in range(6):
            mixed, targets = batch_mixing(images, labels, epoch=0, batch_key=key)
            assert mixed.shape == images.shape and targets.shape == (8, 10)
    assert syncs.found == []


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_policies_erasing_and_mixing_never_synchronise_the_gpu(policy):
    batches = device_batches(torch.device("cuda"), policy, erase=0.5, count=64)
    batch_mixing = mixing.BatchMixing(0.2, 1.0, num_classes=3, seed=0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for key, (images, labels) in enumerate(batches):
            mixed, targets = batch_mixing(images, labels, epoch=0, batch_key=key)
            mixed.sum(), targets.sum()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- Torch's own generators never move ------------------------------------------------------


@pytest.fixture
def reseeds(monkeypatch):
    """Every reseeding of torch's global generators, GPUs' included (torch.manual_seed calls
    torch.cuda.manual_seed_all, which would restart each GPU's stream from the data)."""
    calls: list[str] = []
    for module, name in ((torch, "manual_seed"), (torch.random, "manual_seed"),
                         (torch.cuda, "manual_seed_all"), (torch.cuda, "manual_seed")):  # fmt: skip
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda seed, name=name, real=real: calls.append(name))
    return calls


def run_every_option(target: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """A batch of each policy with erasing, then mixed; the outputs."""
    outputs = []
    batch_mixing = mixing.BatchMixing(0.2, 1.0, num_classes=3, seed=0)
    for policy in POLICIES:
        for key, (images, labels) in enumerate(device_batches(target, policy, erase=0.5)):
            outputs += [images, *batch_mixing(images, labels, epoch=0, batch_key=key)]
    return outputs


def test_no_option_reseeds_or_moves_torchs_generators(reseeds):
    before = torch.get_rng_state()
    first = run_every_option()
    assert reseeds == []  # GPU generators (dropout, stochastic depth) reseeded before
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(100)  # the global stream moves; the draws do not
    assert all(torch.equal(a, b) for a, b in zip(first, run_every_option(), strict=True))


@pytest.mark.gpu
def test_the_gpus_random_stream_goes_on_through_augmentation_and_mixing():
    torch.cuda.manual_seed(0)
    before = torch.cuda.get_rng_state()
    run_every_option(torch.device("cuda"))
    assert torch.equal(torch.cuda.get_rng_state(), before)


# --- A batch's draws are each image's own ----------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batch_gives_each_image_what_it_gets_alone(policy):
    # Every operation of the policy turns up among 96 images, the geometric ones in one call.
    transform = autoaugment.policy_transform(policy)
    generator = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (96, 3, 20, 20), dtype=torch.uint8, generator=generator)
    keys = torch.arange(500, 596)
    batched = autoaugment.auto_augment_images(images, keys, 4, 1, transform)
    seeds = stream_seeds(4, 1, keys, STREAM_AUTO_AUGMENT)
    for row in range(len(keys)):
        alone = autoaugment.auto_augment_images(images[row : row + 1], keys[row : row + 1], 4, 1,
                                                transform)  # fmt: skip
        assert torch.equal(batched[row], alone[0])
        torch.manual_seed(seeds[row])  # torchvision's own draws and pixels, as before
        assert torch.equal(batched[row], transform(images[row]))
    floats = images.float()
    erased = erasing.erase_images(floats, keys, 4, 1, 0.5)
    for row in (0, 7, 95):
        alone = erasing.erase_images(floats[row : row + 1], keys[row : row + 1], 4, 1, 0.5)
        assert torch.equal(erased[row], alone[0])
