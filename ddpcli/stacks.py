"""Where a stopped rank was, read from the stack faulthandler wrote when it was stopped.

A rank stuck in a collective (or in its own hang) cannot run Python: faulthandler writes
its stack from the signal handler, to a file the launcher reads afterwards and turns into
a line, `train.py:88 in step(): loss.backward()`, instead of a screenful per rank.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
THREAD_HEADER = re.compile(r"^(Thread 0x|Current thread 0x|Stack \(most recent call first\))")

# Each worker of `ddpcli launch` writes its stack to FOLDER/stack-RANK.txt when stopped.
STACKS_FOLDER_VARIABLE = "DDPCLI_STACKS_DIR"


def stack_file_name(rank: int) -> str:
    return f"stack-{rank}.txt"


Frame = dict  # {"file": str, "line": int, "function": str}


def thread_stacks(dump: str) -> list[list[Frame]]:
    """Each thread's frames, most recent call first, from a faulthandler dump."""
    stacks: list[list[Frame]] = []
    for line in dump.splitlines():
        if THREAD_HEADER.match(line):
            stacks.append([])
        elif (match := FRAME.search(line)) and stacks:
            frame = match.groupdict()
            stacks[-1].append({**frame, "line": int(frame["line"])})
    return stacks


def is_thread_start(frame: Frame) -> bool:
    """threading.Thread's first frame. (A forked rank's main line starts in
    multiprocessing's Process._bootstrap, of the same name.)"""
    return frame["function"] == "_bootstrap" and frame["file"].endswith("threading.py")


def main_line(dump: str) -> list[Frame]:
    """The frames of the thread that runs the rank's program, not of a helper thread."""
    for frames in thread_stacks(dump):
        if not any(is_thread_start(frame) for frame in frames):
            return frames
    return []


def first_frame(dump: str, wanted: Callable[[Frame], bool]) -> Frame | None:
    """The most recent frame of the main line that WANTED accepts, with its line of code."""
    for frame in main_line(dump):
        if wanted(frame):
            return {**frame, "code": linecache.getline(frame["file"], frame["line"]).strip()}
    return None


def library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    ours = str(Path(__file__).parent)
    folders = (paths["stdlib"], paths["purelib"], paths["platlib"], ours)
    return tuple({folder + os.sep for folder in folders})


def is_users_code(frame: Frame) -> bool:
    """Not Python's, not an installed package's, not ddpcli's: the script's own."""
    file = frame["file"]
    return not file.startswith("<") and not file.startswith(library_folders())


def where_stopped(stack_file: Path) -> Frame | None:
    """The line of the user's code a stopped worker was at (or, if none of its frames is
    theirs, its most recent one); None if it left no stack."""
    try:
        dump = stack_file.read_text(errors="replace")
    except OSError:
        return None
    return first_frame(dump, is_users_code) or first_frame(dump, lambda frame: True)


def place_in_words(frame: Frame) -> str:
    file = frame["file"]
    with contextlib.suppress(ValueError):  # a script given by its full path, said shorter
        file = str(Path(file).relative_to(Path.cwd()))
    code = f": {frame['code']}" if frame.get("code") else ""
    return f"{file}:{frame['line']} in {frame['function']}(){code}"
