"""--compile's modes, and CUDA graphs under reduce-overhead and max-autotune: the training
step captured, and evaluation's full batches; what each mode does is stated in the header.

Reasoned from torch 2.14's source (torch/_dynamo/backends/distributed.py,
torch/_inductor/cudagraph_trees.py); what only a GPU can confirm is listed in docs/train.md
("Compile and CUDA graphs") and run by tests/test_compile_mode.py's `gpu` tests:
- DDP under torch.compile: dynamo's DDPOptimizer splits the forward at DDP's buckets and
  compiles each piece, so backward is a chain of compiled pieces with the autograd engine's
  eager work between them: the gradients accumulated into .grad, DDP's reducer hooks (its
  all-reduce, and the fp16, bf16 and PowerSGD hooks, on DDP's own bucket buffers) and the
  step clock's gradient hooks all run outside the graphs.
- A graph's outputs live in its memory pool, and its next replay overwrites them. The loop
  reads the logits before its next call and computes the loss from them eagerly: no output
  is kept across calls (the loss and accuracy sums, which the non-finite checks read, are
  eager tensors). A .grad that backward creates is such an output, though, and the next
  micro-batch's replay overwrites it: a silently wrong accumulated gradient (pytorch#96693).
  So under graphs the gradients live in buffers allocated once, outside any capture, and
  are zeroed in place after each step (`keep_gradients`).
- CUDA graph trees start a new generation at a call only when no backward is pending;
  `torch.compiler.cudagraph_mark_step_begin()` before each call says so outright, also
  where evaluation's graphs come between two training steps.
- Each input shape is a graph of its own: evaluation's last, smaller batch runs eagerly
  (`EvalForward`). Training batches have one shape (the last, partial one is dropped; an
  epoch re-dealt at a new world ends in one larger batch: one more graph, recorded once).
On the CPU nothing is captured (inductor leaves CUDA graphs out of graphs of CPU tensors), so
there the graph modes run as default and nothing here applies.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ddpcli.config.plan import RunPlan
from ddpcli.config.train import CUDA_GRAPH_MODES

Forward = Callable[[torch.Tensor], torch.Tensor]


# What torch logs as it compiles that tells a user of the run nothing: dynamo leaves DDP's
# own profiler span ("DistributedDataParallel.forward") out of the graph, and inductor, on a
# machine with nvcc but no GPU, says which CUDA_HOME it guessed. Logger -> the message's start.
UNINFORMATIVE_COMPILE_NOTICES = {
    "torch._dynamo.variables.ctx_manager": "Profiler record function %s will be ignored",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


class LeaveOut(logging.Filter):
    """Drops the records whose message (before its arguments) starts with PREFIX."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_compile_notices() -> None:
    for name, prefix in UNINFORMATIVE_COMPILE_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, LeaveOut) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(LeaveOut(prefix))


def compiled(model: nn.Module, cfg: RunPlan) -> Forward:
    """MODEL under torch.compile in --compile-mode, or MODEL itself without --compile."""
    if not cfg.compile:
        return model
    quiet_compile_notices()
    return torch.compile(model, mode=cfg.compile_mode)


def graphs_apply(cfg: RunPlan, device: torch.device) -> bool:
    """Whether this run captures CUDA graphs: a graph mode, on a GPU."""
    return cfg.compile and cfg.compile_mode in CUDA_GRAPH_MODES and device.type == "cuda"


def step_begins() -> None:
    """Before each call of a compiled model under graphs: the outputs of earlier replays are
    done with, and the next replay may overwrite them."""
    torch.compiler.cudagraph_mark_step_begin()


def keep_gradients(model: nn.Module) -> None:
    """Every trainable parameter's gradient allocated now, outside any capture: backward then
    adds into it in place, never leaving a graph's output in .grad (see the module's
    docstring); the optimizer's zero_grad(set_to_none=False) keeps it. A parameter that gets
    no gradient in a step then steps with a zero one (weight decay and momentum still apply),
    as DDP has it on every rank anyway."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)


def prepare_profiler() -> None:
    """--profile-steps under graphs: a profiler started once before the first capture. One
    started only after a graph was captured fails on the graph's replays (pytorch#75504); this
    is torch's own workaround (torch.profiler._utils._init_for_cuda_graphs)."""
    from torch.autograd.profiler import profile

    with profile():
        pass


class EvalForward:
    """Evaluation's forward pass. With COMPILE_MODULE (under graphs), a batch of FULL_BATCH
    images runs in its module's graph, compiled on first use (the raw weights' and the EMA's
    are two modules), and any other size eagerly: the last, smaller batch of a rank's share
    would be a graph recorded anew for each size, and the ranks' sizes differ, for one batch
    an epoch. Eager, it counts exactly as the others do, with nothing padded to mask out.
    Without COMPILE_MODULE every batch runs eagerly, as validation always has."""

    def __init__(
        self, full_batch: int, compile_module: Callable[[nn.Module], Forward] | None = None
    ) -> None:
        self.full_batch = full_batch
        self.compile_module = compile_module
        self.graphs: weakref.WeakKeyDictionary[nn.Module, Forward] = weakref.WeakKeyDictionary()

    def __call__(self, module: nn.Module, images: torch.Tensor) -> torch.Tensor:
        if self.compile_module is None or len(images) != self.full_batch:
            return module(images)
        graph = self.graphs.get(module)
        if graph is None:
            graph = self.graphs[module] = self.compile_module(module)
        step_begins()
        return graph(images)


def eval_forward(cfg: RunPlan, device: torch.device) -> EvalForward:
    """Validation's forward for this run: full batches in graphs where graphs apply."""
    if not graphs_apply(cfg, device):
        return EvalForward(cfg.per_gpu_batch)
    mode = cfg.compile_mode
    return EvalForward(cfg.per_gpu_batch, lambda module: torch.compile(module, mode=mode))


def describe_compile(cfg: RunPlan, device: torch.device) -> str:
    """The header's words for --compile and its mode, on DEVICE."""
    if not cfg.compile:
        return "compile off"
    mode = cfg.compile_mode
    if mode not in CUDA_GRAPH_MODES:
        return "compile on"
    tuned = "tuned kernels, " if mode == "max-autotune" else ""
    if device.type == "cuda":
        return (
            f"compile on ({mode}: {tuned}CUDA graphs of the training step and of evaluation's "
            "full batches; the last, smaller one runs eagerly)"
        )
    as_on_cpu = "without them" if tuned else "as default"
    return f"compile on ({mode}: {tuned}CUDA graphs need a GPU; on the CPU it runs {as_on_cpu})"
