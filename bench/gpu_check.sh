#!/usr/bin/env bash
# The GPU check kit: every GPU path of trims, time-boxed, in one command (docs/gpu.md).
#   bash bench/gpu_check.sh            results in gpu-check-out/ (gpu-check.json, .log, ...)
#   OUT=dir bash bench/gpu_check.sh    results in dir/
#   bash bench/gpu_check.sh --plan     the steps and their time boxes; runs nothing
# PYTHON picks the interpreter (default python3), WHEELS an offline wheelhouse (default .whl).
# The steps, time boxes and summary are in bench/gpu_check.py; exit 0 when no step failed.
set -uo pipefail
# OUT and WHEELS are taken from where the command was given, not from the repository root
for var in OUT WHEELS; do
  if [ -n "${!var:-}" ]; then export "$var=$(realpath -m -- "${!var}")"; fi
done
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
  echo "gpu_check: no $PY on PATH; set PYTHON to a Python 3.11+ interpreter" >&2
  exit 2
fi
exec "$PY" bench/gpu_check.py --python "$PY" "$@"
