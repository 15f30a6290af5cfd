"""Where a stopped rank was, as one line: `train.py:88 in step(): loss.backward()`.

Two sources. A rank stuck in a collective (or in its own hang) cannot run Python:
faulthandler writes its stack from the signal handler, to a file the launcher reads
afterwards (`ddpcli launch`). A `ddpcli train` worker's watcher thread reads its main
thread's stack itself as it leaves (`main_thread_now`). Either beats a screenful per rank.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
THREAD_HEADER = re.compile(r"^(Thread 0x|Current thread 0x|Stack \(most recent call first\))")

# Each worker of `ddpcli launch` writes its stack to FOLDER/stack-RANK.txt when stopped.
STACKS_FOLDER_VARIABLE = "DDPCLI_STACKS_DIR"
PACKAGE = Path(__file__).parent  # ddpcli/, every package of it


def stack_file_name(rank: int) -> str:
    return f"stack-{rank}.txt"


def stack_output(folder: str | Path | None) -> TextIO:
    """Where this rank writes its stack when the agent stops it: a file in the launcher's
    FOLDER, which its report turns into a line where it tells where a rank was stuck, else
    stderr. Never on the screen under a launcher: a rank stopped because another one failed
    was not stuck."""
    if not folder:
        return sys.stderr
    try:
        return open(Path(folder) / stack_file_name(int(os.environ["RANK"])), "w")  # noqa: SIM115
    except (OSError, KeyError, ValueError):
        return sys.stderr


def finished_file_name(rank: int) -> str:
    """Left in the same folder by a worker whose script ended well (exit code 0)."""
    return f"finished-{rank}"


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
    folders = (paths["stdlib"], paths["purelib"], paths["platlib"], str(PACKAGE))
    return tuple({folder + os.sep for folder in folders})


def is_users_code(frame: Frame) -> bool:
    """Not Python's, not an installed package's, not ddpcli's: the script's own."""
    file = frame["file"]
    return not file.startswith("<") and not file.startswith(library_folders())


def is_ddpcli_or_users_code(frame: Frame) -> bool:
    return frame["file"].startswith(str(PACKAGE) + os.sep) or is_users_code(frame)


# Where a rank waits for its peers: torch.distributed's calls, DDP's own (its forward
# broadcasts buffers), and backward, where DDP's gradient all-reduce is waited for.
COLLECTIVE_CODE = tuple(
    os.sep + os.path.join("torch", *part.split("/")) + os.sep
    for part in ("distributed", "nn/parallel", "autograd")
)


def main_thread_now() -> tuple[Frame | None, bool]:
    """Read from another thread: the innermost line of ddpcli's or the user's code the main
    thread is at, and whether the calls it made from there wait at a collective."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    inner_calls: list[str] = []  # the files of the library calls made from that line
    for call in traceback.extract_stack(frame)[::-1] if frame else []:
        place: Frame = {"file": call.filename, "line": call.lineno, "function": call.name}
        if is_ddpcli_or_users_code(place):
            waiting = any(part in file for file in inner_calls for part in COLLECTIVE_CODE)
            return {**place, "code": call.line}, waiting
        inner_calls.append(call.filename)
    return None, False


def where_stopped(stack_file: Path) -> Frame | None:
    """The line of the user's code a stopped worker was at (or, if none of its frames is
    theirs, its most recent one); None if it left no stack."""
    try:
        dump = stack_file.read_text(errors="replace")
    except OSError:
        return None
    return first_frame(dump, is_users_code) or first_frame(dump, lambda frame: True)


# A frame of a traceback as Python prints it, and the line of code under it.
TRACEBACK_FRAME = re.compile(
    r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)\n(?P<code>    .*)?',
    re.MULTILINE,
)


def innermost_users_frame(traceback_text: str) -> Frame | None:
    """The last frame of the script's own code in a printed traceback, with its code."""
    frames = [match.groupdict() for match in TRACEBACK_FRAME.finditer(traceback_text)]
    theirs = [frame for frame in frames if is_users_code(frame)]
    if not theirs:
        return None
    frame = theirs[-1]
    return {**frame, "line": int(frame["line"]), "code": (frame["code"] or "").strip()}


def place_in_words(frame: Frame) -> str:
    file = frame["file"]
    for base in (Path.cwd(), PACKAGE.parent):  # a full path said shorter: train.py, ddpcli/...
        with contextlib.suppress(ValueError):
            file = str(Path(file).relative_to(base))
            break
    code = f": {frame['code']}" if frame.get("code") else ""
    return f"{file}:{frame['line']} in {frame['function']}(){code}"
