#!/usr/bin/env bash
# Check megatron-pdm against the newest megatron-core release (Python >= 3.12 only) on a CPU machine.
#
#   scripts/check_mcore_latest.sh [PYTEST_PATHS_OR_ARGS...]
#       default paths (DEFAULT_PATHS): tests/mcore, tests/convert, the driver's torchrun runs and the
#       gloo tests
#
# Builds (once; later runs reuse it) the venv .cache/py312-mcore019/ with
#   - Python 3.12 (PY312=/path/to/python3.12, else python3.12 on PATH, else ~/.pyenv/versions/3.12*)
#   - torch $TORCH_VERSION from PyPI. PyPI only has the CUDA build for Linux, and `import torch` needs
#     its CUDA libraries to be loadable even without a GPU. CUDA_LIBS picks how:
#       stub (default when gcc+readelf exist): real cudart/cupti wheels (~13 MB) plus generated
#            stand-in libraries for cuBLAS/cuDNN/NCCL/... (every symbol aborts with a clear message
#            if it is ever called). Download ~540 MB, venv ~1.4 GB.
#       full: torch's real dependencies (nvidia-* wheels + triton). Download ~2.6 GB, venv ~4.7 GB.
#   - megatron-core $MCORE_VERSION (wheel), installed with --no-deps plus its non-torch deps
#   - this package (editable, --no-deps) plus its install, [all] and [test] deps read from setup.py, minus
#     torch and megatron-core (setup.py gives both as ranges, which the torch installed above
#     satisfies; they are still left out so that pip never resolves torch here: it would pull
#     the CUDA stack or replace this torch).
# then prints versions and runs `pytest $PYTEST_OPTS <paths>` in the source tree.
#
# Environment:
#   PY312          Python 3.12 interpreter (exit 2 with a message when none is found)
#   SRC            source tree to test (default: this script's repo; e.g. a `git worktree` of HEAD)
#   VENV           venv dir (default: <this script's repo>/.cache/py312-mcore019)
#   MCORE_VERSION  default 0.19.2          TORCH_VERSION  default 2.13.0
#   CUDA_LIBS      auto|stub|full (default auto = stub if gcc and readelf exist, else full)
#   WITH_TRITON    1 (default): install the triton that torch pins, as every Linux PyPI torch has it
#                  (megatron-core 0.19 imports it at `import megatron.core`); 0: no triton, which
#                  exercises megatron_pdm's CPU-shim stub for it (what a CPU-torch machine sees).
#                  Only for CUDA_LIBS=stub (full always has triton).
#   CONSTRAINTS    pip constraints for every package except torch and megatron-core (default:
#                  $SRC/constraints/ci.txt when it exists, i.e. CI's tested versions; CONSTRAINTS=
#                  (empty) lets pip pick the newest)
#   PYTEST_OPTS    default "-x -q"
#   SETUP_ONLY=1   build the venv and print versions, run no test
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
SRC="$(cd "${SRC:-$REPO}" && pwd)"
VENV="${VENV:-$REPO/.cache/py312-mcore019}"
MCORE_VERSION="${MCORE_VERSION:-0.19.2}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
CUDA_LIBS="${CUDA_LIBS:-auto}"
PYTEST_OPTS="${PYTEST_OPTS:--x -q}"
WITH_TRITON="${WITH_TRITON:-1}"
if [[ -z "${CONSTRAINTS+set}" && -f "$SRC/constraints/ci.txt" ]]; then CONSTRAINTS="$SRC/constraints/ci.txt"; fi
CONSTRAINTS="${CONSTRAINTS:-}"
DEFAULT_PATHS=(tests/mcore tests/convert
  tests/train/test_compare.py tests/train/test_driver_config.py tests/train/test_fused_head_e2e.py
  tests/train/test_kill_at_save.py tests/train/test_run_outputs.py tests/train/test_train_dense.py
  tests/train/test_train_e2e.py tests/train/rollout/test_overlap.py
  tests/train/rollout/test_train_sglang.py tests/train/rollout/test_train_sglang_distributed.py
  tests/stability/test_stability_smoke.py
  tests/parallel/test_collective_budget.py tests/parallel/test_fused_head_gloo.py
  tests/parallel/test_vocab_parallel_gloo.py tests/support/test_dist_helper.py)

