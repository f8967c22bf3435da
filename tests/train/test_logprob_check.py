"""train/logprob_check.py: engine-vs-policy log-prob agreement on packed rows."""

from __future__ import annotations

import pytest
import torch

from megatron_pdm.train.logprob_check import LogprobAgreement
from rollout_bridge.core.packing import pack_padded
from rollout_bridge.core.types import RolloutBatch, RolloutSample

V, K, T = 20, 4, 0.7


def _batch_from_logits(logits_lv: torch.Tensor, prompt_len: int) -> RolloutBatch:
    """One sample whose engine log-probs are exactly log_softmax(logits / T) of its rows; the
    sampled token is each row's top-1 (so slot K is unused)."""
    length = logits_lv.shape[0]
    rows = range(prompt_len - 1, length - 1)
    lp_tv = torch.log_softmax(logits_lv[list(rows)].double() / T, dim=-1).float()
    top_lp, top_ids = lp_tv.topk(K, dim=-1)
    support_ids = torch.cat([top_ids, torch.zeros(len(rows), 1, dtype=torch.long)], 1)
    support_lp = torch.cat([top_lp, torch.full((len(rows), 1), float("-inf"))], 1)
    valid = torch.ones(len(rows), K + 1, dtype=torch.bool)
    valid[:, K] = False
    sample = RolloutSample(prompt_ids=torch.arange(1, prompt_len + 1),
                           response_ids=top_ids[:, 0].clone(), behavior_logprob=top_lp[:, 0],
                           support_ids=support_ids.int(), support_logprobs=support_lp,
                           support_valid=valid, finish_reason="stop")
    return RolloutBatch(samples=[sample], temperature=T, weight_version="0", top_logprobs=K,
                        n=1, num_prompts=1, vocab_size=V)


def test_agreement_exact_and_perturbed():
    torch.manual_seed(0)
    prompt_len, length = 3, 8
    logits_lv = torch.randn(length, V) * 3
    batch = _batch_from_logits(logits_lv, prompt_len)
    packed = pack_padded(batch, None)
    padded_bsv = torch.cat([logits_lv, torch.full((length, 12), 50.0)], -1)[None]  # vocab pad
    check = LogprobAgreement(K, V, T)
    check.add(padded_bsv, packed)
    rep = check.report()
    assert rep["tokens"] == length - prompt_len and rep["support_slots"] == K * rep["tokens"]
    assert rep["max_abs_err_sampled"] < 1e-5 and rep["max_abs_err_support"] < 1e-5
    assert rep["topk_set_agreement"] == 1.0
    # one engine support entry off by 0.25: seen in the support error, not in the sampled one
    batch.samples[0].support_logprobs[2, 3] += 0.25
    check = LogprobAgreement(K, V, T)
    check.add(padded_bsv, pack_padded(batch, None))
    rep = check.report()
    assert rep["max_abs_err_support"] == pytest.approx(0.25, abs=1e-5)
    assert rep["max_abs_err_sampled"] < 1e-5
    # a policy whose top-K differs at one row
    other_bsv = padded_bsv.clone()
    row = prompt_len - 1
    other_bsv[0, row, int(packed.support_ids[0, row, 0])] = -100.0
    check = LogprobAgreement(K, V, T)
    check.add(other_bsv, packed)
    assert check.report()["topk_set_agreement"] == pytest.approx(1 - 1 / (length - prompt_len))


def test_agreement_refuses_mismatched_rows():
    batch = _batch_from_logits(torch.randn(6, V), 2)
    check = LogprobAgreement(K, V, T)
    with pytest.raises(ValueError, match="do not cover"):
        check.add(torch.randn(1, 5, V), pack_padded(batch, None))
    with pytest.raises(ValueError, match="no loss tokens"):
        check.report()
