#!/usr/bin/env bash
# The Python packages ddpcli needs that the lent GPU machine's image lacks, as wheels for its
# Python (3.12, x86-64), into .whl/ (ignored by git): run here, where pip reaches an index,
# before a GPU session's first call; that call carries .whl (benchmarks/gpu_session.sh).
#
#   bash benchmarks/device_wheels.sh            # the versions this checkout's venv holds
#
# The image has torch, torchvision, numpy, Pillow, matplotlib, rich, click, pytest and
# pytest-xdist (the device tool's KINDS.md lists them); not pydantic, plotext, or a typer as
# new as the one ddpcli is tested with. Each wheel is the version installed here, so the
# GPU machine runs what the CPU suite ran.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
# ddpcli's runtime packages the image lacks, and what they need in turn (typer 0.29 needs
# pydantic; pydantic needs a typing_extensions newer than some images hold).
packages=(pydantic pydantic_core annotated_types typing_inspection typing_extensions typer plotext)
folder=.whl  # in .gitignore: it travels only where a call carries it
rm -rf "$folder" && mkdir -p "$folder"
pins=()
for package in "${packages[@]}"; do
    version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package")
    pins+=("$package==$version")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$folder" "${pins[@]}"
echo "device_wheels: ${pins[*]} in $folder/ ($(du -sh "$folder" | cut -f1)); carry it: run(..., carry=[\"$folder\"])"