log() { printf '[check_mcore_latest] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- Python 3.12
find_py312() {
  local c
  for c in "${PY312:-}" "$(command -v python3.12 2>/dev/null || true)" \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
    [[ -n "$c" && -x "$c" ]] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}
if ! PY312="$(find_py312)"; then
  log "Python 3.12 NOT FOUND: megatron-core >= 0.17 (here $MCORE_VERSION) declares Requires-Python >= 3.12,"
  log "so this check cannot run. Looked at \$PY312, python3.12 on PATH, ${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12*."
  log "Install one (e.g. 'pyenv install 3.12') or point PY312=/path/to/python3.12 at it. NO TEST WAS RUN."
  exit 2
fi

if [[ "$CUDA_LIBS" == auto ]]; then
  if command -v gcc >/dev/null && command -v readelf >/dev/null; then CUDA_LIBS=stub; else CUDA_LIBS=full; fi
fi
[[ "$CUDA_LIBS" == stub || "$CUDA_LIBS" == full ]] || die "CUDA_LIBS must be auto, stub or full (got $CUDA_LIBS)"
[[ "$CUDA_LIBS" == full ]] && WITH_TRITON=1

# keep the cache out of `git status` without touching .gitignore
mkdir -p "$(dirname "$VENV")"
[[ "$(dirname "$VENV")" == "$REPO/.cache" && ! -e "$REPO/.cache/.gitignore" ]] && echo '*' > "$REPO/.cache/.gitignore"

VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
# pip install, quiet; drops the per-package notes about unusable local index folders
pip_install() { "${PIP[@]}" install -q "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }
T0=$SECONDS

if [[ -x "$VPY" ]] && ! "$VPY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
  die "$VENV exists but is not a Python 3.12 venv; remove it"
fi
if [[ ! -x "$VPY" ]]; then
  log "creating venv $VENV with $PY312"
  "$PY312" -m venv "$VENV"
fi

# CI's pins minus torch and megatron-core (those two are what this check varies)
CFLAGS=()
if [[ -n "$CONSTRAINTS" ]]; then
  [[ -f "$CONSTRAINTS" ]] || die "CONSTRAINTS=$CONSTRAINTS does not exist"
  grep -viE '^\s*(torch|megatron[-_]core)\s*[=<>!~]' "$CONSTRAINTS" > "$VENV/.constraints.txt"
  CFLAGS=(-c "$VENV/.constraints.txt")
fi
CKEY="$( [[ -n "$CONSTRAINTS" ]] && sha1sum "$VENV/.constraints.txt" | cut -c1-12 || echo none)"

# A step runs again only when its key (versions/options) changed.
done_step() { [[ -f "$VENV/.step-$1" && "$(cat "$VENV/.step-$1")" == "$2" ]]; }
mark_step() { echo "$2" > "$VENV/.step-$1"; }

# deps of an installed distribution, minus the ones matching $2 (regex on the name), for `pip install`
deps_of() {
  "$VPY" - "$1" "$2" <<'EOF'
import importlib.metadata as md, re, sys
from pip._vendor.packaging.requirements import Requirement
dist, skip = sys.argv[1], re.compile(sys.argv[2])
for r in md.requires(dist) or []:
    req = Requirement(r)
    if skip.match(req.name.lower()):
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req))
EOF
}

# ---------------------------------------------------------------- torch
KEY_TORCH="torch==$TORCH_VERSION cuda_libs=$CUDA_LIBS"
if ! done_step torch "$KEY_TORCH"; then
  t=$SECONDS
  if [[ "$CUDA_LIBS" == full ]]; then
    log "installing torch==$TORCH_VERSION with its CUDA runtime wheels (~2.6 GB download)"
    pip_install "torch==$TORCH_VERSION"
  else
    log "installing torch==$TORCH_VERSION (no-deps, ~530 MB) + cudart/cupti wheels + CUDA library stubs"
    pip_install --no-deps --only-binary torch "torch==$TORCH_VERSION"
    # cuda-toolkit pin from torch's metadata -> real cudart (torch.cuda.is_available) and cupti (profiler)
    ct="$("$VPY" -c "
