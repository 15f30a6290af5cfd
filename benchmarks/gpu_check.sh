#!/usr/bin/env bash
# The GPU check in one command (see benchmarks/gpu_check.py): every GPU path run and
# measured into one folder with a summary.md table; on a machine without a GPU it checks
# that every command it would run exists and exits 0.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python}" "$here/gpu_check.py" "$@"
