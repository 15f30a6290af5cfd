"""`--per-gpu-batch auto`: each process's share of the global batch, run in micro-batches
that fit its device, and a step that runs out of memory run again smaller on every rank.

The plan gives each process its share of the global batch for every step (per_gpu_batch,
accumulate 1: the loader, the sample order and the epoch's accounting never change). Here:
- before the first step, each rank tries forward, backward and the optimizer step on
  micro-batches of the share, from the whole share down one more micro-batch at a time, on
  the first real batch, and keeps the largest that runs and leaves MARGIN of its GPU's
  memory free; the weights, optimizer, scaler and random state are put back after each try.
  The ranks take the smallest of their findings.
- every step runs its micro-batches under `no_sync`, DDP's own all-reduce never started;
  ddpcli's (ddpcli.training.gradsync) starts each bucket as the last micro-batch's backward
  fills it, as DDP's would, and a rank that runs out of memory starts the buckets it had
  not, so no rank is left waiting in one. Then the ranks agree in one small all-reduce
  whether every rank's forward and backward passes ran. If one did not, every rank drops
  the step's gradients, lowers the micro-batch and runs the step again; the loss is
  weighted by micro-batch size, so the step's gradient is the same whatever the split.
- an optimizer step out of memory (its activations are already freed) is retried at once on
  the rank that ran out, before it changed a weight, so every rank's update stays the same;
  the lower micro-batch reaches the other ranks at the next step's agreement.
On the CPU an out-of-memory is the kernel's OOM killer, which no rank survives: the share
runs whole, and the header says why, unless DDPCLI_FAKE_OOM makes one on purpose.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpcli import ui
from ddpcli.checkpoint.schema import capture_rng_state, restore_rng_state
from ddpcli.config.plan import RunPlan
from ddpcli.config.train import FAKE_OOM_VARIABLE
from ddpcli.dist import DistContext, all_gather_object, all_reduce_sum
from ddpcli.errors import agreed_error
from ddpcli.training.gradsync import GradientBuckets
from ddpcli.training.strategy import unwrap

# A micro-batch is kept only if the peak of its forward, backward and optimizer step leaves
# this share of the GPU's memory free: the next batches' shapes and the allocator's
# fragmentation need room the first batch did not show.
MARGIN = 0.10
# Lowerings within one step before the run ends, out of memory.
MAX_RETRIES = 8
# The agreement's codes, per rank: what ran out of memory.
PHASE_CODES = {"forward": 1, "backward": 2, "step": 3}
PHASE_WORDS = {1: "forward pass", 2: "backward pass", 3: "optimizer step"}


class FakeOom:
    """DDPCLI_FAKE_OOM's faults for this rank: (phase, batch, from step)."""

    def __init__(self, faults: list[tuple[int, str, int, int]], rank: int) -> None:
        self.faults = [(phase, batch, step) for r, phase, batch, step in faults if r == rank]
        self.rank = rank

    def fires(self, phase: str, micro_batch: int, steps_done: int) -> bool:
        return any(
            phase == fault_phase and micro_batch >= batch and steps_done >= step
            for fault_phase, batch, step in self.faults
        )

    def error(self, phase: str, micro_batch: int, steps_done: int) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(
            f"{FAKE_OOM_VARIABLE}: rank {self.rank} out of memory in {phase} at micro-batch "
            f"{micro_batch} (after step {steps_done})"
        )

    def check(self, phase: str, micro_batch: int, steps_done: int) -> None:
        if self.fires(phase, micro_batch, steps_done):
            raise self.error(phase, micro_batch, steps_done)

    @contextlib.contextmanager
    def midway(self, model: nn.Module, micro_batch: int, steps_done: int) -> Iterator[None]:
        """A backward pass that runs out of memory halfway, as a real one would: once the
        gradient of the middle parameter is in (some buckets may have started)."""
        if not self.fires("backward", micro_batch, steps_done):
            yield
            return
        parameters = [p for p in model.parameters() if p.requires_grad]

        def out_of_memory(_: torch.Tensor) -> None:
            raise self.error("backward", micro_batch, steps_done)

        handle = parameters[len(parameters) // 2].register_post_accumulate_grad_hook(out_of_memory)
        try:
            yield
        finally:
            handle.remove()


def micro_batch_sizes(total: int, micro_batch: int) -> list[int]:
    """TOTAL images in as few micro-batches of at most MICRO_BATCH as can hold them, their
    sizes as even as can be (torch.tensor_split's)."""
    pieces = math.ceil(total / micro_batch)
    return [len(part) for part in torch.arange(total).tensor_split(pieces)]


def next_lower(total: int, micro_batch: int) -> int:
    """The largest micro-batch below MICRO_BATCH that splits TOTAL into one more piece:
    finer than halving (64: 32, 22, 16, 13, 11, ...)."""
    for pieces in range(math.ceil(total / micro_batch) + 1, total + 1):
        if math.ceil(total / pieces) < micro_batch:
            return math.ceil(total / pieces)
    return 0


@dataclass
class Finding:
    """One rank's search: the micro-batch it keeps (0: not even 1 fits), what ran out of
    memory on the way ({micro-batch: phase, or "margin"}), and the memory it left free."""

    micro_batch: int
    failed: dict[int, str] = field(default_factory=dict)
    free_share: float | None = None


class MicroBatches:
    """One rank's micro-batching under --per-gpu-batch auto: the search, then every step."""

    def __init__(
        self,
        cfg: RunPlan,
        ctx: DistContext,
        model: nn.Module,
        forward_model: Callable[[torch.Tensor], torch.Tensor],
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        autocast: Callable[[], AbstractContextManager[object]],
    ) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.model, self.forward_model, self.loss_fn = model, forward_model, loss_fn
        self.optimizer, self.scaler, self.autocast = optimizer, scaler, autocast
        self.fake = FakeOom(cfg.fake_oom, ctx.rank)
        self.gradients = GradientBuckets(model, ctx, cfg.bucket_cap_mb)
        self.size: int | None = None  # the micro-batch, once searched (or resumed)
        self.note = ""  # the header's words on how it was found
        self.announced = False
        self.pending_step_failure = False  # this rank's optimizer step ran out of memory
        # What it is found on: a checkpoint's micro-batch holds on the same devices only.
        self.devices = describe_devices(all_gather_object(device_name(ctx.device), ctx))

    def resume(self, size: int | None, found_on: str | None) -> None:
        """A checkpoint's micro-batch, kept on the devices that found it; else searched again."""
        if size and found_on == self.devices:
            self.size = size
            self.note = f"auto: as the checkpoint found it on {found_on}"
        elif size:
            self.note = f"searched again: the checkpoint's {size} was found on {found_on}"

    def header_line(self, global_batch: int) -> str:
        assert self.size is not None
        share, world = self.cfg.per_gpu_batch, self.ctx.world_size
        sizes = micro_batch_sizes(share, self.size)
        if len(set(sizes)) == 1:
            return (
                f"per-GPU batch {self.size} ({self.note}) × accumulate {len(sizes)} × world "
                f"{world} = global batch {global_batch}"
            )
        return (
            f"per-GPU batch {share} in {len(sizes)} micro-batches of {max(sizes)} or "
            f"{min(sizes)} ({self.note}) × world {world} = global batch {global_batch}"
        )

    # --- the search, before the first step
    @property
    def searches(self) -> bool:
        """On a GPU; on the CPU only with DDPCLI_FAKE_OOM (see the module's docstring), on
        every rank alike: the search ends in a collective."""
        return self.ctx.device.type == "cuda" or bool(self.cfg.fake_oom)

    def search(self, images: torch.Tensor, targets: torch.Tensor, steps_done: int) -> None:
        """The largest micro-batch of this share (IMAGES, TARGETS) that every rank can run."""
        share = len(images)
        if not self.searches:
            self.size = share
            self.note = (
                "auto on the CPU: running out of memory there is the kernel's OOM killer, "
                "which no rank survives, so the batch is kept as planned"
            )
            return
        finding = self.own_search(images, targets, steps_done)
        findings: list[Finding] = all_gather_object(finding, self.ctx)
        self.size = min(f.micro_batch for f in findings)
        limiting = min(range(len(findings)), key=lambda rank: findings[rank].micro_batch)
        if self.size == 0:
            phase = findings[limiting].failed.get(1, "forward")
            raise agreed_error(
                f"--per-gpu-batch auto: rank {limiting} runs out of memory in its {phase} "
                "even at a micro-batch of 1; the model does not fit that device at this image "
                "size and precision (try --precision bf16, a smaller --image-size or model)"
            )
        found = search_note(findings, limiting, share)
        self.note = f"{self.note}; {found}" if self.note else found

    def own_search(self, images: torch.Tensor, targets: torch.Tensor, steps_done: int) -> Finding:
        saved = Snapshot(unwrap(self.model), self.optimizer, self.scaler)
        finding = Finding(micro_batch=len(images))
        while finding.micro_batch > 0:
            outcome, free = self.try_micro_batch(images, targets, finding.micro_batch, steps_done)
            saved.restore()  # after each try, the last included
            if outcome is None:
                finding.free_share = free
                break
            finding.failed[finding.micro_batch] = outcome
            finding.micro_batch = next_lower(len(images), finding.micro_batch)
        return finding

    def try_micro_batch(
        self, images: torch.Tensor, targets: torch.Tensor, size: int, steps_done: int
    ) -> tuple[str | None, float | None]:
        """(None, free share) if a micro-batch of SIZE runs forward, backward and the
        optimizer step here and leaves MARGIN free; else (the phase that ran out, or
        "margin", None)."""
        device = self.ctx.device
        total = others = 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            free, total = torch.cuda.mem_get_info(device)
            others = total - free - torch.cuda.memory_reserved(device)
        phase = "forward"
        try:
            with local_only(self.model):
                self.fake.check(phase, size, steps_done)
                with self.autocast():
                    loss = self.loss_fn(self.forward_model(images[:size]), targets[:size])
                phase = "backward"
                self.fake.check(phase, size, steps_done)
                self.scaler.scale(loss).backward()
                del loss
            phase = "step"
            self.fake.check(phase, size, steps_done)
            self.scaler.step(self.optimizer)
        except torch.OutOfMemoryError:
            return phase, None
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            forget_scaler_step(self.scaler)
            release_memory(device)
        if device.type != "cuda":
            return None, None
        left = (total - others - torch.cuda.max_memory_reserved(device)) / total
        return (None, left) if left >= MARGIN else ("margin", None)

    # --- every step
    def train_step(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        targets: torch.Tensor,
        sums: torch.Tensor,
        steps_done: int,
    ) -> None:
        """One optimizer step on this rank's share (IMAGES, its LABELS, the TARGETS it is
        trained on), its loss, correct answers and count added to SUMS once it ran."""
        assert self.size is not None, "search() comes first"
        for retry in range(MAX_RETRIES + 1):
            self.gradients.zero()
            step_sums, tried = torch.zeros_like(sums), self.size
            failed = self.run_micro_batches(images, labels, targets, step_sums, steps_done)
            self.gradients.start_the_rest()
            phases, sizes = self.agree(failed)
            self.size = min(sizes)
            ran = not any(code in (1, 2) for code in phases)
            self.gradients.finish(keep=ran)
            if ran:
                break
            self.optimizer.zero_grad(set_to_none=True)  # the step's gradients are dropped
            release_memory(self.ctx.device)
            if retry == MAX_RETRIES or self.size == 0:
                raise self.out_of_memory(phases, steps_done, retry + 1, tried)
            self.say_lowered(phases, steps_done, again=True)
        else:  # pragma: no cover - the loop always breaks or raises
            raise AssertionError
        if any(code == 3 for code in phases):
            self.say_lowered(phases, steps_done, again=False)
        sums += step_sums
        self.optimizer_step(len(images), steps_done)

    def run_micro_batches(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        targets: torch.Tensor,
        sums: torch.Tensor,
        steps_done: int,
    ) -> str | None:
        """Forward and backward on each micro-batch, gradients accumulated locally; the phase
        that ran out of memory, or None. Each micro-batch's mean loss is weighted by its share
        of the images, so the gradient is the share's mean whatever the split."""
        assert self.size is not None
        share, start = len(images), 0
        phase = None
        try:
            with local_only(self.model):
                sizes = micro_batch_sizes(share, self.size)
                for number, size in enumerate(sizes, 1):
                    part = slice(start, start + size)
                    start += size
                    phase = "forward"
                    self.fake.check(phase, self.size, steps_done)
                    with self.autocast():
                        logits = self.forward_model(images[part])
                        loss = self.loss_fn(logits, targets[part])
                    phase = "backward"
                    if number == len(sizes):  # its gradients complete the buckets
                        self.gradients.arm()
                    with self.fake.midway(self.model, self.size, steps_done):
                        self.scaler.scale(loss * (size / share)).backward()
                    with torch.no_grad():
                        sums[0] += loss.detach().double() * size
                        sums[1] += (logits.argmax(1) == labels[part]).sum()
                        sums[2] += size
                    del logits, loss
        except torch.OutOfMemoryError:
            self.size = next_lower(share, self.size)  # what this rank asks the others for
            return phase
        return None

    def agree(self, failed: str | None) -> tuple[list[int], list[int]]:
        """Every rank's (phase code, 0 where it ran; micro-batch it asks for), by one
        all-reduce that a rank out of memory joins as well as one that ran."""
        assert self.size is not None
        world, rank = self.ctx.world_size, self.ctx.rank
        code = PHASE_CODES[failed] if failed else (3 if self.pending_step_failure else 0)
        self.pending_step_failure = False
        told = torch.zeros(2 * world, dtype=torch.float64, device=self.ctx.device)
        told[rank], told[world + rank] = code, self.size
        heard = all_reduce_sum(told, self.ctx).tolist()
        return [int(c) for c in heard[:world]], [int(s) for s in heard[world:]]

    def optimizer_step(self, share: int, steps_done: int) -> None:
        """The optimizer's step; out of memory, it is retried at once at the lower
        micro-batch this rank asks for (the step had not yet changed a weight)."""
        assert self.size is not None
        for attempt in range(2):
            try:
                self.fake.check("step", self.size, steps_done)
                self.scaler.step(self.optimizer)
                break
            except torch.OutOfMemoryError:
                release_memory(self.ctx.device)
                if attempt == 1 or self.size <= 1:
                    raise
                self.size = next_lower(share, self.size)
                self.pending_step_failure = True
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    # --- what the ranks are told
    def say_lowered(self, phases: list[int], steps_done: int, again: bool) -> None:
        if not self.ctx.is_main:
            return
        if again:
            step, then = steps_done + 1, "the step runs again in"
        else:  # an optimizer step's, told at the next step's agreement
            step, then = steps_done, "its step was retried there, and every rank now runs"
        ui.warn(
            f"step {step}: out of memory in {who_ran_out(phases)}; {then} micro-batches of "
            f"{self.size} (the global batch, learning rate and sample order are kept)"
        )

    def out_of_memory(self, phases: list[int], steps_done: int, tries: int, size: int) -> Exception:
        return agreed_error(
            f"out of memory at step {steps_done + 1}: {who_ran_out(phases)} still ran out "
            f"after {tries} tries, down to micro-batches of {size}; the "
            "checkpoints saved so far are kept. Lower --global-batch, or free the GPU's memory"
        )


def who_ran_out(phases: list[int]) -> str:
    """ "the forward pass on rank(s) 0, 1 and the backward pass on rank(s) 2"."""
    said = []
    for code, words in PHASE_WORDS.items():
        ranks = [str(rank) for rank, phase in enumerate(phases) if phase == code]
        if ranks:
            said.append(f"the {words} on rank(s) {', '.join(ranks)}")
    return " and ".join(said)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def describe_devices(names: list[str]) -> str:
    """Every rank's device, counted: "3 x cpu", "4 x NVIDIA A100-SXM4-80GB, 4 x ..."."""
    counted = {name: names.count(name) for name in dict.fromkeys(names)}
    return ", ".join(f"{count} x {name}" for name, count in counted.items())


def search_note(findings: list[Finding], limiting: int, share: int) -> str:
    """The header's words: what ran out of memory where, and what the kept size leaves."""
    kept = findings[limiting].micro_batch
    failed = findings[limiting].failed
    free = findings[limiting].free_share
    if not failed:
        return "auto: the whole share fits" + (f", leaving {free:.0%} free" if free else "")
    above = min(failed)  # the smallest size that did not
    why = "left less than 10 % free" if failed[above] == "margin" else "ran out of memory"
    said = f"auto: {above} {why} on rank {limiting}"
    return said + (f"; {kept} leaves {free:.0%} free" if free is not None else f"; {kept} ran")


class Snapshot:
    """The weights, buffers, optimizer, scaler and random state as they were, on the CPU:
    put back after each try of the search, which must leave no trace."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> None:
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.optimizer_state = to_cpu(optimizer.state_dict())
        self.scaler_state = scaler.state_dict() if scaler.is_enabled() else None
        self.rng = capture_rng_state()  # as a checkpoint keeps it

    def restore(self) -> None:
        self.model.load_state_dict(self.weights)
        self.optimizer.load_state_dict(self.optimizer_state)
        if self.scaler_state is not None:
            self.scaler.load_state_dict(self.scaler_state)
        restore_rng_state(self.rng)
        self.optimizer.zero_grad(set_to_none=True)


def to_cpu(value: Any) -> Any:
    """A copy of VALUE (an optimizer's state dict) with its tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(item) for item in value)
    return value


def release_memory(device: torch.device) -> None:
    """What an out-of-memory left referenced (its traceback's frames) collected, and on a
    GPU the cached blocks returned, so the next try starts from what is really in use."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def local_only(model: nn.Module) -> AbstractContextManager[object]:
    """DDP's no_sync: the backward pass accumulates gradients without a collective."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


def forget_scaler_step(scaler: torch.amp.GradScaler) -> None:
    """A search's try ends without the scaler's update(): its record of having stepped (or
    unscaled) this optimizer is dropped, as update() would, for the next try."""
    if scaler.is_enabled():
        scaler._per_optimizer_states.clear()  # a defaultdict: fresh entries on next use
