#!/usr/bin/env bash
# Installs the *Python API* of the supported SGLang releases for CPU-only checks of our client
# against SGLang's own code (request classes, HTTP route table, API-key middleware, logprob
# formatting). Nothing here can serve a model: SGLang's kernels are CUDA builds.
#
# Layout (all under $SGLANG_API_CACHE, default <repo>/.cache/sglang-api, git-ignored by a
# .gitignore written there):
#   <version>/site/     sglang==<version>, installed with --no-deps (one dir per version)
#   <version>/pythonpath  the PYTHONPATH for that version (site:deps:stubs), one line
#   <version>/.stamp    written last; its content is the spec hash (second run = no-op)
#   deps/               the pinned runtime deps sglang imports at module level that the
#                       project venv does not provide (installed --no-deps, shared by versions)
#   stubs/              import-only stand-ins for triton and torchvision (see below)
#
# Use from tests without touching the venv: run a subprocess with
#   PYTHONPATH="$(cat .cache/sglang-api/0.5.23/pythonpath)" .venv/bin/python -c '...'
# (PYTHONPATH entries come before site-packages, so deps/ and the stubs shadow nothing the
# venv has except triton/torchvision, which the venv does not have.) Never import two
# versions in one interpreter.
#
# Why stubs: sglang imports triton (1 GB, GPU compiler) and torchvision (the PyPI build does
# not match torch 2.13+cpu) at module level on the import paths of io_struct / http_server /
# tokenizer_manager, but never calls them there. The stubs turn decorators into no-ops and
# raise RuntimeError when anything is actually called.
#
# Usage: scripts/sglang_api_env.sh [--force] [--check] [VERSION ...]   (default: 0.5.22 0.5.23)
#   --force  reinstall even if the stamp matches
#   --check  also run the import smoke test when the stamp matches
# Env: SGLANG_API_CACHE (base dir), PYTHON (interpreter; default <repo>/.venv/bin/python).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${SGLANG_API_CACHE:-$REPO/.cache/sglang-api}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
FORCE=0; CHECK=0; VERSIONS=()
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    -*) echo "sglang_api_env: unknown option $a" >&2; exit 2 ;;
    *) VERSIONS+=("$a") ;;
  esac
done
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.5.22 0.5.23)

die() { echo "sglang_api_env: ERROR: $*" >&2; exit 1; }

# Pinned, installed with --no-deps. Versions: what `import sglang.srt.entrypoints.http_server`
# needs on top of the project venv, pinned where sglang's METADATA pins (openai: 0.5.22 pins
# 2.6.1, 0.5.23 pins 2.8.0; 2.8.0 imports fine under both).
DEPS=(
  requests==2.34.2 urllib3==2.8.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  starlette==1.10.0 fastapi==0.165.0 opentelemetry-api==1.45.2 python-multipart==0.0.34
  uvicorn==0.54.0 uvloop==0.23.0 msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8
  ipython==9.18.1 traitlets==5.16.1 dill==0.4.1 einops==0.8.2
  apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 loguru==0.7.3
  gguf==0.19.0 openai==2.8.0 httpx==0.28.1 distro==1.9.0 sniffio==1.3.1
  partial-json-parser==0.2.1.1.post7 jsonschema==4.26.0 referencing==0.37.0
  rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 xgrammar==0.2.7
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
)
# Small pure-Python packages the venv normally has (via aiohttp/pydantic/transformers); they are
# installed into deps/ only when the venv lacks them, so nothing in the venv is shadowed.
IF_MISSING=(anyio==4.16.0 h11==0.16.0 click==8.5.1 annotated-doc==0.0.7 typing-inspection==0.4.5
            idna==3.20 typing-extensions==4.16.0 pyyaml==6.0.4 regex==2026.11.19)
# Must come from the venv (too big or must match torch): checked, never installed here.
FROM_VENV=(torch numpy pydantic transformers tokenizers orjson pybase64 psutil PIL packaging
           aiohttp tqdm yaml huggingface_hub safetensors)

