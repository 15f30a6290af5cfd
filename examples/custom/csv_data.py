"""`ddpcli train --dataset csv_data:csv_splits --data-dir DIR`: the images listed in
DIR/train.csv and DIR/val.csv, one `path,label` row each (paths relative to DIR)."""

import csv
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset


def read_rows(csv_file: Path) -> list[dict[str, str]]:
    with open(csv_file, newline="") as handle:
        return list(csv.DictReader(handle))


class CsvImages(Dataset):
    def __init__(self, data_dir: Path, split: str, classes: list[str]) -> None:
        rows = read_rows(data_dir / f"{split}.csv")
        self.samples = [(data_dir / row["path"], classes.index(row["label"])) for row in rows]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with Image.open(path) as image:
            return image.convert("RGB"), label  # ddpcli resizes, crops and flips


def csv_splits(data_dir, image_size):
    data_dir = Path(data_dir)
    classes = sorted({row["label"] for row in read_rows(data_dir / "train.csv")})
    return CsvImages(data_dir, "train", classes), CsvImages(data_dir, "val", classes), classes
