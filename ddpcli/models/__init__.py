"""What `--arch` names and how it is built: the names it accepts, checked without importing
torchvision (archs.py), and the model built from a name, a timm name or the user's own
factory (build.py). Training, checkpoints and the config's checks all read it; it imports
only the shared top-level modules (errors, factories)."""
