"""The import boundaries of docs/design.md are the architecture; this test keeps them.

- `megatron_pdm` (public API), `ops`, `parallel`, `loss.policy_loss`, `config`, `metrics` and the
  whole `rollout_bridge` import without megatron-core (checked in a fresh interpreter, because the
  test session itself may already have megatron loaded).
- `ops/` imports torch but never torch.distributed; `parallel/` never imports megatron;
  `rollout_bridge` never imports megatron_pdm or megatron (checked statically on every file).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

NO_MEGATRON_MODULES = [
    "megatron_pdm",
    "megatron_pdm.ops",
    "megatron_pdm.parallel",
    "megatron_pdm.loss.policy_loss",
    "megatron_pdm.config",
    "megatron_pdm.metrics",
    "rollout_bridge",
]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", NO_MEGATRON_MODULES)
def test_module_imports_without_megatron(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))\n"
        "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{module} pulled in megatron:\n{proc.stderr[-2000:]}"


def _files(sub: str) -> list[pathlib.Path]:
    files = sorted((ROOT / sub).rglob("*.py"))
    assert files, f"no python files under {sub}"
    return files


def test_ops_use_torch_only():
    for f in _files("megatron_pdm/ops"):
        bad = {n for n in _imports(f) if n.startswith(("torch.distributed", "megatron"))}
        bad -= {n for n in bad if n.startswith("megatron_pdm.ops")}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_parallel_never_imports_megatron():
    for f in _files("megatron_pdm/parallel"):
        bad = {n for n in _imports(f) if n == "megatron" or n.startswith("megatron.")}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_loss_only_hook_imports_megatron():
    for f in _files("megatron_pdm/loss"):
        if f.name == "megatron_hook.py":
            continue
        bad = {n for n in _imports(f) if n == "megatron" or n.startswith("megatron.")}
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"


def test_bridge_is_independent_of_trainer():
    for f in _files("rollout_bridge"):
        bad = {
            n for n in _imports(f)
            if n == "megatron" or n.startswith(("megatron.", "megatron_pdm"))
        }
        assert not bad, f"{f.relative_to(ROOT)} imports {sorted(bad)}"
