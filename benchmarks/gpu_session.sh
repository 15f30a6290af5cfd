#!/usr/bin/env bash
# A GPU session's one device call: the carried wheels installed, then the GPU check
# (benchmarks/gpu_check.sh) within BUDGET seconds, and what comes back put under $OUT.
#
# Here first:   bash benchmarks/device_wheels.sh
# Then one call of the device tool, from the checkout's root, naming the commit (the copy
# that travels may have no .git):
#   run(command="COMMIT=$(git rev-parse --short HEAD here) bash benchmarks/gpu_session.sh",
#       carry=[".whl"], timeout_s=600)
#
# $OUT receives (within the tool's 8 files): summary.md (the tables for docs/performance.md),
# gpu_check.log (the check's own lines), machine.txt (nvidia-smi, torch, the commit) and
# logs.tgz (every step's log). BUDGET (default 530 s) bounds the check's steps; the rest of
# a 600 s call goes to the wheels, starting the interpreter and packing the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-session}"
mkdir -p "$out"
python="${PYTHON:-python3}"  # the image's python3 is the one that holds torch
site=/tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || { echo "gpu_session: the carried wheels did not install" >&2; exit 1; }
else
    echo "gpu_session: no .whl/ here (run benchmarks/device_wheels.sh and carry .whl); using what the machine has" >&2
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHON="$python" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$python" -c "import torch, torchvision, pydantic, typer; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'pydantic', pydantic.VERSION, 'typer', typer.__version__)"
    echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}, $(nproc) CPU cores"
} > "$out/machine.txt" 2>&1
# ddpcli must import before the clock starts: a missing package fails here in seconds.
"$python" -m ddpcli --help >/dev/null || { cat "$out/machine.txt" >&2; echo "gpu_session: ddpcli does not import" >&2; exit 1; }
check=/tmp/gpu-check
bash benchmarks/gpu_check.sh --out "$check" --budget "${BUDGET:-530}" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
cp "$check/summary.md" "$out/" 2>/dev/null
tar czf "$out/logs.tgz" -C "$check" logs 2>/dev/null
exit "$status"