write_stubs() {
  local d="$1/stubs"
  rm -rf "$d"; mkdir -p "$d/triton" "$d/torchvision"
  cat > "$d/_sglang_api_stub.py" <<'PYEOF'
"""Import-only stand-ins (written by scripts/sglang_api_env.sh) for packages sglang imports at
module level but the CPU API checks never run: decorators return the function unchanged,
CamelCase attributes are empty classes (so isinstance() works), other attributes are
placeholders, submodules are synthesized, and calling a placeholder raises RuntimeError."""
import importlib.abc
import importlib.machinery
import sys
import types

_CLASSES = {}


def _accept(self, *args, **kwargs):
    pass


class _Meta(type):
    def __getattr__(cls, item):
        return _attr(cls.__dict__.get("_name", cls.__name__), item)


class Placeholder:
    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, item):
        return _attr(self._name, item)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        raise RuntimeError(f"{self._name}() called: import-only stub (no GPU runtime)")

    def __getitem__(self, item):
        return Placeholder(f"{self._name}[]")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<stub {self._name}>"


def _attr(prefix, name):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    full = f"{prefix}.{name}"
    if name[:1].isupper():
        if full not in _CLASSES:
            _CLASSES[full] = _Meta(name, (), {"__module__": prefix, "__init__": _accept,
                                              "_name": full})
        return _CLASSES[full]
    return Placeholder(full)


def _decorator_factory(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


def fill(mod, extra=None):
    prefix = mod.__name__
    mod.__getattr__ = lambda name: _attr(prefix, name)
    mod.__path__ = getattr(mod, "__path__", [])
    mod.jit = mod.autotune = mod.heuristics = _decorator_factory
    mod.__sglang_api_stub__ = True
    for k, v in (extra or {}).items():
        setattr(mod, k, v)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix, submodule_extras=None):
        self.prefix = prefix + "."
        self.extras = submodule_extras or {}

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        fill(mod, self.extras.get(spec.name))
        return mod

    def exec_module(self, module):
        pass


def install(top_name, extra=None, submodule_extras=None):
    fill(sys.modules[top_name], extra)
    sys.meta_path.insert(0, _Finder(top_name, submodule_extras))
PYEOF
  cat > "$d/triton/__init__.py" <<'PYEOF'
"""Import-only triton stand-in (scripts/sglang_api_env.sh); see _sglang_api_stub.py."""
from _sglang_api_stub import install as _install

__version__ = "0.0.0+sglang-api-stub"


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class Config:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _constexpr(value=None):
    return value


_install(__name__, submodule_extras={"triton.language": {"constexpr": _constexpr}})
PYEOF
  cat > "$d/torchvision/__init__.py" <<'PYEOF'
"""Import-only torchvision stand-in (scripts/sglang_api_env.sh); see _sglang_api_stub.py."""
from _sglang_api_stub import install as _install

__version__ = "0.0.0+sglang-api-stub"
_install(__name__)
PYEOF
}

SPEC_HASH="$( { printf '%s\n' "${DEPS[@]}" "${IF_MISSING[@]}"; sed -n '/^write_stubs()/,/^}/p' "$0"; } \
  | sha256sum | cut -c1-16)"

pip_target() {  # pip_target DIR ARGS...: --no-deps install into DIR (pip's own cache is used)
  local dir="$1"; shift
  "$PY" -m pip install --disable-pip-version-check -q --no-deps --no-compile --target "$dir" "$@" \
    2> >(grep -v "WARNING: Location\|already exists\|Specify --upgrade" >&2) \
    || die "pip install into $dir failed: $*"
}

smoke() {  # smoke VERSION: import what the checks need, with that version's PYTHONPATH
  local v="$1" pp; pp="$(cat "$BASE/$v/pythonpath")"
  PYTHONPATH="$pp" "$PY" -W ignore - "$v" <<'PYEOF' || return 1
import sys, importlib.metadata as md
v = sys.argv[1]
import sglang
assert sglang.__version__ == v, (sglang.__version__, v)
assert sglang.__file__.find(f"/{v}/site/") > 0, sglang.__file__
from sglang.srt.managers import io_struct
from sglang.srt.managers.io_struct import (GenerateReqInput, UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqInput, UpdateWeightsFromTensorReqInput, PauseGenerationReqInput,
    ContinueGenerationReqInput, BeginWeightUpdateReqInput, EndWeightUpdateReqInput)
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.entrypoints import http_server
from sglang.srt.utils.auth import add_api_key_middleware
paths = set()
def walk(routes, prefix=""):
    for r in routes:
        if hasattr(r, "original_router"):
            walk(r.original_router.routes, prefix + (r.include_context.prefix or ""))
        elif getattr(r, "path", None):
            paths.add(prefix + r.path)
walk(http_server.app.routes)
missing = {"/generate", "/model_info", "/pause_generation", "/update_weights_from_disk"} - paths
assert not missing, missing
print(f"sglang {v}: imports ok, {len(paths)} routes")
PYEOF
}

