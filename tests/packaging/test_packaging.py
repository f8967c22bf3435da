"""Packaging: supported ranges in setup.py, one exact tested point in constraints/ci.txt.

The core install needs only torch, numpy and pyyaml; megatron-core, transformers and the rest are
extras ([megatron], [engines], [plots], [all] = their union, which `make venv` installs). The
ranges must contain both the CI pins and megatron-core 0.19.2 (the newest release, checked on
Python 3.12 by scripts/check_mcore_latest.sh); every pinned package satisfies its range, and
everything `make venv` installs has a pin.
"""

from __future__ import annotations

import ast
import pathlib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _setup_values() -> dict:
    tree = ast.parse((ROOT / "setup.py").read_text())
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}


def _reqs(lines: list[str]) -> dict[str, Requirement]:
    return {r.name.lower(): r for r in map(Requirement, lines)}


def _core() -> dict[str, Requirement]:
    return _reqs(_setup_values()["INSTALL_REQUIRES"])


def _install_requires() -> dict[str, Requirement]:
    """The core plus everything `make venv` installs ([test,all])."""
    extras = _setup_values()["EXTRAS"]
    return {**_core(), **_reqs(extras["all"]), **_reqs(extras["test"])}


def test_the_core_install_is_torch_numpy_pyyaml_and_the_rest_are_extras():
    assert set(_core()) == {"torch", "numpy", "pyyaml"}
    extras = _setup_values()["EXTRAS"]
    union = {**_reqs(extras["megatron"]), **_reqs(extras["engines"]), **_reqs(extras["plots"])}
    assert {k: str(v) for k, v in _reqs(extras["all"]).items()} == \
        {k: str(v) for k, v in union.items()}
    assert "megatron-core" in _reqs(extras["megatron"]) and "aiohttp" in _reqs(extras["engines"])
    for name in ("bench", "real-model", "gpu", "wandb", "test"):
        assert extras[name], name
    make = (ROOT / "Makefile").read_text()
    assert '-e ".[test,all]"' in make and '-e ".[real-model]"' in make


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints" / "ci.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = Version(version)
    return pins


def test_ranges_not_pins_and_the_newest_megatron_core_inside():
    reqs = _install_requires()
    for name in ("torch", "megatron-core", "transformers"):
        assert name in reqs, name
        assert not any(s.operator == "==" for s in reqs[name].specifier), reqs[name]
    assert Version("0.19.2") in reqs["megatron-core"].specifier
    assert Version("0.16.1") in reqs["megatron-core"].specifier


def test_ci_pins_satisfy_the_ranges():
    reqs, pins = _install_requires(), _pins()
    for name in ("torch", "megatron-core", "transformers", "numpy"):
        assert name in pins, name
    unpinned = sorted(n for n in reqs if n.replace("_", "-") not in pins)
    assert not unpinned, f"make venv installs these without a pin in constraints/ci.txt: {unpinned}"
    for name, req in reqs.items():
        key = name.replace("_", "-")
        if key in pins:
            assert pins[key] in req.specifier, (name, pins[key], str(req.specifier))


def test_ngc_prerelease_builds_satisfy_the_ranges():
    """An NGC container's torch/megatron-core (pre-release + local label) is kept by pip: pip
    checks an installed version with pre-releases allowed, so only the bound's value matters."""
    reqs = _install_requires()
    for name, version in (("torch", "2.6.0a0+nv25.1"), ("torch", "2.8.0a0+5228986c39.nv25.6"),
                          ("megatron-core", "0.16.1rc0+nv25.9"), ("megatron-core", "0.19.0rc1")):
        assert reqs[name].specifier.contains(Version(version), prereleases=True), (name, version)
    assert not reqs["torch"].specifier.contains(Version("2.5.1"), prereleases=True)
    assert not reqs["megatron-core"].specifier.contains(Version("0.20.0rc0"), prereleases=True)


def test_console_scripts_resolve_to_callables():
    import importlib

    tree = ast.parse((ROOT / "setup.py").read_text())
    scripts = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and n.targets[0].id == "CONSOLE_SCRIPTS")
    assert {s.split("=")[0].strip() for s in scripts} >= {"megatron-pdm-train"}
    for line in scripts:
        module, func = line.split("=", 1)[1].strip().split(":")
        assert callable(getattr(importlib.import_module(module), func)), line


def test_every_tool_is_a_console_command_and_a_module():
    """The converters, verify, tiny-model and study tools are inside the package (an installed
    wheel can convert a checkpoint), each a console command over its module's entry point."""
    import importlib

    tree = ast.parse((ROOT / "setup.py").read_text())
    scripts = dict(
        (s.split("=")[0].strip(), s.split("=", 1)[1].strip())
        for s in next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                      and n.targets[0].id == "CONSOLE_SCRIPTS"))
    tools = {"make_tiny_hf": "main", "convert_hf_to_megatron": "main",
             "convert_megatron_to_hf": "main", "verify_conversion": "main",
             "analyze_masks": "cli"}
    for name, func in tools.items():
        command = "megatron-pdm-" + name.replace("_", "-")
        assert scripts.get(command) == f"megatron_pdm.tools.{name}:{func}", command
        assert callable(getattr(importlib.import_module(f"megatron_pdm.tools.{name}"), func))
    # the code lives in megatron_pdm/tools/; top-level tools/ holds only thin scripts
    # (tests/tools/test_tools_scripts.py checks them against CONSOLE_SCRIPTS)
    assert not (ROOT / "tools" / "__init__.py").exists(), "tools/ must not be a package"
