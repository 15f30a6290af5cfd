"""One way to say a byte count (ddpcli.ui.byte_size), for every command that shows one:
bench-barrier's message sizes, checkpoint sizes, shards' sizes and stream buffers."""

from __future__ import annotations


def test_byte_counts_are_said_in_powers_of_1024_by_their_iec_names():
    from ddpcli.ui import byte_size

    sizes = [0, 4, 1023, 1024, 1536, 26_112, 1 << 20, 44_780_000, 1048570, 3 << 30, 5 << 40]
    assert [byte_size(size) for size in sizes] == [
        "0 B", "4 B", "1023 B", "1 KiB", "1.5 KiB", "25.5 KiB", "1 MiB", "42.7 MiB", "1 MiB",
        "3 GiB", "5 TiB",
    ]  # fmt: skip


def test_checkpoint_inspect_says_sizes_in_the_same_words(tmp_path):
    import torch
    from typer.testing import CliRunner

    from ddpcli.cli import app
    from ddpcli.files import atomic_save

    path = tmp_path / "weights.pt"
    atomic_save({"weight": torch.zeros(64, 100)}, path)  # 25,600 bytes of float32
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(path)])
    assert result.exit_code == 0, result.stderr
    shown = result.stdout + result.stderr
    assert "25 KiB" in shown and " KB" not in shown
