"""Generated blocks in the docs: every number inside one is recomputed from a committed results
file by one command (`megatron-pdm-study-report --update-doc DOC ...`, `make results-docs`).

A block is an opening and a closing HTML comment around generated text, on their own lines (a
table, a paragraph) or inline (one cell of a README table):

    <!-- KIND PATH -->generated text<!-- /KIND -->

KIND names the renderer, PATH (relative to the repository root) the committed file or folder it
reads:

    study-table  results/mask_study/<name>/results.json   the study's tables (stored.doc_block)
    study-line   results/mask_study/<name>/results.json   its primary verdict and controls, one line
    run-table    results/main_job                         one row per stored `make demo` run
    run-line     results/main_job                         those runs in one line

`update` rewrites every block of a doc; `check` names the blocks that differ from what `update`
would write (tests/analysis/test_stored_results.py runs it over README.md, docs/mask-study.md and
docs/main-job.md).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Callable

__all__ = ["BLOCK", "KINDS", "check", "render", "render_text", "update"]

BLOCK = re.compile(r"(<!-- ([a-z-]+) (\S+) -->\n?)(.*?)(<!-- /\2 -->)", re.S)


def _study_table(path: str, label: str) -> str:
    from megatron_pdm.analysis import stored

    return stored.doc_block(path, label)


def _study_line(path: str, label: str) -> str:
    from megatron_pdm.analysis import stored

    return stored.doc_line(path)


def _run_table(path: str, label: str) -> str:
    from megatron_pdm.analysis import main_job

    return main_job.doc_table(path, label)


def _run_line(path: str, label: str) -> str:
    from megatron_pdm.analysis import main_job

    return main_job.doc_line(path)


KINDS: dict[str, Callable[[str, str], str]] = {
    "study-table": _study_table,
    "study-line": _study_line,
    "run-table": _run_table,
    "run-line": _run_line,
}


def _stamp(full: str) -> tuple:
    """(name, size, mtime) of `full` and, for a folder, of every file under it: a changed input
    changes the stamp, so a cached rendering is never stale."""
    paths = [full] if os.path.isfile(full) else sorted(
        os.path.join(d, f) for d, _, files in os.walk(full) for f in files)
    return tuple((p, os.path.getsize(p), os.path.getmtime(p)) for p in paths)


@functools.lru_cache(maxsize=64)
def _render_cached(fn: Callable[[str, str], str], full: str, path: str, stamp: tuple) -> str:
    return fn(full, path)


def render(kind: str, path: str, root: str = ".",
           kinds: dict[str, Callable[[str, str], str]] | None = None) -> str:
    """The generated text of one block (`path` relative to `root`; `kinds`: renderers beside
    KINDS, e.g. benchmarks/op_matrix.py's `op-matrix`); a block already rendered from unchanged
    inputs in this process is not recomputed (the study summaries' resampling makes each
    rendering seconds)."""
    known = {**KINDS, **(kinds or {})}
    if kind not in known:
        raise ValueError(f"unknown generated block kind {kind!r}; known: {sorted(known)}")
    full = os.path.join(root, path)
    if not os.path.exists(full):
        raise FileNotFoundError(f"generated block <!-- {kind} {path} -->: {full} does not exist")
    return _render_cached(known[kind], full, path, _stamp(full))


def _found(text: str, known) -> list[re.Match]:
    return [m for m in BLOCK.finditer(text) if m.group(2) in known]


def render_text(text: str, root: str = ".", kinds=None) -> str:
    """`text` with every generated block rewritten (the blocks of other kinds untouched)."""
    known = {**KINDS, **(kinds or {})}
    return BLOCK.sub(lambda m: (m.group(1) + render(m.group(2), m.group(3), root, kinds)
                                + m.group(5)) if m.group(2) in known else m.group(0), text)


def _blocks(doc: str, kinds=None) -> tuple[str, list[re.Match]]:
    with open(doc) as f:
        text = f.read()
    known = {**KINDS, **(kinds or {})}
    found = _found(text, known)
    if not found:
        raise ValueError(f"{doc}: no generated block (<!-- KIND PATH --> ... <!-- /KIND -->, "
                         f"KIND one of {sorted(known)})")
    return text, found


def update(doc: str, root: str = ".", kinds=None) -> int:
    """Rewrites every generated block of `doc`; returns the number of blocks."""
    text, found = _blocks(doc, kinds)
    new = render_text(text, root, kinds)
    if new != text:
        with open(doc, "w") as f:
            f.write(new)
    return len(found)


def check(doc: str, root: str = ".", kinds=None) -> list[str]:
    """`KIND PATH` of every block of `doc` whose text differs from what `update` writes."""
    _, found = _blocks(doc, kinds)
    return [f"{m.group(2)} {m.group(3)}" for m in found
            if m.group(4) != render(m.group(2), m.group(3), root, kinds)]
