"""`ddpcli bench-barrier`, one module per job:

- `rank`: one rank's clock, arrival board and guarded barrier;
- `demos`: the staggered-sleep and zero-first demos;
- `measure`: barrier latency and collective bandwidth;
- `hang`: a hung barrier turned into one summary;
- `run`: the ranks started and their report read; `worker`: what each rank runs.
"""

from ddpcli.barrier.hang import BarrierHang
from ddpcli.barrier.run import run_bench

__all__ = ["BarrierHang", "run_bench"]
