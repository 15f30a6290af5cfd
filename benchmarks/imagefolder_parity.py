"""Does `ddpcli train` on a real image folder reach what a plain single-process
torchvision script reaches with the same settings?

The folder is built from scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped
inside the package, so nothing is downloaded), upscaled to 32 px PNGs in the ImageNet
layout. Both contenders train resnet18 at 32 px for 10 epochs with the same global batch
(2 ranks x 32 for ddpcli, 64 for the single process), SGD with Nesterov momentum, 1 epoch
of warm-up then cosine, the same crop-and-flip augmentation, and report the final
validation accuracy.

    pip install -e ".[bench]"
    python benchmarks/imagefolder_parity.py [--epochs 10] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def export_digits(root: Path) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        split = "val" if index % 5 == 0 else "train"
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        gray = (pixels / 16 * 255).astype("uint8")
        Image.fromarray(gray).convert("RGB").resize((32, 32), Image.BILINEAR).save(
            folder / f"{index}.png"
        )


def run_ddpcli(data: Path, epochs: int, seed: int, out: Path) -> dict:
    command = [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--nproc", "2", "--dataset",
        "imagefolder", "--data-dir", str(data), "--arch", "resnet18", "--image-size", "32",
        "--epochs", str(epochs), "--per-gpu-batch", "32", "--seed", str(seed), "--out",
        str(out), "--json",
        "--lr", "0.1", "--lr-scaling", "none",  # the script's rate at batch 64, as given
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=True)
    summary = json.loads(result.stdout)
    return {"val_acc": summary["val_acc"], "seconds": time.perf_counter() - started}


def run_reference(data: Path, epochs: int, seed: int) -> dict:
    """The plain single-process script a user would write with torchvision."""
    import torch
    import torchvision
    from torchvision import transforms

    torch.manual_seed(seed)
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
         transforms.ToTensor(), normalize]
    )  # fmt: skip
    val_tf = transforms.Compose([transforms.ToTensor(), normalize])
    train_set = torchvision.datasets.ImageFolder(data / "train", train_tf)
    val_set = torchvision.datasets.ImageFolder(data / "val", val_tf)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=256)
    model = torchvision.models.resnet18(num_classes=10)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0}],
        lr=0.1, momentum=0.9, nesterov=True,
    )  # fmt: skip
    steps, warmup = epochs * len(train_loader), len(train_loader)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    started = time.perf_counter()
    for _ in range(epochs):
        model.train()
        for images, labels in train_loader:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in val_loader:
            correct += (model(images).argmax(1) == labels).sum().item()
            total += len(labels)
    return {"val_acc": correct / total, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "digits"
        export_digits(data)
        print(f"{'seed':>4}  {'contender':<34} {'val_acc':>8} {'seconds':>8}")
        for seed in (int(s) for s in args.seeds.split(",")):
            ours = run_ddpcli(data, args.epochs, seed, Path(tmp) / f"run{seed}")
            reference = run_reference(data, args.epochs, seed)
            for name, result in (("ddpcli train (2 Gloo ranks x 32)", ours),
                                 ("torchvision script (1 process, 64)", reference)):  # fmt: skip
                print(f"{seed:>4}  {name:<34} {result['val_acc']:>8.4f} {result['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
