"""The repository is self-contained: every document reference resolves inside it.

* Every "§N.M" cited in code, scripts, configs or docs names a section that exists: in
  docs/cpu-megatron.md when the citation says so, else in docs/math.md (the project's math
  document; a bare § in code refers to it). Sections of the papers themselves ("[P-DPPO §5.4]")
  are not ours and are skipped.
* No file cites a document outside the repository (../shared, algorithms.md, ecosystem.md, ...).
* Every `docs/<name>.md` mentioned anywhere exists.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP = {".venv", ".git", ".cache", "runs", "node_modules", "_drafts", ".venv-vllm"}
CITE = re.compile(r"(cpu-megatron\.md\s*)?§\s?(\d+(?:\.\d+)*)")


def _files():
    for path in ROOT.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".md", ".sh", ".yaml", ".toml", ".txt") \
                and not SKIP & set(path.relative_to(ROOT).parts):
            yield path


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
