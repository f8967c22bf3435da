#!/usr/bin/env bash
# The GPU check on a bare machine (Python 3.12 + torch, no network): installs the carried wheels
# into a private venv that sees the machine's torch, then runs benchmarks/gpu_check.py (one GPU).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py args, e.g. --out gpu_check.json]
#
# The wheels travel with the working tree in wheels/ (git-ignored; fetched once on a machine that
# has a network, then carried along with the tree):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d wheels megatron-core==0.16.1 numpy packaging pyyaml
# A part whose dependency is missing is skipped with the reason in the JSON; the others still run.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-${HERE}/wheels}"
VENV="${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/pdm-gpu-check-venv}"

"${PY}" -c 'import torch' || { echo "gpu_check.sh: ${PY} has no torch" >&2; exit 2; }
if [[ ! -x "${VENV}/bin/python" ]]; then
    "${PY}" -m venv --system-site-packages "${VENV}"  # the machine's torch stays visible
fi
shopt -s nullglob
wheels=("${WHEELS}"/*.whl)
if ((${#wheels[@]})); then
    "${VENV}/bin/python" -m pip install --no-index --no-deps --quiet "${wheels[@]}"
else
    echo "gpu_check.sh: no wheels in ${WHEELS}: parts needing megatron-core will be skipped" >&2
fi
cd "${HERE}"
PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}" exec "${VENV}/bin/python" \
    benchmarks/gpu_check.py "$@"
