"""`ddpcli` and `python -m ddpcli`. The command line's modules (typer, pydantic, rich, every
command's options) take half a second to load, seconds on a busy machine: a Ctrl-C then ends
it with the one line a later one gets, not Python's traceback of the imports."""

import sys

INTERRUPTED = 130  # 128 + SIGINT, as the commands exit on a later Ctrl-C


def main() -> None:
    try:
        from ddpcli.cli import main as run_command_line
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(INTERRUPTED) from None
    run_command_line()


if __name__ == "__main__":
    main()
