"""One rank's work: the process a launcher starts, and the parts its loop is made of.

- `worker`: join the group, build the parts, train, leave; `preflight`: the user's own code
  run once in the launcher before any worker starts;
- `loop`: the Trainer (epochs, steps, accumulation, the stops), and its parts: `parts`
  (model, optimizer, device math), `schedule` (steps, rate schedule, `--max-steps`, the
  position after a world change), `validation` (each sample once, EMA alongside),
  `metrics` (timing, reductions), `checkpointing` (save, load, resume), `header` (what is
  said before the first step);
- `strategy` (ddp, dp, balanced-dp), `precision`, `syncbn`, `ema`, `param_groups`: how the
  model is wrapped, computed in, normalised, averaged and decayed;
- `compression`: what DDP all-reduces (`--grad-compression`: torch's fp16/bf16 hooks,
  ddpcli's PowerSGD hook and its per-rank state), and the bytes each sends per step;
- `stopping`: Ctrl-C and preemption, every rank agreeing to save and stop;
- `profiling`: `--profile-steps A:B`, one torch.profiler trace per rank of those steps.

May import checkpoint/, outputs/, data/, models/, config/, environments/ and the shared
top-level modules (the files a rank and its launcher leave each other are named in
ddpcli.records); never launcher/ or cli/. tests/test_architecture.py holds the table.
"""
