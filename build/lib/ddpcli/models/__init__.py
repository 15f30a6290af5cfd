"""What `--arch` names and how it is built: the names it accepts, checked without importing
torchvision (`archs`), and the model built from a name, a timm name or the user's own
factory (`build`). Training, checkpoints, the launcher's checks and the config read it.

May import only the shared top-level modules (errors, factories).
tests/test_architecture.py holds the table.
"""
