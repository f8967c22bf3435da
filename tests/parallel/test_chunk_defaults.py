"""The op's default row chunks (parallel/shard_math.py `default_chunk_elems`): cache-sized on a
one-thread CPU, below the mmap threshold on a multi-threaded one, wide on an accelerator, and the chunking never changes a bit of the result (every row's
reductions happen inside one chunk)."""

from __future__ import annotations

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.parallel.shard_math import (
    CPU_CHUNK_ELEMS,
    CPU_THREADS_CHUNK_ELEMS,
    WIDE_CHUNK_ELEMS,
    default_chunk_elems,
)
from tests.support._cases import make_case, op_args
from tests.ops.test_token_stats import FIELDS


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_defaults(one_thread):
    assert default_chunk_elems(torch.device("cpu")) == CPU_CHUNK_ELEMS == 1 << 20
    assert default_chunk_elems("cpu", in_storage=True) == CPU_CHUNK_ELEMS
    assert default_chunk_elems("meta") == WIDE_CHUNK_ELEMS == 1 << 24
    assert default_chunk_elems("meta", in_storage=True) >= 1 << 62


def test_16_mib_chunks_with_several_cpu_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert default_chunk_elems("cpu") == CPU_THREADS_CHUNK_ELEMS == 1 << 22
        assert default_chunk_elems("cpu", in_storage=True) == CPU_THREADS_CHUNK_ELEMS
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads,rows", [(1, 40), (2, 160)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inplace", [False, True])
def test_default_chunks_give_the_unchunked_bits(dtype, inplace, threads, rows):
    # rows x 60,000 columns: at 1 thread 40 rows are three 2^20-element chunks of 17 rows, at 2
    # threads 160 rows are three 2^22-element chunks of 69 rows
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_case(11, rows, 60000, 5, dtype=dtype)
        out = {}
        for name, chunk in (("default", None), ("one chunk", 1 << 62)):
            x = case["logits"].clone().requires_grad_()
            y = x * 1  # a non-leaf, as inside megatron (the in-place path consumes it)
            stats = pdm.token_stats(y, *op_args(case), tp_group=None, vocab_size=None,
                                    chunk_elems=chunk, inplace=inplace)
            (grad,) = torch.autograd.grad(stats.logprob.sum(), y)
            out[name] = (stats, grad)
    finally:
        torch.set_num_threads(before)
    (a, ga), (b, gb) = out["default"], out["one chunk"]
    for name in ("logprob",) + FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(ga, gb)
