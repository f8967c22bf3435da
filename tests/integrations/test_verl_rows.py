"""The verl adapter's tensor logic without verl (megatron_pdm/integrations/verl_rows.py): the
vLLM top-K conversion, the processor's weights against the project's policy_loss, TP 2 over
gloo against TP 1 on the gathered logits, bad input, and the ImportError without verl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.integrations import verl_rows

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from _dist import run_gloo  # noqa: E402


def _lp(value, rank):
    return SimpleNamespace(logprob=value, rank=rank, decoded_token=None)


def test_vllm_conversion_folds_the_sampled_token():
    # position 0: sampled token 7 inside the top-2; position 1: sampled 9 outside (rank 40)
    logprobs = [{7: _lp(-0.1, 1), 3: _lp(-2.5, 2)},
                {4: _lp(-0.3, 1), 5: _lp(-1.5, 2), 9: _lp(-6.0, 40)}]
    ids, lp = verl_rows.support_from_vllm_logprobs(logprobs, [7, 9], k=2)
    assert ids.shape == lp.shape == (2, 3) and ids.dtype == torch.int64
    assert ids[0, :2].tolist() == [7, 3] and lp[0, :2].tolist() == pytest.approx([-0.1, -2.5])
    assert lp[0, 2] == -torch.inf  # sampled inside the top-K: the extra slot unused
    assert ids[1].tolist() == [4, 5, 9] and lp[1].tolist() == pytest.approx([-0.3, -1.5, -6.0])
    full_ids, full_lp = verl_rows.full_sequence_support(3, ids, lp)
    assert full_ids.shape == (5, 3) and bool((full_lp[:3] == -torch.inf).all())
    assert torch.equal(full_ids[3:], ids)


@pytest.mark.parametrize("logprobs, tokens, needle", [
    ([{1: _lp(-0.1, 1)}], [2], "logprobs[0]: the sampled token 2"),
    ([{1: _lp(-0.1, 1)}, {1: _lp(-0.1, 1)}], [1], "2 positions, token_ids 1"),
    ([{1: _lp(float("nan"), 1)}], [1], "logprobs[0][1]: logprob is NaN"),
    ([{1: _lp(-0.1, 1), 2: _lp(-0.2, 1)}], [1], "rank 1 appears twice"),
])
def test_vllm_conversion_names_bad_input(logprobs, tokens, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        verl_rows.support_from_vllm_logprobs(logprobs, tokens, k=1)


def _rows(seed=0, b=2, t=9, v=16, k=3, noise=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    behav = torch.log_softmax(logits + noise * torch.randn(b, t, v, generator=g,
                                                           dtype=torch.float64), -1)
    behav = behav.float().double()
    label = torch.multinomial(behav.exp().reshape(-1, v), 1, generator=g).reshape(b, t)
    top = behav.topk(k, -1)
    ids, lp, valid, _ = pdm.fold_support_torch(
        top.indices.reshape(-1, k), top.values.reshape(-1, k), torch.ones(b * t, k, dtype=bool),
        label.reshape(-1), behav.gather(-1, label[..., None]).reshape(-1))
    lp = torch.where(valid, lp, -torch.inf)
    ids, lp = ids.long().reshape(b, t, -1), lp.double().reshape(b, t, -1)
    lp[0, 0] = -torch.inf  # a prompt-like row: no support, weight 0
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    return logits, label, ids, lp, adv, behav.gather(-1, label[..., None])[..., 0]


@pytest.mark.parametrize("name", ["pdm-agg", "pdm-tv", "grpo", "dppo-binary-kl", "drpo"])
def test_weights_give_the_project_loss(name):
    logits, label, ids, lp, adv, behav = _rows()
    cfg = pdm.PolicyLossConfig.preset(name)
    f = verl_rows.pdm_token_fields(logits, label, ids, lp, cfg, tp_group=None, vocab_size=None)
    assert set(f) == set(verl_rows.FIELD_KEYS)
    assert f["pdm_has_support"][0, 0] == 0 and f["pdm_weight_pos"][0, 0] == 0
    w = verl_rows.select_weight(adv, f["pdm_weight_pos"], f["pdm_weight_neg"])
    b, t, v = logits.shape
    has = f["pdm_has_support"].bool()
    stats = pdm.token_stats(logits.reshape(-1, v), label.reshape(-1), ids.reshape(b * t, -1).int(),
                            lp.reshape(b * t, -1).float(), torch.isfinite(lp).reshape(b * t, -1),
                            tp_group=None, vocab_size=None)
    out = pdm.policy_loss(stats, adv.reshape(-1), behav.reshape(-1), has.reshape(-1), cfg)
    assert torch.allclose((adv * w).reshape(-1), out.coeff, rtol=1e-9, atol=1e-12)
    moving = has & (adv != 0)
    if cfg.shaping == "mask":  # the trust region drops some tokens and keeps others
        assert 0 < int((moving & (w == 0)).sum()) < int(moving.sum())


def _tp_worker(rank, world, name):
    logits, label, ids, lp, _, _ = _rows(seed=4, v=16)
    cfg = pdm.PolicyLossConfig.preset(name)
    want = verl_rows.pdm_token_fields(logits, label, ids, lp, cfg, tp_group=None,
                                      vocab_size=None)
    shard = logits.chunk(world, -1)[rank].contiguous()
    group = torch.distributed.group.WORLD
    got = verl_rows.pdm_token_fields(shard, label, ids, lp, cfg, tp_group=group, vocab_size=16)
    for key in verl_rows.FIELD_KEYS:
        assert torch.allclose(got[key], want[key], rtol=1e-9, atol=1e-12), (rank, key)


@pytest.mark.gloo
@pytest.mark.slow
def test_tp2_equals_the_op_on_gathered_logits():
    run_gloo(_tp_worker, 2, "pdm-agg")


def test_bad_rows_name_the_key():
    logits, label, ids, lp, adv, _ = _rows()
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    call = lambda **kw: verl_rows.pdm_token_fields(  # noqa: E731
        kw.get("logits", logits), kw.get("label", label), kw.get("ids", ids), kw.get("lp", lp),
        kw.get("cfg", cfg), tp_group=None, vocab_size=None)
    with pytest.raises(ValueError, match="pdm_topk_ids"):
        call(ids=ids[:, :-1])
    with pytest.raises(ValueError, match="pdm_topk_logprobs"):
        call(lp=lp[:, :, :-1])
    with pytest.raises(ValueError, match="label"):
        call(label=label[:, :-1])
    with pytest.raises(ValueError, match="pdm_topk_ids: integer"):
        call(ids=ids.double())
    with pytest.raises(ValueError, match="sequence-level"):
        call(cfg=pdm.PolicyLossConfig.preset("pdm-agg", is_level="sequence"))
    with pytest.raises(ValueError, match="pdm_weight_neg"):
        verl_rows.select_weight(adv, adv, adv[:, :-1])


def test_import_without_verl_names_version_and_extra():
    code = ("import sys; sys.modules['verl'] = None\n"
            "import importlib.metadata as md\n"
            "real = md.version\n"
            "md.version = lambda n: (_ for _ in ()).throw(md.PackageNotFoundError(n)) "
            "if n == 'verl' else real(n)\n"
            "import megatron_pdm.integrations.verl\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "needs verl 0.9.x" in proc.stderr and "megatron-pdm[verl]" in proc.stderr
