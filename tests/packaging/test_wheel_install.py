"""The built wheel, installed into a fresh venv over a pre-installed stack, converts a checkpoint.

A user's cluster environment already has torch and megatron-core (an NGC container); `pip install
megatron-pdm` must keep them and give working console commands. The test:

1. builds the wheel from a copy of the source tree (`pip wheel --no-deps --no-build-isolation
   --no-index`: no download, nothing written into the checkout);
2. makes a fresh venv from the base interpreter whose pre-installed stack is this environment's
   site-packages minus the project (a `.pth` pointing at a folder of links: torch,
   megatron-core, transformers, ... are visible to pip as installed, the editable project is not);
3. installs the wheel with its `[all]` extra (the driver's dependencies) WITH dependency
   resolution but `--no-index` and `-c constraints/ci.txt`:
   every requirement must be met by the stack as it is (a requirement that wanted a different
   torch would fail here, there is no index to fetch one from);
4. runs every console command's `--help` and a tiny conversion with the commands from a working
   directory outside the checkout and without PYTHONPATH (make-tiny-hf -> convert-hf-to-megatron
   at TP1 -> convert-megatron-to-hf; the tensors come back bit-identical);
5. checks that torch was not replaced: same version and same file before and after, and no torch
   inside the new venv.

Skipped only where the build tools are missing (setuptools with bdist_wheel, venv).
~40 s on 2 cores (the conversion is most of it).
"""

from __future__ import annotations

import ast
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# What is the project itself in the running environment (an editable install from `make venv`).
_PROJECT = ("megatron_pdm", "rollout_bridge", "__editable__", "__pycache__")


def _console_scripts() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    scripts = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and n.targets[0].id == "CONSOLE_SCRIPTS")
    return [s.split("=")[0].strip() for s in scripts]


def _run(cmd: list[str], cwd: Path, timeout: int = 300, env: dict | None = None):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def _build_wheel(tmp: Path) -> Path:
    import importlib.util

    if importlib.util.find_spec("setuptools") is None or (
            importlib.util.find_spec("setuptools.command.bdist_wheel") is None
            and importlib.util.find_spec("wheel") is None):
        pytest.skip("cannot build a wheel here: setuptools (with bdist_wheel, or the wheel "
                    "package) is not installed")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("megatron_pdm", "rollout_bridge"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", tmp / "dist", src], cwd=tmp)
    (wheel,) = (tmp / "dist").glob("megatron_pdm-*.whl")
    return wheel


def _fresh_venv_over_this_stack(tmp: Path) -> Path:
    try:
        import venv  # noqa: F401
    except ImportError as err:
        pytest.skip(f"cannot make a venv here: {err}")
    env_dir = tmp / "venv"
    _run([sys._base_executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp)
    stack = tmp / "stack"
    stack.mkdir()
    for sp in site.getsitepackages():
        for entry in sorted(Path(sp).iterdir()):
            if entry.name.startswith(_PROJECT) or entry.suffix == ".pth":
                continue
            if not (stack / entry.name).exists():
                (stack / entry.name).symlink_to(entry)
    py = env_dir / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=tmp).stdout.strip()
    Path(purelib, "preinstalled_stack.pth").write_text(f"{stack}\n")
    return env_dir


def _torch_where(py: Path, cwd: Path, env: dict) -> str:
    return _run([py, "-c", "import torch; print(torch.__version__, torch.__file__)"],
                cwd=cwd, env=env).stdout.strip()


def _tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_the_wheel_installs_over_a_preinstalled_torch_and_converts(tmp_path):
    wheel = _build_wheel(tmp_path)
    env_dir = _fresh_venv_over_this_stack(tmp_path)
    py, bindir = env_dir / "bin" / "python", env_dir / "bin"
    work = tmp_path / "work"
    work.mkdir()
    # outside the checkout, no PYTHONPATH: only the installed wheel provides megatron_pdm
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PATH=f"{bindir}{os.pathsep}"
               + os.environ.get("PATH", ""))
    torch_before = _torch_where(py, work, env)
    assert torch_before.startswith(torch.__version__), torch_before

    # the driver's extras (the core alone needs only torch, numpy, pyyaml:
    # tests/packaging/test_core_install.py)
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "-q",
          "-c", ROOT / "constraints" / "ci.txt", f"{wheel}[all]"], cwd=work, env=env)

    assert _torch_where(py, work, env) == torch_before
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=work, env=env).stdout.strip())
    assert not list(purelib.glob("torch*")), "pip installed a torch into the venv"
    where = _run([py, "-c", "import megatron_pdm; print(megatron_pdm.__file__)"],
                 cwd=work, env=env).stdout.strip()
    assert Path(where).is_relative_to(purelib), where

    commands = _console_scripts()
    assert len(commands) >= 7, commands
    for command in commands:
        out = _run([bindir / command, "--help"], cwd=work, env=env).stdout
        assert "usage:" in out, (command, out[-500:])

    _run([bindir / "megatron-pdm-make-tiny-hf", "--out", "hf"], cwd=work, env=env)
    _run([bindir / "megatron-pdm-convert-hf-to-megatron", "--hf-dir", "hf", "--out", "mcore",
          "--tp", "1"], cwd=work, env=env)
    assert (work / "mcore" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    _run([bindir / "megatron-pdm-convert-megatron-to-hf", "--megatron-dir", "mcore", "--out",
          "hf_back"], cwd=work, env=env)
    src, back = _tensors(work / "hf"), _tensors(work / "hf_back")
    assert src and src.keys() == back.keys()
    differ = [k for k in src if not torch.equal(src[k], back[k])]
    assert not differ, differ

    assert _torch_where(py, work, env) == torch_before
