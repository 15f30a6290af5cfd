"""Checkpoints, one module per job:

- `loading`: safe loads (weights_only=True), clear errors for bad files, state-dict fitting;
- `schema`: what a training checkpoint holds, built from and restored into the run's parts;
- `writer`: rank 0 saves, barriers, keep-last pruning, last.pt and best.pt;
- `report`: inspect, verify and convert, as plain data for the CLI; `trust`: which model a
  file may have rebuilt; `init`: `--init-from` weights;
- `safetensors_io`: .safetensors files and their header's metadata; `export`: convert
  --to safetensors|onnx|pt2, exported graphs checked against eager PyTorch.

Atomic writes and their SHA-256 sidecars are `ddpcli.files`. May import config/, data/ (the
epoch's position a checkpoint holds), models/ (verify and export rebuild the model) and the
shared top-level modules. tests/test_architecture.py holds the table.
"""
