"""The layers of docs/design.md are the architecture; this test reads the real import graph.

Two views of the same rule:

* Static: every `import` / `from ... import` in every file of `megatron_pdm/` (its CLIs in
  `megatron_pdm/tools/`) and `rollout_bridge/` (module level and inside functions) is an edge
  between project units (`ops`, `parallel`, `loss`, `mcore`, `train`, ..., the face
  `rollout_bridge` and its subpackages `rb.core`, `rb.sglang`, `rb.vllm`, `rb.local`: core knows no engine, the engines do not import
  each other). Each unit may only depend on the units listed in ALLOWED: nothing points from a
  lower layer to an upper one. Inside the package, modules import modules, never names from the
  package face `megatron_pdm/__init__`.
  The module-level import graph has no cycle.
* Dynamic: in a fresh interpreter, importing a module loads nothing above it (importing
  `megatron_pdm.ops` loads neither `parallel`, `loss` nor megatron; the pure modules load no
  torch).
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"  # megatron_pdm/triton_stub.py

# unit -> units it may import (besides itself). "face" is megatron_pdm/__init__.
PURE = {"configtree", "configfile", "fsutil", "arch", "layout", "config", "cli", "triton_stub",
        "cpu_jit",
        "netutil", "significance", "intmath", "hostinfo"}
ALLOWED = {
    "face": {"ops", "parallel", "loss", "config", "triton_stub", "cpu_jit", "metrics", "own_loop"},
    "triton_stub": set(),
    "cpu_jit": set(),
    "configtree": set(),
    "fsutil": set(),
    "configfile": {"configtree", "fsutil"},
    "arch": {"configtree", "intmath"},
    "layout": {"arch", "configtree"},
    "config": {"configtree", "configfile"},
    "cli": {"configtree"},
    "metrics": set(),
    "netutil": set(),
    "significance": set(),
    "intmath": set(),
    "hostinfo": set(),
    "ops": set(),
    "parallel": {"ops"},
    "loss": {"ops", "config", "configtree", "metrics"},
    # your own forward_step (docs/own-loop.md): rows, the one loss call; torch only
    "own_loop": {"ops", "parallel", "loss", "config"},
    # framework adapters (slime's custom loss and rollout hooks, verl's policy losses and logits
    # processor) over the own-loop API, the op and the loss; TP group from mcore; slime's hooks
    # check SGLang answers with the rb.sglang parser
    "integrations": {"own_loop", "ops", "parallel", "loss", "config", "mcore", "rb.core",
                     "rb.sglang"},
    "mcore": {"ops", "parallel", "loss", "config", "configtree", "metrics", "arch", "fsutil",
              "triton_stub", "intmath"},
    "convert": {"arch", "configtree", "layout", "mcore", "ops", "netutil"},
    "analysis": {"ops", "parallel", "loss", "config", "configtree", "metrics", "arch", "mcore",
                 "rollout_bridge", "rb.core", "train", "cli", "significance", "hostinfo"},
    "train": {"ops", "parallel", "loss", "config", "configtree", "configfile", "metrics", "arch",
              "layout", "mcore", "convert", "cli", "netutil", "rollout_bridge", "rb.core", "rb.sglang",
              "rb.vllm", "rb.local", "significance", "intmath", "hostinfo"},
    # rollout_bridge: the package face (lazy re-exports), the engine-independent core, one
    # subpackage per engine. The engines share only core; core knows no engine.
    "rollout_bridge": {"rb.core", "rb.sglang", "rb.vllm", "rb.local"},
    "rb.core": {"ops", "intmath"},
    "rb.sglang": {"rb.core", "ops"},
    "rb.vllm": {"rb.core", "ops"},
    "rb.local": {"rb.core", "ops"},
    "stability": {"train", "metrics", "significance", "cli", "configtree", "hostinfo"},
    "tools": {"stability", "ops", "parallel", "loss", "config", "configtree", "fsutil", "metrics", "arch",
              "layout", "mcore", "convert", "cli", "rollout_bridge", "rb.core", "rb.sglang",
              "rb.vllm", "rb.local", "train", "analysis", "significance", "intmath", "hostinfo"},
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "rollout_bridge":
        return "rollout_bridge" if len(parts) == 1 else f"rb.{parts[1]}"
    if parts[0] != "megatron_pdm":
        return None
    return "face" if len(parts) == 1 else parts[1]


def _files() -> list[pathlib.Path]:
    files = []
    for sub in ("megatron_pdm", "rollout_bridge"):
        files += sorted((ROOT / sub).rglob("*.py"))
    assert len(files) > 40
    return files


def _edges(path: pathlib.Path) -> list[tuple[str, int, bool, str | None]]:
    """(imported module, line, runs at import time, imported name or None) per project import.

    Imports inside a function body run only when it is called; everything else (module body,
    class bodies, module-level if/try blocks) runs at import time.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, int, bool, str | None]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, not in_function, None) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.extend((child.module, child.lineno, not in_function, a.name)
                           for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return [e for e in out if e[0].split(".")[0] in ("megatron_pdm", "rollout_bridge")
            or e[0] == "megatron" or e[0].startswith("megatron.")]


def _submodule_exists(package: str, name: str) -> bool:
    base = ROOT.joinpath(*package.split("."))
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


def test_layers_hold_in_the_static_import_graph():
    problems = []
    for path in _files():
        me = _module_name(path)
        unit = _unit(me)
        for target, line, _, name in _edges(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if target == "megatron" or target.startswith("megatron."):
                if unit not in ("mcore", "convert", "train", "tools", "analysis"):
                    problems.append(f"{where}: {unit} imports megatron-core ({target})")
                continue
            if target == "megatron_pdm" and name is not None:
                if not _submodule_exists("megatron_pdm", name):
                    if unit != "tools":
                        problems.append(f"{where}: imports {name!r} from the package face")
                    continue
                target = f"megatron_pdm.{name}"
            other = _unit(target)
            if other is None or other == unit:
                continue
            if other not in ALLOWED[unit]:
                problems.append(f"{where}: {unit} -> {other} ({target}) is not an allowed arrow")
    assert not problems, "\n".join(problems)


def test_module_level_imports_have_no_cycle():
    graph: dict[str, set[str]] = {}
    for path in _files():
        me = _module_name(path)
        deps = set()
        for target, _, at_top, name in _edges(path):
            if not at_top or target.split(".")[0] == "megatron":
                continue
            if name is not None and _submodule_exists(target, name):
                target = f"{target}.{name}"
            deps.add(target)
        graph[me] = deps
    # A module also depends on its parent packages (their __init__ runs first). A package whose
    # __init__ only re-exports its own submodules cannot close a cycle through a child (the
    # children never import names from it, see the face rule), so only the others count.
    def own(pkg: str, dep: str) -> bool:
        return dep == pkg or dep.startswith(pkg + ".")

    for mod in list(graph):
        parts = mod.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in graph and not all(own(parent, d) for d in graph[parent]):
                graph[mod].add(parent)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the module graph (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if state.get(dep) is None:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _full_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports, imports inside functions included."""
    graph: dict[str, set[str]] = {}
    for path in _files():
        deps = set()
        for target, _, _, name in _edges(path):
            if target.split(".")[0] == "megatron":
                continue
            if name is not None and _submodule_exists(target, name):
                target = f"{target}.{name}"
            deps.add(target)
        graph[_module_name(path)] = deps
    return graph


def _packages() -> list[str]:
    return sorted(_module_name(p.parent / "__init__.py") for p in _files()
                  if p.name == "__init__.py")


# No cycle even counting imports inside functions, in any package or across packages: a deferred
# import that closes a loop hides a rule living in the wrong module.
@pytest.mark.parametrize("package", _packages())
def test_no_cycle_inside_package_counting_function_level_imports(package):
    full = _full_graph()
    graph = {m: {d for d in deps if d.startswith(package + ".")}
             for m, deps in full.items() if m.startswith(package + ".")}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (function-level imports included): " + " -> ".join(cycle)


def test_no_cycle_in_the_project_counting_function_level_imports():
    graph = _full_graph()
    assert len(graph) > 40 and any("analysis" in m for m in graph)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (function-level imports included): " + " -> ".join(cycle)


def test_find_cycle_sees_a_function_level_loop():
    # the check can fail: a loop like the one analysis/ once had (a.b imports a.c inside a
    # function, a.c imports a.b at the top)
    assert _find_cycle({"a.b": {"a.c"}, "a.c": {"a.b"}}) == ["a.b", "a.c", "a.b"]


def _design_units() -> set[str]:
    """The units docs/design.md's layer table names (megatron_pdm/ and rollout_bridge/ entries)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("## Layers"):]
    table = table[table.index("```") + 3:]
    table = table[:table.index("```")]
    units: set[str] = set()
    section = None
    for line in table.splitlines():
        if line.startswith("megatron_pdm/"):
            section = "megatron_pdm"
        elif line.startswith("rollout_bridge/"):
            section = "rollout_bridge"
            units.add("rollout_bridge")
        m = re.match(r"^  (\S+?)(\.py|/)\s", line)
        if m is None or section is None:
            continue
        name = m.group(1)
        if section == "rollout_bridge":
            units.add(f"rb.{name}")
        elif name == "__init__":
            units.add("face")
        else:
            units.add(name)
    return units


def test_design_layer_table_lists_exactly_the_allowed_units():
    # docs/design.md's layer table and ALLOWED describe the same units; every unit of the code
    # is in ALLOWED (a new module must be placed in both on purpose)
    documented = _design_units()
    assert documented == set(ALLOWED), (
        f"in docs/design.md only: {sorted(documented - set(ALLOWED))}; "
        f"in ALLOWED only: {sorted(set(ALLOWED) - documented)}")
    in_code = {_unit(_module_name(p)) for p in _files()}
    assert in_code <= set(ALLOWED), sorted(in_code - set(ALLOWED))


_FORBIDDEN = {
    "megatron_pdm": ("megatron_pdm.ops", "megatron_pdm.parallel", "megatron_pdm.loss",
                     "megatron_pdm.mcore", "torch", "megatron"),
    "megatron_pdm.configtree": ("torch", "megatron", "megatron_pdm.ops"),
    "megatron_pdm.arch": ("torch", "megatron", "megatron_pdm.ops"),
    "megatron_pdm.intmath": ("torch", "megatron", "megatron_pdm.ops"),
    "megatron_pdm.layout": ("torch", "megatron", "megatron_pdm.ops"),
    "megatron_pdm.config": ("torch", "megatron", "megatron_pdm.ops"),
    "megatron_pdm.ops": ("megatron_pdm.parallel", "megatron_pdm.loss", "megatron_pdm.mcore",
                         "megatron_pdm.train", "megatron"),
    "megatron_pdm.ops.divergence": ("megatron_pdm.parallel", "megatron_pdm.loss", "megatron"),
    "megatron_pdm.parallel": ("megatron_pdm.loss", "megatron_pdm.mcore", "megatron_pdm.train",
                              "megatron"),
    "megatron_pdm.loss.policy_loss": ("megatron_pdm.parallel", "megatron_pdm.mcore",
                                      "megatron_pdm.train", "megatron"),
    "megatron_pdm.own_loop": ("megatron_pdm.mcore", "megatron_pdm.train", "rollout_bridge",
                              "megatron", "transformer_engine"),
    "rollout_bridge": ("megatron_pdm.parallel", "megatron_pdm.loss", "megatron_pdm.mcore",
                       "megatron_pdm.train", "megatron"),
    "rollout_bridge.core.types": ("rollout_bridge.sglang", "rollout_bridge.vllm",
                                  "rollout_bridge.local", "aiohttp", "megatron_pdm", "megatron"),
    "rollout_bridge.core.packing": ("rollout_bridge.sglang", "rollout_bridge.vllm",
                                    "rollout_bridge.local", "aiohttp", "megatron"),
    "rollout_bridge.core.attempts": ("rollout_bridge.sglang", "rollout_bridge.vllm",
                                     "rollout_bridge.local", "aiohttp", "megatron"),
    "rollout_bridge.core.apikey": ("rollout_bridge.sglang", "rollout_bridge.vllm", "torch",
                                   "aiohttp", "megatron_pdm"),
    "rollout_bridge.sglang.client": ("rollout_bridge.vllm", "rollout_bridge.local",
                                     "megatron_pdm.parallel", "megatron_pdm.loss",
                                     "megatron_pdm.train", "megatron"),
    "rollout_bridge.vllm.client": ("rollout_bridge.sglang", "rollout_bridge.local",
                                   "megatron_pdm.parallel", "megatron_pdm.loss",
                                   "megatron_pdm.train", "megatron"),
    "rollout_bridge.vllm.worker_ext": ("rollout_bridge.core", "rollout_bridge.sglang",
                                       "megatron_pdm", "aiohttp"),
    "megatron_pdm.mcore.loss_adapter": ("megatron_pdm.train", "rollout_bridge"),
}


@pytest.mark.parametrize("module", sorted(_FORBIDDEN))
def test_fresh_import_loads_nothing_above_its_layer(module):
    forbidden = _FORBIDDEN[module]
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        # the triton stand-in (megatron_pdm/triton_stub.py) is a placeholder, not an import
        f"bad = sorted(m for m in sys.modules if m != {PAGED_STASH!r} and (m in {forbidden!r} or "
        f"any(m.startswith(f + '.') for f in {forbidden!r})))\n"
        "assert not bad, bad[:8]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"importing {module} loaded:\n{proc.stderr[-2000:]}"


def test_rollout_bridge_units_are_the_subpackages():
    # Every module of rollout_bridge lives in one of the units ALLOWED knows (a new flat module
    # or subpackage must be placed in the layering on purpose), and the only megatron_pdm modules
    # the bridge imports are the support contract and the pure integer rounding.
    units = {k for k in ALLOWED if k.startswith("rb.")}
    problems = []
    for path in sorted((ROOT / "rollout_bridge").rglob("*.py")):
        unit = _unit(_module_name(path))
        if unit != "rollout_bridge" and unit not in units:
            problems.append(f"{path.relative_to(ROOT)}: unit {unit} is not in ALLOWED")
        for target, line, _, _ in _edges(path):
            if target.startswith("megatron_pdm") and target not in ("megatron_pdm.ops.support",
                                                                     "megatron_pdm.intmath"):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not problems, "\n".join(problems)
    assert units == {"rb.core", "rb.sglang", "rb.vllm", "rb.local"}


def test_no_package_named_megatron_inside_the_project():
    # A `megatron` package of ours would shadow megatron-core for code that puts its parent on
    # sys.path (pytest's rootdir insertion, spawned workers).
    shadows = []
    for d, dirs, _ in os.walk(ROOT):  # environments and caches pruned before descending
        dirs[:] = [x for x in dirs if x not in (".git", ".cache") and not x.startswith(".venv")]
        if os.path.exists(os.path.join(d, "megatron", "__init__.py")):
            shadows.append(os.path.join(d, "megatron"))
    assert not shadows, shadows
