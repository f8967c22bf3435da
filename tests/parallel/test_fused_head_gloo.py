"""fused_token_stats on real gloo groups (TP = 2, 4) against the single-device unfused op.

Every rank builds the same seeded hidden states and padded weight, keeps its vocab slice of the
weight, and compares the replicated stats with `token_stats(hidden @ weight.T)` on one device
(fp64: 1e-12), its slice of grad_W with the slice of the unfused weight gradient, and the
TP-summed grad_h (the column-parallel rule: each rank holds a partial sum) with the unfused
grad_h. Vocab 1001 padded to 1008 (TP = 4: 252 per rank, the last rank has 245 real columns),
plus a vocabulary whose last rank holds only padding (TP = 4: 57 real of 4 x 20 = 80 ids, rank 3
has none) and an empty batch; chunk sizes that divide nothing. One spawn per world size.
"""

import dataclasses

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.parallel.fused_head import fused_token_stats
from tests.support._cases import make_case, op_args
from tests.support._dist import run_gloo

FIELDS = [f.name for f in dataclasses.fields(pdm.TokenStats)
          if f.name not in ("vocab_size", "support_ids")]


def _check(rank, world, seed, n, vocab, padded, k, h=16, hot=None):
    import torch.distributed as dist

    case = make_case(seed, n, vocab, k, padded_vocab=padded, hot_range=hot)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, h, generator=g, dtype=torch.float64)
    wts = torch.linspace(0.5, 1.5, n, dtype=torch.float64)
    vl = padded // world

    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = pdm.token_stats(h_ref @ w_ref.t(), *op_args(case), tp_group=None,
                          vocab_size=vocab, temperature=0.8)
    (ref.logprob * wts).sum().backward()

    h_loc = hidden.clone().requires_grad_()
    w_loc = weight[rank * vl:(rank + 1) * vl].clone().requires_grad_()
    out = fused_token_stats(h_loc, w_loc, *op_args(case), tp_group=dist.group.WORLD,
                            vocab_size=vocab, temperature=0.8, token_chunk=7, vocab_chunk=29)
    (out.logprob * wts).sum().backward()
    for name in FIELDS:
        a, b = getattr(ref, name), getattr(out, name)
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
            continue
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b)), name
        assert torch.allclose(a[fin], b[fin], atol=1e-12, rtol=1e-12), name
    assert torch.allclose(w_loc.grad, w_ref.grad[rank * vl:(rank + 1) * vl], atol=1e-12)
    grad_h = h_loc.grad.clone()
    dist.all_reduce(grad_h)  # the test's own sum of the partial grad_h (not the op's)
    assert torch.allclose(grad_h, h_ref.grad, atol=1e-12)


def _worker(rank, world):
    _check(rank, world, 20, 24, 1001, 1008, 8)
    _check(rank, world, 21, 16, 1001, 1008, 4, hot=(990, 1001))
    _check(rank, world, 22, 12, 57, 80, 3)
    _check(rank, world, 23, 0, 1001, 1008, 4)


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 4])
def test_fused_head_matches_unfused_on_gloo(world):
    run_gloo(_worker, world)