import importlib.metadata as md, re
for r in md.requires('torch') or []:
    m = re.match(r'cuda-toolkit\[[^]]*\]\s*==\s*([0-9.]+)', r)
    if m: print(m.group(1)); break")"
    [[ -n "$ct" ]] || die "torch $TORCH_VERSION declares no cuda-toolkit pin; use CUDA_LIBS=full"
    mapfile -t tdeps < <(deps_of torch '^(nvidia-|cuda-|triton)')
    pip_install "${CFLAGS[@]}" "cuda-toolkit[cudart,cupti]==$ct" "${tdeps[@]}"
    log "(pip's 'torch requires nvidia-... which is not installed' complaints above are expected here)"
    "$VPY" - <<'EOF'
"""Stand-in libraries for the CUDA libraries the torch wheel links against but a CPU run never calls.

For each NEEDED library that the dynamic loader cannot find (next to the real libcudart), build a
shared object with the same SONAME and symbol-version node that defines every symbol torch imports
from it; each one aborts with a message naming itself if it is ever called.
"""
import glob, os, re, subprocess, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
torch_lib = os.path.join(site, "torch", "lib")
cudart = glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*"))
if not cudart:
    sys.exit("libcudart not installed")
out = os.path.dirname(cudart[0])
# unversioned libraries: which imported symbols belong to them, by prefix
PREFIX = {"libnccl": ("nccl", "pnccl"), "libcufile": ("cuFile",), "libcurand": ("curand",),
          "libcusparseLt": ("cusparseLt",), "libnvshmem_host": ("nvshmem",)}
libs = [os.path.join(torch_lib, f) for f in os.listdir(torch_lib) if f.endswith(".so")]
missing = set()
for lib in libs:
    for line in subprocess.run(["ldd", lib], capture_output=True, text=True).stdout.splitlines():
        m = re.match(r"\s*(\S+) => not found", line)
        if m and m.group(1) != "libcuda.so.1":  # the driver: dlopen'ed by cudart, never linked at import
            missing.add(m.group(1))
ver_of, syms = {}, {so: set() for so in missing}
for lib in libs:
    txt = subprocess.run(["readelf", "-W", "-V", lib], capture_output=True, text=True).stdout
    cur = None
    for line in txt.splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            cur = m.group(1); continue
        m = re.search(r"Name: (\S+)", line)
        if m and cur in missing:
            ver_of[m.group(1)] = cur
for lib in libs:
    txt = subprocess.run(["readelf", "-W", "--dyn-syms", lib], capture_output=True, text=True).stdout
    for line in txt.splitlines():
        p = line.split()
        if len(p) < 8 or p[6] != "UND":
            continue
        name, _, ver = p[7].partition("@")
        ver = ver.lstrip("@")
        if ver:
            if ver in ver_of:
                syms[ver_of[ver]].add(name)
            continue
        for so in missing:
            if name.startswith(PREFIX.get(so.split(".so")[0], ("\0",))):
                syms[so].add(name)
versions = {}
for v, so in ver_of.items():
    versions.setdefault(so, []).append(v)
for so in sorted(missing):
    names = sorted(syms[so]) or ["megatron_pdm_cuda_stub"]
    src = os.path.join(out, so + ".stub.c")
    with open(src, "w") as f:
        f.write('#include <stdio.h>\n#include <stdlib.h>\n')
        f.write('static void die(const char *s) { fprintf(stderr, "CUDA stub %s: %s() called; this torch has '
                'stand-ins instead of the CUDA libraries (scripts/check_mcore_latest.sh, CUDA_LIBS=stub)\\n", "'
                + so + '", s); abort(); }\n')
        for n in names:
            f.write(f'void {n}(void) {{ die("{n}"); }}\n')
    cmd = ["gcc", "-shared", "-fPIC", "-o", os.path.join(out, so), src, "-Wl,-soname," + so]
    if so in versions:
        vs = os.path.join(out, so + ".stub.map")
        with open(vs, "w") as f:
            f.write(" ".join(v + " { global: *; };" for v in versions[so]) + "\n")
        cmd.append("-Wl,--version-script=" + vs)
    subprocess.run(cmd, check=True)
    print(f"  stub {so}: {len(syms[so])} symbols -> {out}")
EOF
  fi
  "$VPY" -W ignore -c 'import torch; torch.ones(2) @ torch.ones(2)' || die "torch does not import (try CUDA_LIBS=full)"
  log "torch step: $((SECONDS - t)) s"
  mark_step torch "$KEY_TORCH"
fi

