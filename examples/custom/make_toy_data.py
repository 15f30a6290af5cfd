"""Write a toy data set of shapes as a CSV of image paths:
`python make_toy_data.py DIR circle square triangle` (any of circle, square, triangle, cross)."""

import csv
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw


def draw(shape: str, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (40, 40), tuple(rng.randrange(128) for _ in range(3)))
    pen = ImageDraw.Draw(image)
    x, y, r = rng.randrange(14, 26), rng.randrange(14, 26), rng.randrange(7, 12)
    colour = tuple(rng.randrange(128, 256) for _ in range(3))
    if shape == "circle":
        pen.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    elif shape == "square":
        pen.rectangle((x - r, y - r, x + r, y + r), fill=colour)
    elif shape == "triangle":
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    else:  # cross
        pen.rectangle((x - r, y - 2, x + r, y + 2), fill=colour)
        pen.rectangle((x - 2, y - r, x + 2, y + r), fill=colour)
    return image


def main(folder: Path, shapes: list[str]) -> None:
    rng = random.Random(0)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for split, per_class in (("train", 160), ("val", 41)):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            rows = csv.writer(handle)
            rows.writerow(["path", "label"])
            for shape in shapes:
                for index in range(per_class):
                    name = f"images/{split}-{shape}-{index}.png"
                    draw(shape, rng).save(folder / name)
                    rows.writerow([name, shape])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
