"""tools/: one thin script per console command, calling the same function (tools/README.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _console_scripts() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CONSOLE_SCRIPTS":
            entries = ast.literal_eval(node.value)
            return {e.split("=")[0].strip(): e.split("=")[1].strip() for e in entries}
    raise AssertionError("setup.py has no CONSOLE_SCRIPTS list")


def _script_target(path: pathlib.Path) -> str:
    tree = ast.parse(path.read_text())
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
               and n.module.startswith("megatron_pdm")]
    assert len(imports) == 1, f"{path}: expected one import of the package's entry point"
    return f"{imports[0].module}:{imports[0].names[0].name}"


def test_every_console_command_has_its_script_and_nothing_else():
    scripts = _console_scripts()
    assert len(scripts) >= 8
    want = {name.removeprefix("megatron-pdm-").replace("-", "_") + ".py": target
            for name, target in scripts.items()}
    have = {p.name: p for p in (ROOT / "tools").glob("*.py")}
    assert sorted(have) == sorted(want), "tools/ and setup.py's CONSOLE_SCRIPTS differ"
    for fname, target in want.items():
        assert _script_target(have[fname]) == target, fname


def test_a_script_runs_from_the_checkout():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py"),
                          "--help"], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--hf-dir" in out.stdout
