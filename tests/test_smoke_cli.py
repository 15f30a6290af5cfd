from conftest import run_cli


def test_help_lists_all_commands():
    result = run_cli("--help", timeout=60)
    assert result.returncode == 0
    for command in ("train", "checkpoint"):
        assert command in result.stdout
