"""`ddpcli eval`: a checkpoint measured on a held-out set, exactly, at any world size.

- `plan`: what is measured, decided from the checkpoint and the flags in the launching
  process, with every exit 2 (a file that is no checkpoint, a model it may not or cannot
  rebuild, weights that do not fit, a folder of other classes);
- `data`: the split as validation saw it, dealt to the ranks in fixed batches;
- `rank` and `worker`: one rank's work, and its entry point;
- `run`: the command in the launching process (a rank itself under torchrun or SLURM);
  `launch`: its ranks started on the launcher's engine, rank 0's report read;
- `metrics`: top-1, top-5, loss, per-class figures and the confusion matrix, on rank 0;
- `outputs` and `picture`: the eval folder, confusion.png among it.

May import checkpoint/, models/, data/, training/ (precision, autocast dtypes), launcher/
(its ranks start as training's do), config/, environments/ and the shared top-level
modules; never cli/, and training/ never imports it. tests/test_architecture.py holds the
table.
"""
