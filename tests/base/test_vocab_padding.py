"""One rounding rule (megatron_pdm/intmath.py), one vocabulary padding / shard-width rule
(megatron_pdm/arch.py), and the docs/op.md shard-width table is that rule's output."""

from __future__ import annotations

import pathlib
import re

import pytest

from megatron_pdm.arch import ModelArch, padded_vocab_size, vocab_shard_width
from megatron_pdm.intmath import ceil_div, round_up

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("x,m,want", [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (7, 1, 7),
                                      (151936, 512, 152064)])
def test_round_up(x, m, want):
    assert round_up(x, m) == want
    assert ceil_div(x, m) * m == want


def test_ceil_div_refuses_a_zero_divisor():
    with pytest.raises(ValueError, match="divisor"):
        ceil_div(3, 0)


def test_qwen3_shard_widths():
    # 151,936 = 128 * 1187: at TP 2 and TP 4 megatron pads it to 152,064 (a multiple of 256, 512)
    assert padded_vocab_size(151936, 128, 1) == 151936
    assert padded_vocab_size(151936, 128, 4) == 152064
    assert vocab_shard_width(151936, 128, 2) == 76032
    assert vocab_shard_width(151936, 128, 4) == 38016
    arch = ModelArch(vocab_size=151936)
    assert arch.padded_vocab(4) // 4 == vocab_shard_width(151936, arch.make_vocab_size_divisible_by, 4)


def _docs_table() -> list[tuple[int, list[int]]]:
    text = (ROOT / "docs" / "op.md").read_text()
    start = text.index("<!-- shard-widths:")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not re.fullmatch(r"[\d,]+", cells[1]):
            continue  # header and separator
        rows.append((int(cells[1].replace(",", "")), [int(c.replace(",", "")) for c in cells[2:]]))
    return rows


def test_docs_shard_width_table_is_the_rule():
    rows = _docs_table()
    assert len(rows) >= 2
    for vocab, widths in rows:
        assert widths == [vocab_shard_width(vocab, 128, tp) for tp in (1, 2, 4, 8)], vocab


def test_gpu_check_takes_the_tp4_width_from_the_rule():
    text = (ROOT / "benchmarks" / "gpu_check.py").read_text()
    assert "V_TP4_SHARD = vocab_shard_width(V_QWEN3, 128, 4)" in text
