"""token_stats on real gloo groups (TP = 2, 4) against the single-device fp64 oracle.

Every rank builds the same seeded global case, keeps its vocab slice of the (padded) logits and
compares the replicated stats and its slice of the logits gradient with the oracle computed on
the full logits. fp32 logits: atol 1e-6 on stats and gradients (the spec's TP-parity bound);
fp64: 1e-12. Cases: vocab 1001 padded to 1008 (TP = 4: 252 per rank, the last rank has 245 real
columns; TP = 2: 504), support spread over shards, support concentrated on one shard, K = 1, and
an empty batch. Spawning costs seconds, so all cases of one world size share one run.
"""

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.ops.reference import reference_logprob, reference_token_stats
from tests.support._cases import make_case, op_args
from tests.support._dist import run_gloo

FIELDS = ("pi_k", "mu_k", "pi_tail", "mu_tail", "q_tail", "p2", "p2_not_k", "pi_max_tail",
          "topk_kl", "topk_tv", "binary_kl", "binary_tv", "log1m_pi_k")


def _check_case(rank, world, case, atol, inplace=False):
    import torch.distributed as dist

    group = dist.group.WORLD
    vp = case["logits"].shape[1]
    vl = vp // world
    local = case["logits"][:, rank * vl:(rank + 1) * vl].clone().requires_grad_()
    stats = pdm.token_stats(local, *op_args(case), tp_group=group,
                            vocab_size=case["vocab_size"], temperature=0.8, inplace=inplace)
    ref = reference_token_stats(case["logits"], *op_args(case), vocab_size=case["vocab_size"],
                                temperature=0.8)
    assert torch.allclose(stats.logprob.double(), ref["logprob"], atol=atol)
    for name in FIELDS:
        assert torch.allclose(getattr(stats, name).double(), ref[name], atol=atol), name
    for tail in ("aggregated", "uniform", "exact"):
        for kind in ("kl", "tv"):
            assert torch.allclose(stats.divergence_rate(kind, tail).double(),
                                  ref[f"{kind}_rate_{tail}"], atol=atol), (kind, tail)
    g = torch.linspace(-1, 1, local.shape[0], dtype=torch.float64)
    (stats.logprob.double() * g).sum().backward()
    full = case["logits"].double().requires_grad_()
    (reference_logprob(full, case["sampled_ids"], vocab_size=case["vocab_size"],
                       temperature=0.8) * g).sum().backward()
    ref_grad = full.grad[:, rank * vl:(rank + 1) * vl]
    assert torch.allclose(local.grad.double(), ref_grad, atol=atol)


def _worker(rank, world):
    torch.manual_seed(0)
    cases = [
        (make_case(10, 32, 1001, 20, padded_vocab=1008), 1e-6),
        (make_case(11, 16, 1001, 1, padded_vocab=1008, dtype=torch.float64), 1e-12),
        (make_case(12, 16, 1001, 8, padded_vocab=1008, hot_range=(990, 1001)), 1e-6),
        (make_case(13, 16, 1001, 8, padded_vocab=1008, hot_range=(0, 40)), 1e-6),
        (make_case(14, 0, 1001, 4, padded_vocab=1008), 1e-6),
    ]
    for i, (case, atol) in enumerate(cases):
        _check_case(rank, world, case, atol)
        # the in-place mode (exp kept in the logits' storage) on every other case
        if i % 2 == 0:
            _check_case(rank, world, case, atol, inplace=True)


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_single_device(world):
    run_gloo(_worker, world)
