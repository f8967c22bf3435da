"""pip's decision over a framework image's own torch and megatron-core: the core replaces nothing.

A framework image (NGC, slime, verl, NeMo) ships its own torch, often an NVIDIA pre-release such
as `2.6.0a0+nv25.1`, and its own megatron-core, often older than CI's 0.16.1 or installed from
source. `pip install megatron-pdm` there must keep both.

What is real and what is a stand-in. The wheel is the real one (built from this tree, setup.py
as it is). The image's packages are STAND-INS: installed-metadata only (a `.dist-info` folder with
METADATA, INSTALLER and RECORD in a fresh venv's site-packages, no code): torch
`2.6.0a0+nv25.1` with the requirements of a torch build (filelock, typing-extensions, sympy,
networkx, jinja2, fsspec, also stand-ins), numpy, pyyaml and megatron-core `0.12.0` or a
source-install style `0.14.0rc7`. A real other torch is too large here (a CUDA build is ~5 GB),
and what is checked is pip's resolver decision, which reads only that metadata. The "index" is a
local folder (`--no-index --find-links`) offering stand-in wheels of CI's versions (torch
2.13.0, megatron-core 0.16.1, numpy, pyyaml), so that a requirement the image does not meet
would be met by a replacement, as PyPI would do, instead of simply failing. That the op
really runs with torch, numpy and pyyaml at TP 2 is the functional check of
tests/packaging/test_core_install.py (CI's torch).

Checked, each with pip's `--dry-run --report` and then the real install:
1. the core: pip installs megatron-pdm alone; the stand-ins' metadata is byte-identical after;
2. `[megatron]` over the old megatron-core, recorded as it is: with nothing to fetch
   (`--no-index`, no links) pip stops with "No matching distribution found for
   megatron-core<0.20,>=0.16.1a0 (from megatron-pdm[megatron])" (the installed version is not
   named: it is just not a candidate) and changes nothing; with CI's megatron-core on offer it
   REPLACES the image's (the extra asks for >=0.16.1a0): the extra is not for framework
   images, the core is;
3. the check has teeth: the same decision over wheels built from a setup.py asking `torch>=2.6`
   (no a0) or megatron-core in install_requires replaces torch / megatron-core.

~1 min on 2 cores (four wheel builds, a dozen pip resolutions of metadata).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.test_wheel_install import _run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

NGC_TORCH = "2.6.0a0+nv25.1"
TORCH_DEPS = {"filelock": "3.16.1", "typing-extensions": "4.12.2", "sympy": "1.13.1",
              "networkx": "3.4.2", "jinja2": "3.1.4", "fsspec": "2024.10.0",
              "markupsafe": "3.0.2", "mpmath": "1.3.0", "packaging": "24.2"}
REQUIRES = {"torch": [f"{d}" for d in ("filelock", "typing-extensions>=4.10.0", "sympy==1.13.1",
                                       "networkx", "jinja2", "fsspec")],
            "jinja2": ["markupsafe>=2.0"], "sympy": ["mpmath<1.4,>=1.1.0"],
            "megatron-core": ["torch", "numpy", "packaging"]}
# what [megatron] needs besides megatron-core, present in the image (so only megatron-core is
# left for pip to decide about)
MEGATRON_REST = {"psutil": "6.1.0", "tqdm": "4.67.1", "tensorboard": "2.18.0",
                 "safetensors": "0.4.5", "transformers": "5.0.0"}
# CI's versions on offer in the local "index"
OFFERED = {"torch": "2.13.0", "megatron-core": "0.16.1", "numpy": "2.2.6", "pyyaml": "6.0.2"}


def _dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata(name: str, version: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    return "\n".join(lines + [f"Requires-Dist: {r}" for r in REQUIRES.get(name, [])]) + "\n"


def _installed(purelib: Path, name: str, version: str) -> None:
    """A stand-in installed distribution: its dist-info only (module docstring)."""
    info = purelib / f"{_dist_name(name)}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(_metadata(name, version))
    (info / "INSTALLER").write_text("image\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n"
                                         for f in ("METADATA", "INSTALLER", "RECORD")))


def _offered_wheel(links: Path, name: str, version: str) -> None:
    """A stand-in wheel of CI's version, for the local 'index' (metadata only)."""
    info = f"{_dist_name(name)}-{version}.dist-info"
    files = {f"{info}/METADATA": _metadata(name, version),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: stand-in\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{p},{digest(t)},{len(t.encode())}\n" for p, t in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(links / f"{_dist_name(name)}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)


