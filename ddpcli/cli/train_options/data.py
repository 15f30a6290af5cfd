"""`ddpcli train`'s Data panel: what the ranks read and how each image is prepared."""

from __future__ import annotations

from typing import Annotated

from ddpcli.cli.train_options import train_option
from ddpcli.config.data import BUFFER_BOUNDS, BUFFER_MEMORY_FRACTION

PANEL = "Data"

Dataset = Annotated[
    str | None,
    train_option(
        "dataset",
        "Images to train on (stl10, imagefolder, shards: --data-dir; without --dataset, "
        "the set --data-dir holds), or your own: a factory "
        "called with data_dir= and image_size=, returning (train, val, class_names) "
        "(docs/custom.md).",
        PANEL,
        metavar="[synthetic|stl10|imagefolder|shards|pkg.module:factory]",
    ),
]

# Text, not a Path (which would make s3://bucket into s3:/bucket): the config makes it one.
DataDir = Annotated[
    str | None,
    train_option(
        "data_dir",
        "Data folder; for --dataset shards also a URL: s3://, gs://, http(s):// (docs/train.md).",
        PANEL,
        default="none",
    ),
]

Download = Annotated[bool | None, train_option("download", "Fetch STL-10 on rank 0 first.", PANEL)]

ImageSize = Annotated[
    int | None,
    train_option(
        "image_size",
        "Side in px.",
        PANEL,
        default="32 synthetic, 96 stl10, 224 imagefolder (64 on the CPU)",
    ),
]

SyntheticSize = Annotated[int | None, train_option("synthetic_size", panel=PANEL)]

DataPath = Annotated[
    str | None,
    train_option(
        "data_path",
        "device: the uint8 set in device memory, augmented there; loader: DataLoader "
        "workers; auto: device for synthetic/stl10 when the set takes at most a quarter "
        "of free device memory.",
        PANEL,
    ),
]

Decode = Annotated[
    str | None,
    train_option(
        "decode",
        "Where JPEGs of image folders and shards are decoded: cpu, in the loader workers; "
        "gpu, batched on the rank's device (nvjpeg on GPUs), the workers only reading bytes; "
        "auto: gpu on GPUs for image folders and shards, else cpu.",
        PANEL,
    ),
]

Workers = Annotated[
    int | None,
    train_option("workers", panel=PANEL, default="CPU cores per local rank - 1, at most 8"),
]

SkipBadImages = Annotated[bool | None, train_option("skip_bad_images", panel=PANEL)]

ShuffleBuffer = Annotated[
    int | None,
    train_option(
        "shuffle_buffer",
        panel=PANEL,
        default=f"from the node's memory (1/{round(1 / BUFFER_MEMORY_FRACTION)} of it over its "
        f"streams, {BUFFER_BOUNDS[0]} to {BUFFER_BOUNDS[1]} samples)",
    ),
]

Augment = Annotated[
    str | None,
    train_option(
        "augment",
        "Training augmentation. rrc: random-resized crop (area 8-100%, aspect 3/4-4/3) "
        "and flip; crop-flip: 4 px padded crop and flip; none. auto: rrc for image "
        "folders, crop-flip for synthetic/stl10. Validation is the same for all.",
        PANEL,
    ),
]
