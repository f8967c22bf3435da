"""benchmarks/op_matrix.py: the cells come from megatron's padding rule, and docs/op.md's
op-matrix block is what `python benchmarks/op_matrix.py docs` writes from the committed file."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

from megatron_pdm.arch import vocab_shard_width

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("op_matrix", ROOT / "benchmarks" /
                                                  "op_matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["op_matrix"] = module
    spec.loader.exec_module(module)
    return module


def test_the_cells_are_the_padded_shards_bf16_first():
    om = _load()
    cells = om.cells()
    assert len(cells) == 2 * 2 * 5 * 2
    assert [c["dtype"] for c in cells[:20]] == ["bf16"] * 20
    widths = {(c["vocab"], c["tp"]): c["vocab_local"] for c in cells}
    assert widths == {("real", 1): 49152, ("real", 3): 16384, ("qwen3", 2): 76032,
                      ("qwen3", 4): 38016, ("qwen3", 8): 19072}
    for (vocab, tp), width in widths.items():
        assert width == vocab_shard_width(om.VOCABS[vocab], 128, tp)
    assert {c["tokens"] for c in cells} == {2048, 8192} and {c["threads"] for c in cells} == {1, 2}


def test_the_docs_block_is_what_the_command_writes_from_the_committed_file():
    om = _load()
    text = (ROOT / om.DOC).read_text()
    blocks = om.BLOCK.findall(text)
    assert blocks, "docs/op.md has no op-matrix block"
    for _, path, _, _ in blocks:
        assert path.startswith("results/op_matrix/") and (ROOT / path).is_file(), path
    assert om.check_doc(str(ROOT / om.DOC), str(ROOT)) == []


def _rows(op_mem: float) -> list[dict]:
    common = dict(dtype="bf16", tokens=2048, vocab_local=16384, tp=3, threads=1, reps=5,
                  vocab_name="real", cpu_model="test cpu", load_before=1.0, load_after=2.0,
                  finished_utc="2026-12-06T16:00:00+00:00")
    return [dict(common, variant="ce", median_s=0.5, vs_ce=1.0, vs_ce_paired=1.0,
                 vs_ce_paired_cpu=1.0, extra_peak_mib=200.0, mem_vs_ce=1.0),
            dict(common, variant="op_inplace", median_s=0.4, vs_ce=0.8, vs_ce_paired=0.75,
                 vs_ce_paired_cpu=0.7, extra_peak_mib=op_mem, mem_vs_ce=op_mem / 200.0)]


def test_a_changed_number_is_caught_and_rewritten(tmp_path):
    om = _load()
    data = tmp_path / "results" / "op_matrix" / "cpu.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(50.0)))
    doc = tmp_path / "op.md"
    doc.write_text("before\n<!-- op-matrix results/op_matrix/cpu.jsonl -->\n"
                   "stale\n<!-- /op-matrix -->\nafter\n")
    assert om.check_doc(str(doc), str(tmp_path)) == ["results/op_matrix/cpu.jsonl"]
    doc.write_text(om.render(doc.read_text(), str(tmp_path)))
    assert om.check_doc(str(doc), str(tmp_path)) == []
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("<!-- /op-matrix -->\nafter\n")
    line = next(x for x in text.splitlines() if x.startswith("| bf16"))
    assert "| **0.75x** | 0.70x | 0.80x | 200 / 50 | 0.25x | 5 | 1.0-2.0 | test cpu |" in line
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(60.0)))
    assert om.check_doc(str(doc), str(tmp_path)) == ["results/op_matrix/cpu.jsonl"]


def test_a_cell_without_memory_shows_a_dash():
    om = _load()
    rows = _rows(math.nan)
    rows[0]["extra_peak_mib"] = math.nan
    rows[1]["mem_vs_ce"] = math.nan
    del rows[1]["vs_ce_paired_cpu"]  # rows measured before the CPU time was recorded
    line = om.table(rows).splitlines()[2]
    assert "| **0.75x** | - | 0.80x | - | - |" in line
