"""Where a stopped rank was, as one line: read from a faulthandler dump (`ddpcli launch`)
or from the main thread's frames (`ddpcli train`), and whether it waited at a collective."""

from __future__ import annotations

import sysconfig
import threading
import time
import traceback
from pathlib import Path

import ddpcli
from ddpcli import stacks

PACKAGE = Path(ddpcli.__file__).parent
SITE = Path(sysconfig.get_paths()["purelib"])
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def summary(*calls: tuple[Path, int, str]) -> traceback.StackSummary:
    """Frames as traceback.extract_stack gives them: outermost first."""
    return traceback.StackSummary.from_list([(str(f), line, name, "") for f, line, name in calls])


def test_the_place_is_the_innermost_line_of_ours_and_waiting_means_a_collective_below_it(
    monkeypatch,
):
    record = (SITE / "torch/distributed/elastic/multiprocessing/errors/__init__.py", 355, "wrapper")
    worker = (PACKAGE / "training" / "worker.py", 190, "main")
    loop = (PACKAGE / "training" / "loop.py", 120, "train_step")
    backward = (SITE / "torch/autograd/__init__.py", 1, "backward")
    ddp_forward = (SITE / "torch/nn/parallel/distributed.py", 1, "forward")
    sleep = (STDLIB / "queue.py", 1, "get")
    above = [record, worker, loop]  # the elastic @record wrapper far above is no collective
    cases = {
        "in DDP's backward": ([*above, backward], True),
        "in DDP's forward (its buffer broadcast)": ([*above, ddp_forward], True),
        "reading a batch": ([*above, sleep], False),
        "in our own code": (above, False),
    }
    for name, (calls, waiting) in cases.items():
        monkeypatch.setattr(stacks.traceback, "extract_stack", lambda frame, c=calls: summary(*c))
        place, found_waiting = stacks.main_thread_now()
        assert place is not None and place["function"] == "train_step", name
        assert found_waiting is waiting, name
        assert stacks.place_in_words(place) == "ddpcli/training/loop.py:120 in train_step()", name


def test_the_main_thread_is_read_from_another_thread():
    found = {}

    def read() -> None:
        time.sleep(0.2)  # the main thread is in its sleep below by then
        found["now"] = stacks.main_thread_now()

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(1.0)
    reader.join()
    place, waiting = found["now"]
    assert place["function"] == "test_the_main_thread_is_read_from_another_thread"
    assert place["code"] == "time.sleep(1.0)" and waiting is False


DUMP = """Thread 0x00007f2 (most recent call first):
  File "{stdlib}/threading.py", line 327 in wait
  File "{stdlib}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f1 (most recent call first):
  File "{site}/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "{script}", line 8 in <module>
  File "<frozen runpy>", line 88 in _run_code
"""


def test_a_dump_gives_the_scripts_line_on_the_main_thread(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n" * 7 + "dist.all_reduce(t)\n")
    dump = tmp_path / "stack-0.txt"
    dump.write_text(DUMP.format(site=SITE, stdlib=STDLIB, script=script))
    frame = stacks.where_stopped(dump)
    assert frame is not None
    assert stacks.place_in_words(frame).endswith("train.py:8 in <module>(): dist.all_reduce(t)")
    assert stacks.where_stopped(tmp_path / "none.txt") is None
