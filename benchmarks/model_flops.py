"""FLOPs per training image of each model, and the GPU's dense bf16 peak: one JSON document.

    python benchmarks/model_flops.py --model resnet18:96 --model resnet50:224

FLOPs as benchmarks/gpu_throughput.py counts them: torch.utils.flop_counter over one image's
forward pass (10 classes), x 3 for forward and backward. The GPU as torch names it
(torch.cuda.get_device_name of GPU 0) and its peak from gpu_throughput.PEAK_BF16_TFLOPS;
null where there is no GPU or the table does not know it. benchmarks/gpu_check.py divides
each row's images/s by these into its MFU.
"""

from __future__ import annotations

import argparse
import json

from gpu_throughput import peak_tflops, train_gflop_per_image


def model_spec(text: str) -> tuple[str, int]:
    arch, _, size = text.rpartition(":")
    if not arch or not size.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not ARCH:IMAGE_SIZE")
    return arch, int(size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=model_spec, action="append", required=True,
                        metavar="ARCH:SIZE", help="repeatable: resnet50:224")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    report = {
        "device": device,
        "peak_tflops": peak_tflops(device) if device else None,
        "gflop_per_image": {
            f"{arch}:{size}": train_gflop_per_image(arch, size) for arch, size in args.model
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
