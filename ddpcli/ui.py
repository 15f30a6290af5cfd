"""What people see: rich output on stderr, JSON on stdout. No torch here."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

console = Console(stderr=True, highlight=False)


def info(message: str) -> None:
    console.print(message, markup=False, soft_wrap=True)


def warn(message: str) -> None:
    console.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True)


def error(message: str) -> None:
    # Messages quote paths and C++ errors like "[/src/pair.cc:152]": never markup.
    for line in message.splitlines():
        console.print(f"[bold red]error:[/bold red] {escape(line)}", soft_wrap=True)


def json_text(document: Any, indent: int | None = None) -> str:
    """Every JSON document ddpcli writes (metrics.jsonl, summary.json, --json): valid JSON
    for any reader. Python's json writes NaN and Infinity bare, which strict parsers (jq,
    JavaScript, most languages' standard libraries) refuse: a non-finite float is null."""
    return json.dumps(finite_or_none(document), indent=indent, default=str, allow_nan=False)


def finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def print_json(document: Any) -> None:
    """The only thing a `--json` command writes to stdout."""
    sys.stdout.write(json_text(document, indent=2) + "\n")
    sys.stdout.flush()


def format_metrics(metrics: dict) -> str:
    ema = ""
    if metrics.get("ema_val_acc") is not None:  # --ema: the averaged weights beside the raw
        ema = f" · EMA val acc {100 * metrics['ema_val_acc']:.2f}%"
    if metrics.get("val_loss") is None:  # a preemption inside the epoch: saved, not validated
        validation = "not validated"
    else:
        validation = f"val loss {metrics['val_loss']:.4f} · val acc {100 * metrics['val_acc']:.2f}%"
    fallback = ""
    if metrics.get("decoded_on_cpu"):  # --decode gpu: what its batches did not take
        count = metrics["decoded_on_cpu"]
        fallback = f" · {count} image{'s' if count != 1 else ''} decoded on the CPU instead"
    rate = rate_of(metrics)
    return f"train loss {metrics['train_loss']:.4f} · {validation}{ema} · {rate}{fallback}"


def rate_of(metrics: dict) -> str:
    """`1234 img/s`, or that there was none: a run stopped within its first, untimed steps."""
    rate = metrics.get("images_per_sec")
    return "img/s not measured" if rate is None else f"{rate:.0f} img/s"


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_size(count: float) -> str:
    """A byte count as every command says one: powers of 1024 by their IEC names, one
    decimal at most (512 B, 1 KiB, 25.5 KiB, 42.7 MiB)."""
    for unit in BYTE_UNITS[:-1]:
        if round(count, 1) < 1024:
            return f"{round(count, 1):g} {unit}"
        count /= 1024
    return f"{round(count, 1):g} {BYTE_UNITS[-1]}"


def epoch_line(metrics: dict, epochs: int) -> None:
    info(f"epoch {metrics['epoch']}/{epochs} · {format_metrics(metrics)}")


class TrainProgress:
    """A live bar on a terminal; one plain line per logging interval otherwise (logs, CI).
    Silent on every rank but 0."""

    def __init__(self, enabled: bool, epochs: int, steps_per_epoch: int):
        self.enabled = enabled
        self.epochs = epochs
        self.steps = steps_per_epoch
        self.live = enabled and console.is_terminal
        self.bar: Progress | None = None
        self.task: TaskID | None = None  # the epoch on the bar, from start_epoch
        self.epoch = 0

    def __enter__(self) -> TrainProgress:
        if self.live:
            self.bar = Progress(
                TextColumn("epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f} · acc {task.fields[acc]:.1%}"),
                TextColumn("· {task.fields[rate]} img/s{task.fields[ranks]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.__exit__(*exc)

    def start_epoch(self, epoch: int, done: int) -> None:
        self.epoch = epoch + 1
        if self.bar:
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(
                "train", total=self.steps, completed=done, epoch=f"{self.epoch}/{self.epochs}",
                loss=0.0, acc=0.0, rate=rate_text(None), ranks="",
            )  # fmt: skip

    def update(
        self, step: int, loss: float, acc: float, rate: float | None, row: dict | None = None
    ) -> None:
        """RATE is images/s over the timed window, None while that window has not opened;
        ROW: the interval's steps.jsonl row, for the data wait and the slowest rank."""
        if not self.enabled:
            return
        ranks = rank_text(row or {})
        if self.bar:
            if self.task is not None:  # start_epoch puts the epoch on the bar
                self.bar.update(
                    self.task, completed=step, loss=loss, acc=acc, rate=rate_text(rate), ranks=ranks
                )
        else:
            info(
                f"epoch {self.epoch}/{self.epochs} step {step}/{self.steps} · loss {loss:.4f} · "
                f"acc {100 * acc:.1f}% · {rate_text(rate)} img/s{ranks}"
            )


def rank_text(row: dict) -> str:
    """` · data wait 12% · slowest rank 1 (+48%)`: the interval's mean data wait, and the
    rank that held the others up, when one did (ddpcli.outputs.rankload)."""
    if "data_wait_frac" not in row:
        return ""
    text = f" · data wait {100 * row['data_wait_frac']:.0f}%"
    if row.get("slowest_rank") is not None:
        text += f" · slowest rank {row['slowest_rank']} (+{100 * row['slowest_rank_excess']:.0f}%)"
    return text


def rate_text(rate: float | None) -> str:
    """`--` until there is a rate to show: the first steps are not timed, and 0 would read
    as a stalled run."""
    return "--" if rate is None else f"{rate:.0f}"