def _build(tmp: Path, setup_text: str) -> Path:
    """The wheel of this tree with `setup_text` as setup.py (no download, checkout untouched)."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("megatron_pdm", "rollout_bridge"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", src / "pyproject.toml")
    (src / "setup.py").write_text(setup_text)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", tmp / "dist", src], cwd=tmp)
    (wheel,) = (tmp / "dist").glob("megatron_pdm-*.whl")
    return wheel


class Image:
    """A fresh venv whose site-packages holds the stand-in image (module docstring)."""

    def __init__(self, tmp: Path, mcore: str):
        import venv  # noqa: F401  (skips below where venv is missing)

        self.tmp = tmp
        _run([sys._base_executable, "-m", "venv", "--without-pip", tmp / "venv"], cwd=tmp)
        self.py = tmp / "venv" / "bin" / "python"
        probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        self.purelib = Path(_run([self.py, "-c", probe], cwd=tmp).stdout.strip())
        self.versions = {"torch": NGC_TORCH, "numpy": "1.26.4", "pyyaml": "6.0.2",
                         "megatron-core": mcore, **TORCH_DEPS, **MEGATRON_REST}
        for name, version in self.versions.items():
            _installed(self.purelib, name, version)
        self.links = tmp / "links"
        self.links.mkdir()
        for name, version in OFFERED.items():
            _offered_wheel(self.links, name, version)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("PIP_")}
        self.env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")

    def snapshot(self) -> dict[str, str]:
        """Every dist-info's files and contents (what pip would change by replacing one)."""
        return {str(p.relative_to(self.purelib)): p.read_text()
                for p in sorted(self.purelib.glob("*.dist-info/*")) if p.is_file()}

    def pip(self, target: str, *, links: bool, dry_run: bool, check: bool = True):
        cmd = [sys.executable, "-m", "pip", "--python", self.py, "install", "--no-index"]
        cmd += ["--find-links", self.links] if links else []
        report = self.tmp / "report.json"
        cmd += ["--dry-run", "--report", report] if dry_run else []
        if check:
            _run([*cmd, target], cwd=self.tmp, env=self.env)
            return json.loads(report.read_text()) if dry_run else None
        return subprocess.run([str(c) for c in [*cmd, target]], cwd=self.tmp, env=self.env,
                              capture_output=True, text=True, timeout=300, check=False)

    def decision(self, target: str) -> dict[str, str]:
        """name -> version pip would install (CI's versions on offer)."""
        report = self.pip(target, links=True, dry_run=True)
        return {_dist_name(i["metadata"]["name"]): i["metadata"]["version"]
                for i in report["install"]}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("wheel"), (ROOT / "setup.py").read_text())


def _image(tmp_path, mcore="0.12.0") -> Image:
    try:
        return Image(tmp_path, mcore)
    except ImportError as err:
        pytest.skip(f"cannot make a venv here: {err}")


@pytest.mark.parametrize("mcore", ["0.12.0", "0.14.0rc7"])
def test_the_core_installs_over_ngc_torch_and_an_older_megatron_core_replacing_nothing(
        wheel, tmp_path, mcore):
    image = _image(tmp_path, mcore)
    before = image.snapshot()
    assert image.decision(str(wheel)) == {"megatron_pdm": "0.2.0"}
    image.pip(str(wheel), links=True, dry_run=False)
    after = image.snapshot()
    new = sorted(set(after) - set(before))
    assert new and all(p.startswith("megatron_pdm-") for p in new), new
    assert {p: after[p] for p in before} == before     # every image dist-info byte-identical
    assert f"torch-{NGC_TORCH}.dist-info/METADATA" in after


def test_the_megatron_extra_over_an_older_megatron_core_conflicts_or_replaces_it(wheel, tmp_path):
    image = _image(tmp_path)
    before = image.snapshot()
    proc = image.pip(f"{wheel}[megatron]", links=False, dry_run=False, check=False)
    assert proc.returncode != 0
    # pip 26: "No matching distribution found for megatron-core<0.20,>=0.16.1a0 (from
    # megatron-pdm[megatron])", the installed 0.12.0 not named (it is simply not a candidate)
    assert re.search(r"No matching distribution found for megatron-core"
                     r"(<0\.20,>=0\.16\.1a0|>=0\.16\.1a0,<0\.20) \(from megatron-pdm\[megatron\]\)",
                     proc.stderr), proc.stderr
    assert image.snapshot() == before
    # with CI's megatron-core on offer, the extra replaces the image's (recorded, not wanted in
    # a framework image: install the core there)
    assert image.decision(f"{wheel}[megatron]") == {"megatron_pdm": "0.2.0",
                                                    "megatron_core": OFFERED["megatron-core"]}


@pytest.mark.parametrize("old, new, replaced", [
    ('"torch>=2.6.0a0,<3",', '"torch>=2.6,<3",', {"torch": OFFERED["torch"]}),
    ('"pyyaml>=6.0",', '"pyyaml>=6.0", "megatron-core>=0.16.1a0,<0.20",',
     {"megatron_core": OFFERED["megatron-core"]}),
])
def test_the_decision_check_catches_a_setup_that_would_replace(tmp_path, old, new, replaced):
    text = (ROOT / "setup.py").read_text()
    assert text.count(old) == 1, old
    bad = _build(tmp_path / "build", text.replace(old, new))
    (tmp_path / "img").mkdir()
    image = _image(tmp_path / "img")
    assert image.decision(str(bad)) == {"megatron_pdm": "0.2.0", **replaced}


def test_the_wheel_ships_the_slime_hooks_and_their_patch(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    folder = "megatron_pdm/integrations/slime/"
    assert {folder + n for n in ("__init__.py", "loss.py", "hooks.py", "passthrough.patch")} <= names
