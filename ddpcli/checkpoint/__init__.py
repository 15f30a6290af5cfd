"""Checkpoints, one module per job:

- `loading`: safe loads (weights_only=True), clear errors for bad files, state-dict fitting;
- `schema`: what a training checkpoint holds, built from and restored into the run's parts;
- `writer`: rank 0 saves, barriers, keep-last pruning, last.pt and best.pt;
- `report`: inspect, verify and convert, as plain data for the CLI; `trust`: which model a
  file may have rebuilt; `init`: `--init-from` weights.

Atomic writes and their SHA-256 sidecars are `ddpcli.files`. May import config/, data/ (the
epoch's position a checkpoint holds), models/ (verify rebuilds the model) and the shared
top-level modules. tests/test_architecture.py holds the table.
"""