# ---------------------------------------------------------------- triton (stub mode only)
if [[ "$CUDA_LIBS" == stub ]] && ! done_step triton "$WITH_TRITON"; then
  if [[ "$WITH_TRITON" == 1 ]]; then
    mapfile -t tr < <(deps_of torch '^(?!triton$)')
    log "installing ${tr[*]:-triton} (torch's pin; ~200 MB download, ~700 MB installed)"
    pip_install --no-deps "${tr[@]:-triton}"
  else
    log "removing triton (WITH_TRITON=0)"
    "${PIP[@]}" uninstall -q -y triton 2>/dev/null || true
  fi
  mark_step triton "$WITH_TRITON"
fi

# ---------------------------------------------------------------- megatron-core
KEY_MCORE="megatron-core==$MCORE_VERSION constraints=$CKEY"
if ! done_step mcore "$KEY_MCORE"; then
  t=$SECONDS
  log "installing megatron-core==$MCORE_VERSION (wheel, --no-deps) + its non-torch deps"
  pip_install --no-deps --only-binary megatron-core "megatron-core==$MCORE_VERSION"
  mapfile -t mdeps < <(deps_of megatron-core '^torch$')
  [[ ${#mdeps[@]} -eq 0 ]] || pip_install "${CFLAGS[@]}" "${mdeps[@]}"
  log "megatron-core step: $((SECONDS - t)) s"
  mark_step mcore "$KEY_MCORE"
fi

# ---------------------------------------------------------------- this package
KEY_PKG="$SRC $(sha1sum "$SRC/setup.py" | cut -c1-12) constraints=$CKEY"
if ! done_step pkg "$KEY_PKG"; then
  t=$SECONDS
  mapfile -t pdeps < <("$VPY" - "$SRC/setup.py" <<'EOF'
import ast, re, sys
tree = ast.parse(open(sys.argv[1]).read())
vals = {}
for node in tree.body:
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        try:
            vals[node.targets[0].id] = ast.literal_eval(node.value)
        except ValueError:
            pass
extras = vals["EXTRAS"]  # a literal dict (setup.py says so): the driver's extras + the tests'
reqs = list(vals.get("INSTALL_REQUIRES", [])) + list(extras["all"]) + list(extras["test"])
for r in reqs:
    if not re.match(r"\s*(torch|megatron-core|megatron_core)\b", r):
        print(r)
EOF
)
  log "installing this package from $SRC (editable, --no-deps) + ${#pdeps[@]} deps from setup.py (torch/megatron-core excluded)"
  pip_install "${CFLAGS[@]}" "${pdeps[@]}"
  pip_install --no-deps --no-build-isolation -e "$SRC"
  log "package step: $((SECONDS - t)) s"
  mark_step pkg "$KEY_PKG"
fi
(( SECONDS - T0 > 2 )) && log "setup done in $((SECONDS - T0)) s; venv size $(du -sh "$VENV" | cut -f1)"

# ---------------------------------------------------------------- versions
"$VPY" - "$SRC" "$CUDA_LIBS" "${CONSTRAINTS:+$CONSTRAINTS (minus torch, megatron-core)}" <<'EOF'
import importlib.metadata as md, platform, subprocess, sys
src, cuda_libs = sys.argv[1], sys.argv[2]
import torch
def v(d):
    try:
        return md.version(d)
    except md.PackageNotFoundError:
        return "-"
try:
    head = subprocess.run(["git", "-C", src, "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
except OSError:
    head = "?"
print(f"python         {platform.python_version()} ({sys.executable})")
print(f"torch          {torch.__version__} (CUDA libs: {cuda_libs}; cuda available: {torch.cuda.is_available()})")
for d in ("megatron-core", "numpy", "transformers", "triton", "pytest"):
    print(f"{d:<14} {v(d)}")
print(f"megatron-pdm   {src} @ {head or '?'}")
print(f"constraints    {sys.argv[3] or '(none: newest versions)'}")
EOF

[[ "${SETUP_ONLY:-0}" == 1 ]] && exit 0

# ---------------------------------------------------------------- tests
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=("${DEFAULT_PATHS[@]}")
cd "$SRC"
log "pytest $PYTEST_OPTS ${args[*]}  (in $SRC)"
# shellcheck disable=SC2086
exec "$VPY" -m pytest $PYTEST_OPTS "${args[@]}"
