"""The repository is self-contained: every document reference resolves inside it.

* Every "§N.M" cited in code, scripts, configs or docs names a section that exists: in
  docs/cpu-megatron.md when the citation says so, else in docs/math.md (the project's math
  document; a bare § in code refers to it). Sections of the papers themselves ("[P-DPPO §5.4]")
  are not ours and are skipped.
* No file cites a document outside the repository (../shared, algorithms.md, ecosystem.md, ...).
* Every `docs/<name>.md` mentioned anywhere exists.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP = {".venv", ".git", ".cache", "runs", "node_modules", "_drafts", ".venv-vllm",
        ".venv-trl"}  # the benchmark-only TRL environment (scripts/setup_trl_cpu.sh)
CITE = re.compile(r"(cpu-megatron\.md\s*)?§\s?(\d+(?:\.\d+)*)")


@functools.lru_cache(maxsize=1)
def _file_list() -> tuple[pathlib.Path, ...]:
    """The tree's text files, walked once; environments, caches and run outputs are pruned
    before descending (a fresh clone's .venv-* and .cache hold hundreds of thousands of files)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP and not d.startswith(".venv")
                             and not d.endswith(".egg-info"))
        out += [pathlib.Path(dirpath, f) for f in sorted(filenames)
                if os.path.splitext(f)[1] in (".py", ".md", ".sh", ".yaml", ".toml", ".txt")]
    return tuple(out)


def _files():
    yield from _file_list()


def _sections(doc: pathlib.Path) -> set[str]:
    out = set()
    for line in doc.read_text().splitlines():
        m = re.match(r"#+\s+(\d+(?:\.\d+)*)[.\s]", line) or re.match(r"\*\*§(\d+(?:\.\d+)*)",
                                                                        line)
        if m:
            out.add(m.group(1).rstrip("."))
    return out


def test_every_section_citation_resolves():
    math_sections = _sections(ROOT / "docs" / "math.md")
    cpu_sections = _sections(ROOT / "docs" / "cpu-megatron.md")
    assert {"3.9", "6.10", "7.2", "7.6.1", "8.3"} <= math_sections
    assert "5.3" in cpu_sections
    missing = []
    for path in _files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in CITE.finditer(line):
                if re.search(r"P-[A-Z]+[^\]]*$", line[:m.start()]):
                    continue  # a paper's own section ("[P-DPPO §5.4]"), not ours
                number = m.group(2).rstrip(".")
                sections = cpu_sections if m.group(1) else math_sections
                if number not in sections:
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: §{number}")
    assert not missing, "\n".join(missing)


def test_nothing_cites_files_outside_the_repository():
    outside = re.compile(r"\.\./shared|shared/docs|algorithms\.md|ecosystem\.md|house-style\.md|"
                         r"real-engines\.md")
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in _files()
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if outside.search(line) and p.name != "test_docs.py"]
    assert not bad, bad


def test_referenced_docs_exist():
    ref = re.compile(r"docs/([\w\-/]+\.md)")
    bad = [f"{p.relative_to(ROOT)}: docs/{m}" for p in _files()
           for m in ref.findall(p.read_text(errors="replace"))
           if not (ROOT / "docs" / m).exists()]
    assert not bad, bad


# Top-level folders and files of this repository: a reference that starts with one of them is a
# path inside the repository and must resolve.
_TOP = ("megatron_pdm", "rollout_bridge", "tests", "docs", "benchmarks", "scripts", "tools",
        "examples", "constraints", ".ci")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./{},*-]*[\w}*])" % "|".join(re.escape(t) for t in _TOP))
# Paths written by a run or by the environment scripts, not part of the tree.
_GENERATED = ("runs/", ".cache/", ".venv")


def _expand(ref: str) -> list[str]:
    """`megatron_pdm/{ops,parallel}` -> both paths; a `*` glob is kept for globbing."""
    m = re.search(r"\{([^{}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",")
            for x in _expand(ref[:m.start()] + alt + ref[m.end():])]


def _resolves(ref: str) -> bool:
    ref = ref.split("::")[0].rstrip(".,:;")
    ref = re.sub(r":\d+(-\d+)?$", "", ref)
    for path in _expand(ref):
        if "*" in path:
            if not list(ROOT.glob(path)):
                return False
        elif not (ROOT / path).exists() and not (ROOT / (path + ".py")).exists():
            return False
    return True


def test_every_repository_path_resolves():
    """Every path into the tree named in README, docs or code exists (the history in
    CHANGELOG.md may name what has since moved)."""
    bad = []
    for path in list(_files()) + [ROOT / "Makefile"]:
        rel = path.relative_to(ROOT)
        if rel.name in ("CHANGELOG.md", "test_docs.py"):
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for ref in _PATH.findall(line):
                if any(g in ref for g in _GENERATED) or "<" in ref:
                    continue
                if not _resolves(ref):
                    bad.append(f"{rel}:{lineno}: {ref}")
    assert not bad, "\n".join(bad)


def test_no_tracker_references():
    """No file cites an issue tracker the reader does not have ("issue 9", "issue #13")."""
    tracker = re.compile(r"\bissues?\s*#?\d+\b", re.I)
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in list(_files()) + [ROOT / "Makefile"]
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if tracker.search(line) and p.name != "test_docs.py"]
    assert not bad, "\n".join(bad)