check_venv() {
  local missing
  missing="$("$PY" - "${FROM_VENV[@]}" <<'PYEOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PYEOF
)" || die "cannot run $PY"
  [ -z "$missing" ] || die "the venv ($PY) lacks: $missing (install the project first)"
  local tv; tv="$("$PY" -c 'import torch; print(torch.__version__)')"
  case "$tv" in *+cpu*|2.*) ;; *) die "unexpected torch $tv" ;; esac
}

mkdir -p "$BASE"
[ -f "$BASE/.gitignore" ] || printf '# written by scripts/sglang_api_env.sh\n*\n' > "$BASE/.gitignore"

all_ok=1
for v in "${VERSIONS[@]}"; do
  if [ "$FORCE" = 0 ] && [ -f "$BASE/$v/.stamp" ] && [ "$(cat "$BASE/$v/.stamp")" = "$SPEC_HASH" ] \
     && [ -f "$BASE/deps/.stamp" ] && [ "$(cat "$BASE/deps/.stamp")" = "$SPEC_HASH" ]; then
    [ "$CHECK" = 0 ] || smoke "$v" || die "smoke test failed for sglang $v"
    continue
  fi
  all_ok=0
done

if [ "$all_ok" = 0 ]; then
  t0=$(date +%s)
  check_venv
  if [ "$FORCE" = 1 ] || [ ! -f "$BASE/deps/.stamp" ] || [ "$(cat "$BASE/deps/.stamp")" != "$SPEC_HASH" ]; then
    echo "sglang_api_env: installing pinned deps into $BASE/deps" >&2
    rm -rf "$BASE/deps.tmp"; mkdir -p "$BASE/deps.tmp"
    pip_target "$BASE/deps.tmp" "${DEPS[@]}"
    need="$("$PY" - "${IF_MISSING[@]}" <<'PYEOF'
import importlib.util, sys
mods = {"annotated-doc": "annotated_doc", "typing-inspection": "typing_inspection",
        "typing-extensions": "typing_extensions", "pyyaml": "yaml"}
out = []
for spec in sys.argv[1:]:
    name = spec.split("==")[0]
    if importlib.util.find_spec(mods.get(name, name.replace("-", "_"))) is None:
        out.append(spec)
print(" ".join(out))
PYEOF
)"
    # shellcheck disable=SC2086
    [ -z "$need" ] || pip_target "$BASE/deps.tmp" $need
    rm -rf "$BASE/deps.tmp/bin"
    write_stubs "$BASE"
    rm -rf "$BASE/deps"; mv "$BASE/deps.tmp" "$BASE/deps"
    echo "$SPEC_HASH" > "$BASE/deps/.stamp"
  fi
  for v in "${VERSIONS[@]}"; do
    if [ "$FORCE" = 0 ] && [ -f "$BASE/$v/.stamp" ] && [ "$(cat "$BASE/$v/.stamp")" = "$SPEC_HASH" ]; then
      continue
    fi
    echo "sglang_api_env: installing sglang==$v into $BASE/$v/site" >&2
    rm -rf "$BASE/$v"; mkdir -p "$BASE/$v"
    pip_target "$BASE/$v/site" "sglang==$v"
    rm -rf "$BASE/$v/site/bin"
    echo "$BASE/$v/site:$BASE/deps:$BASE/stubs" > "$BASE/$v/pythonpath"
    smoke "$v" || die "smoke test failed for sglang $v (see the traceback above)"
    echo "$SPEC_HASH" > "$BASE/$v/.stamp"
  done
  echo "sglang_api_env: done in $(( $(date +%s) - t0 )) s; $(du -sh "$BASE" | cut -f1) in $BASE" >&2
fi

for v in "${VERSIONS[@]}"; do
  echo "$v PYTHONPATH=$(cat "$BASE/$v/pythonpath")"
done
