"""What a run leaves in its folder (`--out`), and what reads it back.

- `runfolder`: `--out` belongs to one run: its lock, an earlier run refused or continued;
- `steplog`: steps.jsonl, one row per logging interval (rank 0), passed on to `trackers/`
  (--tracker csv,mlflow,wandb,tensorboard; --tensorboard), each in a thread of its own;
- `rankload`: each rank's data wait and own compute, the slowest rank named, and its step
  split into data wait, compute, exposed communication and optimizer (`step_breakdown`);
- `curves`: a run's curves read from its folder, drawn (matplotlib) or as text (plotext);
- `summary`: what a run reports back (summary.json) as typed parts, each with one writer.

May import config/, environments/ and the shared top-level modules; training, the launcher
and the CLI write and read through it. Nothing here imports torch at module level (`ddpcli
plot` reads runs without it). tests/test_architecture.py holds the table.
"""
