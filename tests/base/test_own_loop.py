"""The own-loop API (megatron_pdm/own_loop.py, docs/own-loop.md) and its example.

fold_support_torch equals the numpy fold element for element; response rows put every field on
the row that scores it; placing does not copy the vocab shard (same storage, and the op on the
view equals the op on a gathered copy); the fast path is chosen exactly where it is safe;
normalisation gives the stated means; the alignment check names sample and position and tells a
temperature mismatch from a one-row shift; the example runs at TP 1 and equals TP 2 (gloo).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.ops.support import SupportError, fold_support
from tests.support._dist import run_gloo

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop" / "forward_step.py"


def _example():
    spec = importlib.util.spec_from_file_location("own_loop_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", range(4))
def test_fold_support_torch_equals_the_numpy_fold(seed):
    rng = np.random.default_rng(seed)
    t, k = 40, 5
    top_ids = np.stack([rng.permutation(30)[:k] for _ in range(t)]).astype(np.int64)
    top_lp = np.sort(rng.normal(-3, 1, (t, k)), axis=1)[:, ::-1].astype(np.float64)
    top_valid = rng.random((t, k)) > (0.3 if seed % 2 else 0.0)
    sampled = np.where(rng.random(t) < 0.5, top_ids[:, 0], rng.integers(0, 30, t))
    sampled_lp = rng.normal(-2, 1, t)
    ref = fold_support(top_ids, top_lp, top_valid, sampled, sampled_lp)
    got = pdm.fold_support_torch(torch.from_numpy(top_ids), torch.from_numpy(top_lp.copy()),
                                 torch.from_numpy(top_valid), torch.from_numpy(sampled),
                                 torch.from_numpy(sampled_lp))
    for r, g in zip(ref[:3], got[:3]):
        assert g.dtype == {np.int32: torch.int32, np.float32: torch.float32,
                           np.bool_: torch.bool}[r.dtype.type]
        np.testing.assert_array_equal(g.numpy(), r)
    assert int(got[3]) == ref[3] and 0 < ref[3] < t


def test_fold_support_torch_refuses_what_the_numpy_fold_refuses():
    ids = torch.tensor([[1, 2]])
    ok = dict(top_lp_TK=torch.zeros(1, 2), top_valid_TK=torch.ones(1, 2, dtype=torch.bool),
              sampled_lp_T=torch.zeros(1))
    with pytest.raises(SupportError, match="support_ids: row 0, slot 1: id 4294967575"):
        pdm.fold_support_torch(torch.tensor([[1, 2 ** 32 + 279]]), sampled_ids_T=torch.tensor([1]),
                               **ok)
    with pytest.raises(SupportError, match="sampled_ids: dtype torch.float32"):
        pdm.fold_support_torch(ids, sampled_ids_T=torch.tensor([1.0]), **ok)


def test_response_rows_padded_and_packed():
    rows = pdm.response_rows([2, 3], [2, 1], seq_len=5)
    # sample 0: tokens at positions 2, 3 scored by rows 1, 2; sample 1 (row offset 5): row 7
    assert rows.index.tolist() == [1, 2, 7] and (rows.lo, rows.hi) == (1, 8)
    assert rows.sample.tolist() == [0, 0, 1] and rows.position.tolist() == [2, 3, 3]
    packed = pdm.response_rows([2, 3], [2, 1], packed=True, seq_len=8)
    assert packed.index.tolist() == [1, 2, 6]
    with pytest.raises(ValueError, match="sample 1: prompt length 0"):
        pdm.response_rows([2, 0], [1, 1], seq_len=5)
    with pytest.raises(ValueError, match="sample 0: prompt 4 \\+ response 2 > seq_len 5"):
        pdm.response_rows([4], [2], seq_len=5)


def _placed(logits_btv, seed=0, temperature=1.0, shift=0, engine_temperature=None):
    """On-policy fields from the logits themselves (behaviour = policy, unless told otherwise)."""
    b, t, v = logits_btv.shape
    rows = pdm.response_rows([2] * b, [t - 2] * b, seq_len=t)
    g = torch.Generator().manual_seed(seed)
    flat = logits_btv.detach().reshape(b * t, v)
    logp = torch.log_softmax(flat[rows.index + shift] / (engine_temperature or temperature), -1)
    sampled = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
    top = logp.topk(3)
    sampled_lp = logp.gather(1, sampled[:, None]).squeeze(1)
    ids, lp, valid, _ = pdm.fold_support_torch(top.indices, top.values,
                                               torch.ones(len(sampled), 3, dtype=torch.bool),
                                               sampled, sampled_lp)
    adv = torch.linspace(-1, 1, len(sampled))
    return pdm.place_on_rows(logits_btv, rows, sampled_ids=sampled, support_ids=ids,
                             support_logprobs=lp, support_valid=valid,
                             behavior_logprob=sampled_lp, advantages=adv)


def test_placing_does_not_copy_the_shard_and_equals_the_gathered_rows():
    base = torch.randn(3, 7, 11, dtype=torch.float64)
    logits = base.clone().requires_grad_()
    placed = _placed(logits)
    assert placed.logits.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    assert placed.logits.data_ptr() == logits.data_ptr() + placed.rows.lo * 11 * 8
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    out = pdm.loss_on_rows(placed, cfg, tp_group=None, vocab_size=None, temperature=1.0,
                           inplace=False)
    out.loss_sum.backward()
    # reference: the response rows gathered (a copy) and the op on them alone
    ref_logits = base.clone().requires_grad_()
    rows = placed.rows
    at = rows.index - rows.lo
    gathered = ref_logits.reshape(-1, 11)[rows.index]
    st = pdm.token_stats(gathered, placed.sampled_ids[at], placed.support_ids[at],
                         placed.support_logprobs[at], placed.support_valid[at], tp_group=None,
                         vocab_size=None)
    ref = pdm.policy_loss(st, placed.advantages[at], placed.behavior_logprob[at],
                          torch.ones(len(at), dtype=torch.bool), cfg)
    ref.loss_sum.backward()
    assert torch.allclose(out.loss_sum, ref.loss_sum, atol=1e-12)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-12)
    assert int(out.num_tokens) == len(at)


def test_fast_path_default_only_where_safe():
    cfg = pdm.PolicyLossConfig.preset("grpo")
    weight = torch.randn(11, 5, requires_grad=True)
    hidden = torch.randn(2, 6, 5)
    results = {}
    for mode in (None, False):
        logits = hidden @ weight.T                    # the model's output: not a leaf, fp32
        before = logits.detach().clone()
        placed = _placed(logits)
        assert pdm.auto_inplace(placed.logits)
        out = pdm.loss_on_rows(placed, cfg, tp_group=None, vocab_size=None, temperature=1.0,
                               inplace=mode)
        weight.grad = None
        out.loss_sum.backward()
        results[mode] = (float(out.loss_sum.detach()), weight.grad.clone(),
                         torch.equal(logits.detach(), before))
    assert results[None][2] is False and results[False][2] is True   # auto worked in place
    assert math.isclose(results[None][0], results[False][0], rel_tol=1e-6)
    assert torch.allclose(results[None][1], results[False][1], atol=1e-6)
    leaf = torch.randn(2, 6, 11, requires_grad=True)
    assert not pdm.auto_inplace(leaf)                                  # autograd forbids it
    assert not pdm.auto_inplace(torch.randn(2, 6, 11))                 # no grad: evaluation
    assert not pdm.auto_inplace((hidden @ weight.T).bfloat16())        # bf16 works on a copy
    no_grad = torch.randn(2, 6, 11)
    before = no_grad.clone()
    pdm.loss_on_rows(_placed(no_grad), cfg, tp_group=None, vocab_size=None, temperature=1.0)
    assert torch.equal(no_grad, before)


def test_normalize_loss_contract():
    loss_sum = torch.tensor(6.0)
    lm = torch.tensor([True, True, False, True, True, False])
    seq = torch.tensor([0, 0, 0, 1, 2, -1])
    assert pdm.normalize_loss(loss_sum, lm, "sum") is loss_sum
    assert float(pdm.normalize_loss(loss_sum, lm, "token-mean")) == 6.0 / 4
    assert float(pdm.normalize_loss(loss_sum, lm, "sequence-mean", seq_ids=seq)) == 6.0 / 3
    assert float(pdm.normalize_loss(loss_sum, torch.zeros(6, dtype=torch.bool),
                                    "token-mean")) == 0.0
    with pytest.raises(ValueError, match="needs seq_ids"):
        pdm.normalize_loss(loss_sum, lm, "sequence-mean")
    with pytest.raises(ValueError, match="'sum', 'token-mean' or 'sequence-mean'"):
        pdm.normalize_loss(loss_sum, lm, "mean")


def test_alignment_check_names_sample_position_and_cause():
    logits = torch.randn(3, 8, 13, dtype=torch.float64) * 2
    kw = dict(tp_group=None, vocab_size=None)
    assert pdm.check_logprob_alignment(_placed(logits, temperature=0.7), temperature=0.7,
                                       **kw) < 1e-6
    # the engine sampled at T = 1 but the loop says 0.7
    bad_t = _placed(logits, temperature=0.7, engine_temperature=1.0)
    with pytest.raises(ValueError, match=r"sample \d, position \d.*temperature 1.0, not 0.7"):
        pdm.check_logprob_alignment(bad_t, temperature=0.7, **kw)
    # behaviour fields computed from row p + 1 (the shift missing)
    with pytest.raises(ValueError, match=r"sample \d, position \d.*the shift is missing"):
        pdm.check_logprob_alignment(_placed(logits, shift=1), temperature=1.0, **kw)
    with pytest.raises(ValueError, match="temperature mismatch"):
        pdm.loss_on_rows(bad_t, pdm.PolicyLossConfig.preset("pdm-agg"), temperature=0.7,
                         check_alignment=True, **kw)


def test_reduce_metrics_is_exported_from_its_one_home():
    from megatron_pdm import metrics as M

    assert pdm.reduce_metrics is M.reduce_metrics
    assert pdm.reduce_metrics([{"a": torch.tensor([1.0, 2.0])}, {"a": torch.tensor([2.0, 1.0])}]
                              ) == {"a": 1.0}


def _tp_worker(rank, world, out_dir):
    example = _example()
    rows = example.run(steps=2, tp_group=torch.distributed.group.WORLD)
    if rank == 0:
        torch.save(rows, pathlib.Path(out_dir) / "tp2.pt")


@pytest.mark.gloo
def test_example_runs_and_tp2_equals_tp1(tmp_path):
    example = _example()
    tp1 = example.run(steps=2)
    assert all(math.isfinite(r["loss"]) for r in tp1)
    run_gloo(_tp_worker, 2, str(tmp_path))
    tp2 = torch.load(tmp_path / "tp2.pt")
    for a, b in zip(tp1, tp2):
        for key in ("loss", "pdm/ratio_mean", "pdm/topk_kl_mean", "loss/pg"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), key


def _normalize_worker(rank, world, out_dir):
    # rank 0 has 3 loss rows, rank 1 has 1: the global token count is 4
    lm = torch.tensor([True, True, True]) if rank == 0 else torch.tensor([True, False, False])
    loss_sum = torch.tensor(2.0 + rank)
    group = torch.distributed.group.WORLD
    averaged = pdm.normalize_loss(loss_sum, lm, "token-mean", group=group)
    summed = pdm.normalize_loss(loss_sum, lm, "token-mean", group=group, grads_averaged=False)
    torch.save((float(averaged), float(summed)), pathlib.Path(out_dir) / f"r{rank}.pt")


@pytest.mark.gloo
def test_normalize_loss_counts_over_the_data_parallel_group(tmp_path):
    run_gloo(_normalize_worker, 2, str(tmp_path))
    for rank in range(2):
        averaged, summed = torch.load(tmp_path / f"r{rank}.pt")
        # DDP averages: (L0 + L1) / 2 = (2 + 3) / 4 needs L_r = loss_sum_r * 2 / 4
        assert averaged == (2.0 + rank) * 2 / 4 and summed == (2.0 + rank) / 4
