"""Packing: the t-1 -> t shift, padded vs THD equivalence, non-loss rows and seq_ids."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_lm import prompts

from rollout_bridge import LocalEngine, group_advantages, pack_padded, pack_thd


@pytest.fixture
def batch(tiny_model):
    eng = LocalEngine(tiny_model, vocab_size=50, top_logprobs=3, seed=0, eos_token_id=3)
    b = eng.generate(prompts(3), {"max_new_tokens": 6}, n=2)
    b.set_rewards([float(i % 3) for i in range(len(b))])
    b.samples[1].loss_mask[0] = False  # a masked response token
    return b


def _check_sample(pk, row, off, s, seq_id, adv):
    p, t = s.prompt_ids.shape[0], s.num_tokens
    length = p + t
    seg = slice(off, off + length)
    tokens = torch.cat([s.prompt_ids, s.response_ids])
    assert torch.equal(pk.tokens[row, seg], tokens)
    assert torch.equal(pk.position_ids[row, seg], torch.arange(length))
    assert torch.equal(pk.labels[row, off:off + length - 1], tokens[1:])
    assert (pk.seq_ids[row, seg] == seq_id).all()
    for q in range(length):
        r = off + q
        ti = q - (p - 1)                       # response token scored by row q
        if 0 <= ti < t and bool(s.loss_mask[ti]):
            assert pk.loss_mask[row, r]
            assert pk.labels[row, r] == s.response_ids[ti]
            assert pk.behavior_logprob[row, r] == s.behavior_logprob[ti]
            assert torch.equal(pk.support_ids[row, r], s.support_ids[ti])
            assert torch.equal(pk.support_valid[row, r], s.support_valid[ti])
            assert pk.advantages[row, r] == pytest.approx(adv)
            # the label is a valid support entry on every loss row
            hit = (pk.support_ids[row, r].long() == pk.labels[row, r]) & pk.support_valid[row, r]
            assert hit.sum() == 1
        else:
            assert not pk.loss_mask[row, r]
            assert not pk.support_valid[row, r].any()
            assert (pk.support_logprobs[row, r] == -math.inf).all()
            assert pk.behavior_logprob[row, r] == 0 and pk.advantages[row, r] == 0
    assert not pk.loss_mask[row, off + length - 1]  # last row of a sample never has a loss


def test_padded_layout(batch):
    adv = group_advantages(batch)
    pk = pack_padded(batch, adv, pad_to_multiple_of=8)
    assert pk.tokens.shape[1] % 8 == 0 and pk.cu_seqlens is None
    assert pk.support_ids.dtype == torch.int32 and pk.support_ids.shape[-1] == 4
    for i, s in enumerate(batch.samples):
        _check_sample(pk, i, 0, s, i, float(adv[i]))
        length = s.prompt_ids.shape[0] + s.num_tokens
        assert (pk.seq_ids[i, length:] == -1).all() and not pk.loss_mask[i, length:].any()
    assert pk.loss_mask.sum() == sum(int(s.loss_mask.sum()) for s in batch.samples)
    assert pk.weight_version == batch.weight_version and pk.temperature == batch.temperature


def test_thd_layout(batch):
    adv = group_advantages(batch)
    pk = pack_thd(batch, adv, pad_to_multiple_of=4)
    assert pk.tokens.shape[0] == 1 and pk.cu_seqlens.dtype == torch.int32
    assert (torch.diff(pk.cu_seqlens) % 4 == 0).all()
    for i, s in enumerate(batch.samples):
        _check_sample(pk, 0, int(pk.cu_seqlens[i]), s, i, float(adv[i]))
    pad = pack_padded(batch, adv)
    assert torch.equal(pk.flat()["loss_mask"].sum(), pad.flat()["loss_mask"].sum())
    sel_t, sel_p = pk.flat()["loss_mask"], pad.flat()["loss_mask"]
    for name in ("labels", "behavior_logprob", "support_ids", "advantages", "seq_ids"):
        assert torch.equal(pk.flat()[name][sel_t], pad.flat()[name][sel_p]), name


def test_group_advantages(batch):
    adv = group_advantages(batch)
    groups = torch.tensor([s.group_index for s in batch.samples])
    for g in groups.unique():
        assert adv[groups == g].sum().abs() < 1e-6
    with pytest.raises(ValueError):
        pack_padded(batch, adv[:-1])


def test_sampled_entropy_counts_loss_tokens_only(batch):
    from rollout_bridge.core.types import sampled_entropy

    lp_T = torch.cat([s.behavior_logprob[s.loss_mask] for s in batch.samples]).double()
    assert sampled_entropy(batch) == pytest.approx(float(-lp_T.mean()), rel=1e-12)
    s1 = batch.samples[1]
    assert not s1.loss_mask[0]
    s1.behavior_logprob[0] = -1e6  # a non-loss token: no effect
    assert sampled_entropy(batch) == pytest.approx(float(-lp_T.mean()), rel=1e-12)


def test_frac_solved_groups():
    from rollout_bridge.core.types import frac_solved_groups

    assert frac_solved_groups([0, 0, 1, 0, 0, 0], 2) == pytest.approx(1 / 3)
    assert frac_solved_groups([0.5, 0, 0, 1], 2) == 1.0
    assert frac_solved_groups([], 4) == 0.0
