#!/usr/bin/env bash
# Creates (idempotently) the TRL benchmark environment: <repo>/.venv-trl/ with trl 1.16.0 on
# torch 2.13.0+cpu, from the exact pins in scripts/trl-cpu-constraints.txt (installed with
# --no-deps: no resolver). Benchmark-only: benchmarks/bench_trl_grpo.py runs its TRL side with
# this interpreter; the library never imports TRL (setup.py extra `bench-trl` states the range).
#
# Usage: scripts/setup_trl_cpu.sh [--force]
#   --force   delete and rebuild the venv even if its stamp is current
# Environment:
#   TRL_VENV             venv path (default: <repo>/.venv-trl)
#   PYTHON               interpreter for the venv (default: python3; tested 3.11)
#   TRL_CPU_TORCH_INDEX  extra index URL for torch==2.13.0+cpu where no local wheel exists
# A second run with the same pins, script and Python is a no-op (stamp file in the venv).
set -euo pipefail

start_s=$(date +%s)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${TRL_VENV:-$root/.venv-trl}
pins=$root/scripts/trl-cpu-constraints.txt
python=${PYTHON:-python3}
stamp=$venv/.pdm-trl-setup-stamp
force=0
for arg in "$@"; do
  case $arg in
    --force) force=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "setup_trl_cpu: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "setup_trl_cpu: ERROR: $*" >&2; exit 1; }

[ -f "$pins" ] || die "pin file $pins is missing"
command -v "$python" >/dev/null 2>&1 || die "interpreter '$python' not found (set PYTHON=...)"
pyver=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])') \
  || die "'$python' does not run"
want="pins=$(sha256sum "$pins" | cut -c1-16) script=$(sha256sum "$0" | cut -c1-16) python=$pyver"

if [ "$force" = 0 ] && [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup_trl_cpu: $venv is up to date"
  exit 0
fi
if [ -e "$venv" ]; then
  # Only delete what looks like a venv (never an arbitrary directory given by TRL_VENV).
  [ -f "$venv/pyvenv.cfg" ] || die "$venv exists and is not a venv; remove it or set TRL_VENV"
  echo "setup_trl_cpu: rebuilding $venv"
  rm -rf "$venv"
fi
"$python" -m venv "$venv" || die "python -m venv failed (Debian: apt-get install python3-venv)"
extra=()
if [ -n "${TRL_CPU_TORCH_INDEX:-}" ]; then
  extra+=(--extra-index-url "$TRL_CPU_TORCH_INDEX")
fi
log=$(mktemp "${TMPDIR:-/tmp}/setup_trl_cpu.XXXXXX.log")
echo "setup_trl_cpu: installing $(grep -c '^[A-Za-z0-9].*==' "$pins") pinned packages (log: $log)"
"$venv/bin/python" -m pip install --no-deps --only-binary=:all: --progress-bar off \
    --disable-pip-version-check "${extra[@]}" -r "$pins" >"$log" 2>&1 \
  || { tail -n 25 "$log" >&2; die "pip install failed (full log: $log); the venv is left unstamped"; }
"$venv/bin/python" - <<'PY' || die "the installed environment is not usable (see above)"
import torch, trl, transformers
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert trl.__version__ == "1.16.0", trl.__version__
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
PY
echo "$want" > "$stamp"
rm -f "$log"
echo "setup_trl_cpu: done in $(( $(date +%s) - start_s )) s"
