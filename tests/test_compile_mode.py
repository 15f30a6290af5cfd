"""`--compile --compile-mode default|reduce-overhead|max-autotune`: CUDA graphs on the training
step and on evaluation's full batches (ddpcli.training.graphs), the pairings refused, and
`--precision auto` on GPUs from the size of the step. On the CPU the graph modes run as
default: a real two-rank run says so; the graph path's pieces run here with CUDA graphs
forced on; the captures themselves are the `gpu` tests'."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from conftest import read_metrics, run_cli
from test_speed_paths import context, rank_trainer, tiny_config, train_in_process
from torch import nn
from torch._dynamo.testing import CompileCounter

from ddpcli.training import graphs
from ddpcli.training.graphs import EvalForward, describe_compile, keep_gradients
from ddpcli.training.precision import (
    LAUNCH_BOUND_GFLOP,
    auto_gpu_precision,
    training_gflop_per_step,
)
from ddpcli.training.strategy import unwrap
from ddpcli.training.validation import Validation

TINY = ["--arch", "tinycnn", "--image-size", "32", "--per-gpu-batch", "16"]


# --- a real run on the CPU: the graph mode runs as default, and says so -------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "run"
    result = run_cli(
        "train", "--cpu", "--nproc", "2", *TINY, "--synthetic-size", "96", "--epochs", "1",
        "--max-steps", "3", "--compile", "--compile-mode", "reduce-overhead", "--out", str(out),
        timeout=240,
    )  # fmt: skip
    return result, out


def test_reduce_overhead_trains_on_the_cpu_as_default_and_says_so(cpu_run):
    result, out = cpu_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "compile on (reduce-overhead: CUDA graphs need a GPU; on the CPU it runs as default)"
        in result.stderr
    )
    config = json.loads((out / "config.json").read_text())
    assert config["compile"] is True and config["compile_mode"] == "reduce-overhead"
    # torch's compile-time notices that tell the user nothing are left out (graphs.py)
    assert not re.search(r"^\[rank\d+\]:W\d{4} ", result.stderr, re.M), result.stderr
    (metrics,) = read_metrics(out)
    assert metrics["step"] == 3 and metrics["world_size"] == 2
    assert metrics["val_samples"] == 24 and 0.0 <= metrics["val_acc"] <= 1.0
    assert torch.isfinite(torch.tensor([metrics["train_loss"], metrics["val_loss"]])).all()


# --- what the graph modes refuse: exit 2, one line, before any worker ------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--compile-mode", "reduce-overhead"],
            "invalid --compile-mode: reduce-overhead is a mode of torch.compile, which is off; "
            "add --compile",
        ),
        (
            ["--compile", "--compile-mode", "reduce-overhead", "--per-gpu-batch", "auto"],
            "invalid --per-gpu-batch: not with --compile-mode reduce-overhead, which captures "
            "CUDA graphs (auto runs micro-batches of varying sizes",
        ),
        (
            ["--compile", "--compile-mode", "max-autotune", "--sync-bn"],
            "invalid --sync-bn: not with --compile-mode max-autotune",
        ),
        (["--compile", "--compile-mode", "fast"], "invalid --compile-mode: must be 'default'"),
    ],
)
def test_what_graphs_cannot_hold_is_refused_in_one_line(in_process, args, said):
    result = in_process("train", "--cpu", *args, "--dry-run")
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_default_mode_and_the_graph_modes_with_what_they_allow_are_planned(in_process):
    for args in (
        ["--compile"],
        ["--compile", "--compile-mode", "reduce-overhead", "--accumulate", "2",
         "--grad-compression", "powersgd", "--profile-steps", "2:4"],
        ["--compile", "--compile-mode", "max-autotune", "--ema"],
    ):  # fmt: skip
        result = in_process("train", "--cpu", *args, "--dry-run", "--json")
        assert result.returncode == 0, result.stderr
        plan = json.loads(result.stdout)
        assert plan["compile_mode"] == (args[2] if len(args) > 1 else "default")


def test_no_compile_on_the_command_line_drops_the_recipes_mode(in_process, tmp_path):
    recipe = tmp_path / "graphs.toml"
    recipe.write_text('[train]\ncompile = true\ncompile_mode = "reduce-overhead"\n')
    result = in_process("train", "--cpu", "--recipe", str(recipe), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["compile_mode"] == "reduce-overhead"
    result = in_process(
        "train", "--cpu", "--recipe", str(recipe), "--no-compile", "--dry-run", "--json"
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["compile"] is False and plan["compile_mode"] == "default"


# --- the header's words ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("compile_mode", "device", "words"),
    [
        ("default", "cpu", "compile on"),
        ("default", "cuda", "compile on"),
        ("reduce-overhead", "cpu",
         "compile on (reduce-overhead: CUDA graphs need a GPU; on the CPU it runs as default)"),
        ("max-autotune", "cpu", "compile on (max-autotune: tuned kernels, CUDA graphs need a GPU; "
         "on the CPU it runs without them)"),
        ("reduce-overhead", "cuda", "compile on (reduce-overhead: CUDA graphs of the training "
         "step and of evaluation's full batches; the last, smaller one runs eagerly)"),
    ],
)  # fmt: skip
def test_the_header_says_what_each_mode_does_where(tmp_path, compile_mode, device, words):
    cfg = tiny_config(tmp_path, compile=True, compile_mode=compile_mode)
    assert describe_compile(cfg, torch.device(device)) == words
    assert graphs.graphs_apply(cfg, torch.device(device)) == (
        compile_mode != "default" and device == "cuda"
    )
    assert describe_compile(tiny_config(tmp_path), torch.device(device)) == "compile off"


# --- evaluation: full batches in the graph, the last, smaller one eagerly -------------------


class Batches:
    """A data path's validation batches, as given."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches


def small_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 5))  # fmt: skip


def val_set(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randn(size, 3, 8, 8, generator=generator),
         torch.randint(0, 5, (size,), generator=generator))
        for size in sizes
    ]  # fmt: skip


def validated(tmp_path, batches, forward: EvalForward) -> tuple[float, float, int]:
    cfg = tiny_config(tmp_path, per_gpu_batch=4, precision="fp32")
    validation = Validation(cfg, context(), Batches(batches), RuntimeError, forward=forward)
    return validation.validate(small_model())


def test_the_last_smaller_batch_runs_eagerly_and_every_sample_counts_once(tmp_path):
    batches = val_set([4, 4, 2])  # a rank's share of 10, in batches of 4
    seen: dict[str, list[int]] = {"graph": [], "eager": []}

    def graph_of(module: nn.Module):
        def graph(images: torch.Tensor) -> torch.Tensor:
            seen["graph"].append(len(images))
            return module(images)

        return graph

    loss, accuracy, samples = validated(tmp_path, batches, EvalForward(4, graph_of))
    assert seen["graph"] == [4, 4]  # the last batch of 2 never reached the graph
    model, loss_sum, correct = small_model().eval(), 0.0, 0
    with torch.no_grad():
        for images, labels in batches:
            logits = model(images)
            loss_sum += nn.functional.cross_entropy(logits, labels, reduction="sum").double()
            correct += int((logits.argmax(1) == labels).sum())
    assert samples == 10
    assert loss == loss_sum / 10 and accuracy == correct / 10  # exact: nothing padded


def test_evaluation_compiles_one_shape_for_its_graph(tmp_path):
    """With dynamo for real: the last, smaller batch costs no recompilation."""
    batches = val_set([4, 4, 4, 1])
    counter = CompileCounter()
    forward = EvalForward(4, lambda module: torch.compile(module, backend=counter))
    graphed = validated(tmp_path, batches, forward)
    assert counter.frame_count == 1
    assert graphed == validated(tmp_path, batches, EvalForward(4))  # eager, every batch


# --- training under graphs: gradients that stay put ------------------------------------------


def test_backward_adds_into_the_kept_gradients_in_place():
    """The buffers keep_gradients makes are the ones backward accumulates into and the
    optimizer zeroes: no .grad is ever a tensor the compiled backward returned."""
    model, reference = small_model(), small_model()
    compiled = torch.compile(model, backend="aot_eager")
    keep_gradients(model)
    buffers = {name: p.grad.data_ptr() for name, p in model.named_parameters()}
    images, labels = val_set([6])[0]
    for part in (slice(0, 3), slice(3, 6)):  # two micro-batches, accumulated
        torch.compiler.cudagraph_mark_step_begin()
        nn.functional.cross_entropy(compiled(images[part]), labels[part]).backward()
        nn.functional.cross_entropy(reference(images[part]), labels[part]).backward()
    for (name, kept), (_, eager) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert kept.grad.data_ptr() == buffers[name]
        torch.testing.assert_close(kept.grad, eager.grad)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
    assert all(p.grad.data_ptr() == buffers[name] for name, p in model.named_parameters())


