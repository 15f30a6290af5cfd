"""`ddpcli bench-barrier`, one module per job:

- `rank`: one rank's clock, arrival board and guarded barrier;
- `demos`: the staggered-sleep and zero-first demos;
- `measure`: barrier latency and collective bandwidth;
- `hang`: a hung barrier turned into one summary;
- `run`: the ranks started and their report read; `worker`: what each rank runs.

May import launcher/ (its ranks are started as training's are), config/, environments/ and
the shared top-level modules. tests/test_architecture.py holds the table.
"""

from ddpcli.barrier.hang import BarrierHang
from ddpcli.barrier.run import run_bench

__all__ = ["BarrierHang", "run_bench"]
