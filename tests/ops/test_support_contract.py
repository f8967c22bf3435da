"""One support contract, applied once: the engines' parsers, LocalEngine and token_stats share
`megatron_pdm.ops.support`, and the Megatron adapter does not re-check a validated batch.

Each bad support below is fed to all three entry points; all must refuse it with the same rule
(the old code had two implementations that disagreed, e.g. token_stats accepted a positive
log-probability that the parser refused).
"""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.ops import support
from rollout_bridge import RolloutValidationError, parse_generate_response

V = 10


def _body(top_rows, sampled):
    meta = {"finish_reason": {"type": "length"}, "weight_version": "0",
            "output_token_logprobs": [[lp, i, None] for lp, i in sampled],
            "output_top_logprobs": [[[lp, i, None] for lp, i in row] for row in top_rows]}
    return orjson.dumps({"output_ids": [i for _, i in sampled], "meta_info": meta})


GOOD_TOP = [[(-0.5, 1), (-1.5, 2)], [(-0.3, 3), (-2.0, 4)]]
GOOD_SAMPLED = [(-0.5, 1), (-3.0, 7)]

CASES = {
    "positive valid logprob": ([[(0.01, 1), (-1.5, 2)], GOOD_TOP[1]], [(0.01, 1), (-3.0, 7)],
                               "> 0"),
    "duplicate id": ([[(-0.5, 1), (-1.5, 1)], GOOD_TOP[1]], GOOD_SAMPLED, "duplicate valid id"),
    "id out of range": ([GOOD_TOP[0], [(-0.3, 3), (-2.0, 12)]], GOOD_SAMPLED, "out of range"),
    "mass above one": ([[(-0.1, 1), (-1.0, 2)], GOOD_TOP[1]], [(-0.1, 1), (-3.0, 7)],
                       "sum of behavior probabilities"),
}


def _tensors(top_rows, sampled):
    """The folded support of the same data, as token_stats inputs."""
    ids = np.array([[i for _, i in row] for row in top_rows])
    lp = np.array([[x for x, _ in row] for row in top_rows])
    s_ids = np.array([i for _, i in sampled])
    s_lp = np.array([x for x, _ in sampled])
    f_ids, f_lp, f_valid, _ = support.fold_support(ids, lp, np.ones_like(ids, dtype=bool), s_ids,
                                                   s_lp)
    return (torch.from_numpy(s_ids), torch.from_numpy(f_ids), torch.from_numpy(f_lp),
            torch.from_numpy(f_valid))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_entry_point_refuses_the_same_bad_support(name):
    top, sampled, words = CASES[name]
    with pytest.raises(RolloutValidationError, match=words):
        parse_generate_response(_body(top, sampled), top_logprobs=2, vocab_size=V)
    s_ids, f_ids, f_lp, f_valid = _tensors(top, sampled)
    with pytest.raises(ValueError, match=words):
        pdm.token_stats(torch.zeros(2, V), s_ids, f_ids, f_lp, f_valid, vocab_size=V, tp_group=None)
    with pytest.raises(support.SupportError, match=words):
        support.check_support(f_ids.numpy(), f_lp.numpy(), f_valid.numpy(), s_ids.numpy(), V,
                              np.array([x for x, _ in sampled]))


def test_good_support_passes_everywhere():
    (sample,) = parse_generate_response(_body(GOOD_TOP, GOOD_SAMPLED), top_logprobs=2,
                                        vocab_size=V)
    s_ids, f_ids, f_lp, f_valid = _tensors(GOOD_TOP, GOOD_SAMPLED)
    assert torch.equal(sample.support_ids, f_ids) and torch.equal(sample.support_valid, f_valid)
    pdm.token_stats(torch.zeros(2, V), s_ids, f_ids, f_lp, f_valid, vocab_size=V, tp_group=None)


def test_one_tolerance():
    assert support.SUM_MU_TOLERANCE == 1e-4
    ok = math.log(0.5 + 0.5e-4)  # row mass 1 + 0.5e-4 < 1 + tolerance: accepted
    top = [[(-math.log(2), 1), (ok, 2)], GOOD_TOP[1]]
    parse_generate_response(_body(top, [(-math.log(2), 1), (-3.0, 7)]), top_logprobs=2,
                            vocab_size=V)


def test_adapter_does_not_recheck_a_validated_batch(monkeypatch):
    from megatron_pdm.mcore.loss_adapter import make_loss_func
    from rollout_bridge import LocalEngine, pack_padded

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V))
    engine = LocalEngine(model, vocab_size=V, top_logprobs=3, seed=0)
    batch = engine.generate([[1, 2], [3]], {"max_new_tokens": 3}, n=2)
    assert batch.validated and batch.vocab_size == V
    packed = pack_padded(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    calls = []
    real = support.check_support
    monkeypatch.setattr(support, "check_support", lambda *a, **k: calls.append(1) or real(*a, **k))
    import megatron_pdm.ops.validation as validation

    monkeypatch.setattr(validation, "check_support", support.check_support)
    logits = torch.randn(*packed.tokens.shape, V)
    make_loss_func(packed, pdm.PolicyLossConfig.preset("pdm-agg"))(logits)
    assert calls == []
    packed.validated = False
    make_loss_func(packed, pdm.PolicyLossConfig.preset("pdm-agg"))(torch.randn_like(logits))
    assert calls == [1]
