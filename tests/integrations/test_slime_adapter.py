"""slime's custom loss (megatron_pdm/integrations/slime/loss.py) on slime-shaped inputs.

slime-shaped: per-sample lists, packed THD logits `[1, T, V_local]` with tail padding, response
rows [end - R - 1, end - 1) per sample. Checked against an independent path (the response rows
gathered per sample, `token_stats` + `policy_loss` on them, and slime's per-sample mean written
out here), at TP 1, and TP 2 (gloo) against TP 1. No slime installed: the inputs follow its
get_responses at context parallelism 1.
"""

from __future__ import annotations

import math
import pathlib
from types import SimpleNamespace

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.integrations.slime import pdm_loss
from tests.support._dist import run_gloo

V, K = 24, 4
TOTALS, RESP, PAD = [7, 5, 9], [3, 2, 5], 3


def _inputs():
    g = torch.Generator().manual_seed(5)
    t = sum(TOTALS) + PAD
    logits = torch.randn(1, t, V, generator=g, dtype=torch.float64) * 2
    tokens, ids, lps, sampled_lp, adv, masks = [], [], [], [], [], []
    end = 0
    for b, (tot, r) in enumerate(zip(TOTALS, RESP)):
        end += tot
        rows = logits[0, end - r - 1:end - 1]
        logmu = torch.log_softmax((rows + 0.3 * torch.randn(rows.shape, generator=g,
                                                             dtype=torch.float64)) / 0.9, -1)
        sampled = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1)
        tokens.append(torch.cat([torch.randint(0, V, (tot - r,), generator=g), sampled]))
        top = logmu.topk(K)
        lp = top.values.float()
        lp[0, -1] = -torch.inf  # an engine list shorter than K on one row
        ids.append(top.indices)
        lps.append(lp)
        sampled_lp.append(logmu.gather(1, sampled[:, None])[:, 0].float())
        adv.append(torch.full((r,), float(b) - 1.0))
        m = torch.ones(r)
        if b == 2:
            m[1] = 0
        masks.append(m)
    batch = dict(total_lengths=TOTALS, response_lengths=RESP, unconcat_tokens=tokens,
                 rollout_log_probs=sampled_lp, pdm_topk_ids=ids, pdm_topk_logprobs=lps,
                 advantages=adv, loss_masks=masks)
    args = SimpleNamespace(rollout_temperature=0.9, pdm_vocab_size=V, pdm_loss="pdm-agg")
    return args, batch, logits


def _sum_of_sample_mean(batch):
    masks = batch["loss_masks"]

    def fn(x):   # slime's per-sample mean over loss tokens, summed over samples
        return sum((xs * m).sum() / m.sum().clamp_min(1)
                   for xs, m in zip(x.split(batch["response_lengths"]), masks))
    return fn


def _reference(args, batch, logits):
    total, end = 0.0, 0
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    for b, (tot, r) in enumerate(zip(TOTALS, RESP)):
        end += tot
        rows = logits[0, end - r - 1:end - 1].clone()     # gathered: a copy, per sample
        sampled = batch["unconcat_tokens"][b][-r:]
        ids, lp, valid, _ = pdm.fold_support_torch(
            batch["pdm_topk_ids"][b], batch["pdm_topk_logprobs"][b],
            torch.isfinite(batch["pdm_topk_logprobs"][b]), sampled, batch["rollout_log_probs"][b])
        st = pdm.token_stats(rows, sampled, ids, lp, valid, tp_group=None, vocab_size=V,
                             temperature=0.9)
        m = batch["loss_masks"][b]
        out = pdm.policy_loss(st, batch["advantages"][b], batch["rollout_log_probs"][b],
                              m.bool(), cfg)
        total = total + out.per_token_loss.sum() / m.sum()
    return total


def test_slime_loss_equals_the_gathered_reference_and_its_gradient():
    args, batch, base = _inputs()
    logits = base.clone().requires_grad_()
    loss, log = pdm_loss(args, batch, logits, _sum_of_sample_mean(batch), tp_group=None)
    ref_logits = base.clone().requires_grad_()
    ref = _reference(args, batch, ref_logits)
    assert torch.allclose(loss, ref, atol=1e-12), (float(loss), float(ref))
    loss.backward()
    ref.backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-12)
    assert set(log) == {"pg_loss", "pdm_masked_frac", "pdm_ratio_mean"}
    assert logits.grad[0, -PAD:].abs().max() == 0     # padding rows carry nothing


def test_slime_loss_names_missing_facts():
    args, batch, logits = _inputs()
    del args.pdm_vocab_size
    with pytest.raises(ValueError, match="pdm_vocab_size"):
        pdm_loss(args, batch, logits, _sum_of_sample_mean(batch), tp_group=None)
    with pytest.raises(ValueError, match=r"\[1, T, V_local\]"):
        pdm_loss(args, batch, logits[0], _sum_of_sample_mean(batch), tp_group=None)


def _tp_worker(rank, world, out_dir):
    args, batch, logits = _inputs()
    vl = V // world
    shard = logits[..., rank * vl:(rank + 1) * vl].clone().requires_grad_()
    loss, _ = pdm_loss(args, batch, shard, _sum_of_sample_mean(batch),
                       tp_group=torch.distributed.group.WORLD)
    loss.backward()
    torch.save((float(loss), shard.grad), pathlib.Path(out_dir) / f"r{rank}.pt")


@pytest.mark.gloo
def test_slime_loss_at_tp2_equals_tp1(tmp_path):
    args, batch, base = _inputs()
    logits = base.clone().requires_grad_()
    loss, _ = pdm_loss(args, batch, logits, _sum_of_sample_mean(batch), tp_group=None)
    loss.backward()
    run_gloo(_tp_worker, 2, str(tmp_path))
    vl = V // 2
    for rank in range(2):
        value, grad = torch.load(tmp_path / f"r{rank}.pt")
        assert math.isclose(value, float(loss.detach()), rel_tol=1e-10)
        assert torch.allclose(grad, logits.grad[..., rank * vl:(rank + 1) * vl], atol=1e-10)