def test_the_loop_under_graphs_trains_as_eager_does(tmp_path, monkeypatch):
    """The loop's graph path (the step marked, gradients kept and zeroed in place,
    evaluation's forward) forced on the CPU, with --accumulate 2, where a stale .grad would
    show: the same weights and metrics as the run without --compile."""
    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, mode=None: real_compile(model, backend="aot_eager")
    )
    monkeypatch.setattr("ddpcli.training.loop.graphs_apply", lambda cfg, device: True)
    monkeypatch.setattr(graphs, "graphs_apply", lambda cfg, device: True)
    marks = []
    monkeypatch.setattr(
        torch.compiler, "cudagraph_mark_step_begin", functools.partial(marks.append, 1)
    )
    settings = dict(synthetic_size=64, per_gpu_batch=8, accumulate=2, max_steps=3,
                    precision="fp32", image_size=16)  # fmt: skip
    trainer, metrics = train_in_process(
        tiny_config(tmp_path / "graphs", compile=True, compile_mode="reduce-overhead", **settings)
    )
    eager_trainer, eager_metrics = train_in_process(tiny_config(tmp_path / "eager", **settings))
    assert trainer.graphs and len(marks) >= 6  # each micro-batch's call, and evaluation's
    for kept, eager in zip(
        unwrap(trainer.model).parameters(), unwrap(eager_trainer.model).parameters(), strict=True
    ):
        torch.testing.assert_close(kept, eager)
        assert kept.grad is not None  # kept, zeroed in place
    assert metrics["val_samples"] == eager_metrics["val_samples"]
    assert metrics["val_acc"] == pytest.approx(eager_metrics["val_acc"])
    assert metrics["train_loss"] == pytest.approx(eager_metrics["train_loss"], rel=1e-5)


# --- --precision auto on GPUs: bf16 where it wins ----------------------------------------------


def test_training_flops_per_step_match_the_measured_figures():
    # docs/performance.md, "The peers on one H100": 1.999 and 24.52 GFLOP per training image
    assert training_gflop_per_step("resnet18", 96, 128) == pytest.approx(1.999 * 128, rel=1e-3)
    assert training_gflop_per_step("resnet50", 224, 64) == pytest.approx(24.52 * 64, rel=1e-3)
    assert 1.999 * 128 < LAUNCH_BOUND_GFLOP < 24.52 * 64
    assert training_gflop_per_step("no.such.module:factory", 32, 8) is None  # not run
    assert training_gflop_per_step("timm:resnet18", 32, 8) is None


@pytest.mark.parametrize(
    ("capability", "step_gflop", "cuda_graphs", "precision", "why"),
    [
        ((7, 0), 1569.0, False, "fp32", "emulates bf16"),
        ((7, 5), 256.0, True, "fp32", "emulates bf16"),
        ((9, 0), 256.0, False, "fp32", "a launch-bound step on the GPU (compute capability 9.0; "
         "256 GFLOP per step on each GPU, under 600) without CUDA graphs"),
        ((9, 0), 256.0, True, "bf16", "CUDA graphs take the launch cost"),
        ((8, 0), 1569.0, False, "bf16", "(compute capability 8.0) has bf16 tensor cores and "
         "the step is compute-bound (1,569 GFLOP per step on each GPU)"),
        ((8, 6), None, False, "bf16", "auto: the GPU (compute capability 8.6) has bf16 tensor "
         "cores"),
    ],
)  # fmt: skip
def test_auto_on_a_gpu_is_bf16_where_it_wins(capability, step_gflop, cuda_graphs, precision, why):
    choice = auto_gpu_precision(capability, step_gflop, cuda_graphs)
    assert choice.precision == precision and why in choice.reason
    assert f"compute capability {capability[0]}.{capability[1]}" in choice.reason


