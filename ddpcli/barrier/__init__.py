"""`ddpcli bench-barrier`, one module per job:

- `rank`: one rank's clock, arrival board and guarded barrier;
- `demos`: the staggered-sleep and zero-first demos;
- `measure`: barrier latency and collective bandwidth;
- `hang`: a hung barrier turned into one summary;
- `run`: the benchmark's launch, its ranks started on the launcher's engine and their report
  read; `worker`: what each rank runs.

This package's own import is light (no torch): the command names BARRIER_WORKER_MODULE to
its fork server before this process imports torch (with `run`): the server then shares that
import and imports the worker while the command goes on.

May import launcher/ (its ranks are started as training's are), config/, environments/ and
the shared top-level modules. tests/test_architecture.py holds the table.
"""

# What each rank runs: `python -m ddpcli.barrier.worker`, or forked from a server importing it.
BARRIER_WORKER_MODULE = "ddpcli.barrier.worker"
