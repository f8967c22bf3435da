#!/usr/bin/env bash
# Installs the real verl 0.9.1 (its Python code, from PyPI) for CPU checks of
# megatron_pdm.integrations.verl against verl's own policy-loss registry, agg_loss and ppo_loss
# (tests/integrations/test_verl_adapter.py). Nothing here can train with verl: no megatron
# engine, no vLLM, no GPU.
#
# Layout (under $VERL_ENV, default <repo>/.cache/verl-env, git-ignored by a .gitignore there):
#   site/        verl==0.9.1 and the modules its loss code imports at module level, exact pins
#                from scripts/verl-cpu-constraints.txt, all installed with --no-deps
#   pythonpath   the PYTHONPATH to use (site), one line
#   .stamp       written last; its content is the spec hash (a second run is a no-op)
#
# The environment is the project venv (torch 2.13.0 CPU, numpy, transformers, pyyaml, and
# megatron-core for the logits-processor check's parallel state) plus
# PYTHONPATH=site: a second copy of torch would add minutes and ~1 GB for nothing the checks
# use. Use it from tests with a subprocess:
#   PYTHONPATH="$(cat .cache/verl-env/pythonpath):<repo>" .venv/bin/python -c '...'
# No import stubs are needed: every module verl's loss code imports is installed for real.
# Deviation from verl's METADATA, on purpose: transformers comes from the venv (5.24.0; verl
# asks for < 5.11), which the imported loss modules import but do not call.
#
# Usage: scripts/verl_env.sh [--force] [--check]
# Env: VERL_ENV (base dir), PYTHON (interpreter; default <repo>/.venv/bin/python).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${VERL_ENV:-$REPO/.cache/verl-env}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
CONS="$REPO/scripts/verl-cpu-constraints.txt"
FORCE=0; CHECK=0
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "verl_env: unknown argument $a" >&2; exit 2 ;;
  esac
done
die() { echo "verl_env: ERROR: $*" >&2; exit 1; }

SPEC_HASH="$(cat "$CONS" "$0" | sha256sum | cut -c1-16)"

smoke() {
  PYTHONPATH="$(cat "$BASE/pythonpath")" "$PY" -W ignore - <<'PYEOF'
import verl
assert verl.__version__ == "0.9.1", verl.__version__
from verl.trainer.ppo import core_algos
from verl.workers.utils import losses  # noqa: F401  (ppo_loss, the caller of policy losses)
assert "vanilla" in core_algos.POLICY_LOSS_REGISTRY
import torch
print(f"verl {verl.__version__} on torch {torch.__version__}: imports ok")
PYEOF
}

if [ "$FORCE" = 0 ] && [ -f "$BASE/.stamp" ] && [ "$(cat "$BASE/.stamp")" = "$SPEC_HASH" ]; then
  [ "$CHECK" = 0 ] || smoke || die "smoke test failed"
  echo "PYTHONPATH=$(cat "$BASE/pythonpath")"
  exit 0
fi

t0=$(date +%s)
"$PY" -c 'import torch, numpy, transformers, yaml, packaging' 2>/dev/null \
  || die "the venv ($PY) lacks torch/numpy/transformers/pyyaml/packaging (install the project)"
mkdir -p "$BASE"
[ -f "$BASE/.gitignore" ] || printf '# written by scripts/verl_env.sh\n*\n' > "$BASE/.gitignore"
rm -rf "$BASE/site.tmp" "$BASE/.stamp"
echo "verl_env: installing $(grep -c '^[a-z]' "$CONS") pinned packages into $BASE/site" >&2
# every pinned line, --no-deps: exactly these versions and nothing else
grep '^[A-Za-z]' "$CONS" | xargs "$PY" -m pip install --disable-pip-version-check -q --no-deps \
  --no-compile --target "$BASE/site.tmp" \
  2> >(grep -v "WARNING: Location\|already exists\|Specify --upgrade" >&2) \
  || die "pip install into $BASE/site.tmp failed"
rm -rf "$BASE/site.tmp/bin" "$BASE/site"
mv "$BASE/site.tmp" "$BASE/site"
echo "$BASE/site" > "$BASE/pythonpath"
smoke || die "smoke test failed (see the traceback above)"
echo "$SPEC_HASH" > "$BASE/.stamp"
echo "verl_env: done in $(( $(date +%s) - t0 )) s; $(du -sh "$BASE" | cut -f1) in $BASE" >&2
echo "PYTHONPATH=$(cat "$BASE/pythonpath")"