@pytest.mark.parametrize(
    ("arch", "image_size", "batch", "compile_mode", "precision"),
    [
        ("resnet18", 96, 128, None, "fp32"),
        ("resnet18", 96, 128, "reduce-overhead", "bf16"),
        ("resnet18", 96, 128, "default", "fp32"),
        ("resnet50", 224, 64, None, "bf16"),
    ],
)
def test_a_rank_on_an_h100_settles_auto_from_its_step(
    tmp_path, monkeypatch, arch, image_size, batch, compile_mode, precision
):
    from ddpcli.training.settle import settle_rank

    monkeypatch.setattr("ddpcli.training.settle.gpu_capability", lambda device: (9, 0))
    compiled = {"compile": True, "compile_mode": compile_mode} if compile_mode else {}
    plan = tiny_config(tmp_path, arch=arch, image_size=image_size, per_gpu_batch=batch, **compiled)
    plan = plan.model_copy(update={"precision": "auto", "cpu": False})
    cuda = context(device="cuda:0")
    assert settle_rank(plan, cuda, None, micro_batches=1).precision == precision


# --- On a GPU: the graphs captured for real ---------------------------------------------------


def gpu_trainer(tmp_path, **overrides):
    cfg = tiny_config(
        tmp_path, cpu=False, compile=True, compile_mode="reduce-overhead", image_size=32,
        per_gpu_batch=16, synthetic_size=280, **overrides,
    )  # fmt: skip
    cfg.out.mkdir(parents=True, exist_ok=True)
    return rank_trainer(cfg, context(device="cuda:0"))


@pytest.mark.gpu
def test_reduce_overhead_captures_the_step_and_evaluation_on_a_gpu(tmp_path):
    """One epoch with EMA (two modules evaluated); 70 validation images, in batches of 16
    and a last one of 6 that runs eagerly."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    counters.clear()
    trainer = gpu_trainer(tmp_path, ema=True, ema_steps=1)
    metrics = trainer.fit().last_epoch
    assert trainer.graphs and counters["inductor"]["cudagraph_skips"] == 0
    manager = cudagraph_trees.get_manager(0, create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values())  # graphs recorded
    assert torch.isfinite(torch.tensor([metrics["train_loss"], metrics["val_loss"]])).all()
    # evaluation in graphs (full batches) and eager (the last) against all of it eager
    model = unwrap(trainer.model)
    eager = Validation(trainer.cfg, trainer.ctx, trainer.data, RuntimeError).validate(model)
    graphed = trainer.validation.validate(model)
    assert graphed[2] == eager[2] == metrics["val_samples"]
    assert graphed[0] == pytest.approx(eager[0], rel=1e-3)
    assert abs(graphed[1] - eager[1]) <= 1 / graphed[2]


@pytest.mark.gpu
def test_accumulated_gradients_under_graphs_match_eager_on_a_gpu():
    """The stale .grad of pytorch#96693 would show here: 4 micro-batches accumulated under
    CUDA graphs, against the same in eager mode."""
    device = torch.device("cuda", 0)
    model, reference = small_model().to(device), small_model().to(device)
    compiled = torch.compile(model, mode="reduce-overhead")
    keep_gradients(model)
    images, labels = (tensor.to(device) for tensor in val_set([16])[0])
    for part in range(4):
        piece = slice(4 * part, 4 * part + 4)
        graphs.step_begins()
        nn.functional.cross_entropy(compiled(images[piece]), labels[piece]).backward()
        nn.functional.cross_entropy(reference(images[piece]), labels[piece]).backward()
    for kept, eager in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(kept.grad, eager.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("compression", ["none", "fp16", "powersgd"])
def test_ddp_under_graphs_with_comm_hooks_on_two_gpus(tmp_path, compression):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0,1", *TINY, "--synthetic-size", "520", "--epochs", "1",
        "--accumulate", "2", "--grad-compression", compression, "--compile", "--compile-mode",
        "reduce-overhead", "--out", str(out), timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CUDA graphs of the training step" in result.stderr
    (metrics,) = read_metrics(out)
    assert metrics["val_acc"] > 0.5  # the synthetic set is learnt in an epoch


@pytest.mark.gpu
def test_profile_steps_under_graphs_on_a_gpu(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", *TINY, "--synthetic-size", "512", "--epochs", "1",
        "--max-steps", "8", "--profile-steps", "4:6", "--compile", "--compile-mode",
        "reduce-overhead", "--out", str(out), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((out / "profile").glob("steps5-6/rank0-*.pt.trace.json"))
