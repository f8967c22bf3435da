"""token_stats (single device and simulated shards) against the naive fp64 oracle.

Semantic tolerance: fp64 logits 1e-10, fp32 logits 1e-5 relative-ish (atol 2e-6 on probabilities,
1e-5 on logs), bf16 compared with the oracle on the bf16-rounded logits (the op upcasts exactly).
Gradients of log pi_k w.r.t. the logits are compared with autograd through log_softmax.
Simulated shards call the per-shard functions and reduce by hand (max / sum), exactly what the two
all-reduces do, so hypothesis can cover TP splits without processes.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_pdm as pdm
from megatron_pdm.ops.reference import reference_logprob, reference_token_stats
from megatron_pdm.ops.stats import assemble_token_stats, exp_shift, is_sampled_slot, log_sums
from megatron_pdm.parallel.shards import shard_info
from megatron_pdm.parallel.shard_math import (
    GradRows,
    grad_in_storage,
    grad_recomputed,
    mask_columns,
    masked_columns,
    pack_sums,
    restore_columns,
    shard_tail_max,
    shard_tail_sums,
)
from tests.support._cases import make_case, op_args

FIELDS = ("pi_k", "mu_k", "pi_tail", "mu_tail", "q_tail", "p2", "p2_not_k", "pi_max_tail",
          "topk_kl", "topk_tv", "binary_kl", "binary_tv", "log1m_pi_k")


def _compare(stats, ref, atol):
    assert torch.allclose(stats.logprob.double(), ref["logprob"], atol=atol)
    for name in FIELDS:
        assert torch.allclose(getattr(stats, name).double(), ref[name], atol=atol), name
    sl = stats.support_logprobs.double()
    both = torch.isfinite(ref["support_logprobs"])
    assert torch.equal(torch.isfinite(sl), both)
    assert torch.allclose(sl[both], ref["support_logprobs"][both], atol=atol)
    for tail in ("aggregated", "uniform", "exact"):
        assert torch.allclose(stats.divergence_rate("kl", tail).double(),
                              ref[f"kl_rate_{tail}"], atol=atol), tail
        assert torch.allclose(stats.divergence_rate("tv", tail).double(),
                              ref[f"tv_rate_{tail}"], atol=atol), tail
    lo, hi = stats.direction_interval()
    assert torch.allclose(lo.double(), ref["interval_lower"], atol=atol)
    assert torch.allclose(hi.double(), ref["interval_upper"], atol=atol)


def _ref(case, logits=None, temperature=1.0):
    return reference_token_stats(
        case["logits"] if logits is None else logits, *op_args(case),
        vocab_size=case["vocab_size"], temperature=temperature,
    )


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-6)])
@pytest.mark.parametrize("k", [1, 5])
def test_single_device_matches_reference(dtype, atol, k):
    case = make_case(0, 24, 301, k, padded_vocab=304, dtype=dtype)
    logits = case["logits"].clone().requires_grad_()
    stats = pdm.token_stats(logits, *op_args(case), vocab_size=301, temperature=0.7, tp_group=None)
    _compare(stats, _ref(case, temperature=0.7), atol)
    g = torch.randn(24, dtype=torch.float64)
    (stats.logprob.double() * g).sum().backward()
    ref_logits = case["logits"].double().requires_grad_()
    (reference_logprob(ref_logits, case["sampled_ids"], vocab_size=301, temperature=0.7) * g
     ).sum().backward()
    assert logits.grad.dtype == dtype
    assert torch.allclose(logits.grad.double(), ref_logits.grad, atol=atol)
    assert torch.all(logits.grad[:, 301:] == 0)


def test_sampled_inside_and_outside_topk():
    case = make_case(1, 64, 97, 3)
    inside = ~case["support_valid"][:, -1]
    assert inside.any() and (~inside).any()
    stats = pdm.token_stats(case["logits"].double(), *op_args(case), tp_group=None, vocab_size=None)
    _compare(stats, _ref(case), 1e-10)


def test_bf16_logits_upcast_exactly():
    case = make_case(2, 16, 200, 4, dtype=torch.bfloat16)
    logits = case["logits"].clone().requires_grad_()
    stats = pdm.token_stats(logits, *op_args(case), tp_group=None, vocab_size=None)
    assert stats.logprob.dtype == torch.float32
    _compare(stats, _ref(case), 2e-6)
    stats.logprob.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_empty_batch():
    case = make_case(3, 0, 50, 3)
    logits = case["logits"].clone().requires_grad_()
    stats = pdm.token_stats(logits, *op_args(case), tp_group=None, vocab_size=None)
    assert stats.logprob.shape == (0,) and stats.divergence_rate("tv", "exact").shape == (0,)
    stats.logprob.sum().backward()
    assert logits.grad.shape == (0, 50)
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    loss_sum, num, metrics = pdm.policy_loss(stats, torch.zeros(0), torch.zeros(0),
                                             torch.zeros(0, dtype=torch.bool), cfg)
    assert loss_sum.item() == 0 and num.item() == 0 and metrics["loss/pg"].tolist() == [0, 0]


def test_rows_without_support_and_small_chunks():
    case = make_case(4, 10, 120, 2)
    case["support_valid"][3] = False
    for chunk in (7, 1 << 24):  # 7 elements -> one row per chunk
        stats = pdm.token_stats(case["logits"].double(), *op_args(case), chunk_elems=chunk,
                                tp_group=None, vocab_size=None)
        assert not stats.has_support[3]
        assert stats.topk_kl[3] == 0 and stats.divergence_rate()[3] == 0
        ref = reference_logprob(case["logits"], case["sampled_ids"])
        assert torch.allclose(stats.logprob, ref, atol=1e-12)


def _simulated(case, tp, temperature=1.0, chunk=1 << 24, inplace=False):
    """Run the op's per-shard math for every rank and reduce by hand (MAX, then SUM), exactly
    what the two all-reduces do; the shards' logits are restored bit-exactly afterwards, or, with
    `inplace` (fp32/fp64), hold exp(z/T - t) for the in-storage backward."""
    logits = case["logits"]
    vp = logits.shape[1]
    vl = -(-vp // tp)
    if vl * tp != vp:  # pad like Megatron
        logits = torch.cat([logits, torch.zeros(logits.shape[0], vl * tp - vp,
                                                dtype=logits.dtype)], 1)
    sampled, ids, lp, valid = op_args(case)
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    inplace = inplace and logits.dtype == work
    shards = [shard_info(r, tp, vl, case["vocab_size"]) for r in range(tp)]
    parts = [logits[:, r * vl:(r + 1) * vl].clone() for r in range(tp)]
    originals = [p.clone() for p in parts]
    cols = [masked_columns(p, sampled, ids, valid, sh) for p, sh in zip(parts, shards)]
    reals = [p[:, : sh.n_real] for p, sh in zip(parts, shards)]
    for real, c in zip(reals, cols):
        mask_columns(real, c)
    tail_max = torch.stack([shard_tail_max(real, temperature, work) for real in reals]).amax(0)
    shift = exp_shift(tail_max)
    sums = sum(pack_sums(c, shard_tail_sums(real, shift, temperature, chunk, inplace),
                         temperature) for real, c in zip(reals, cols))
    if not inplace:
        for real, c in zip(reals, cols):
            restore_columns(real, c)
        for p, o in zip(parts, originals):
            assert torch.equal(p, o)  # bit-exact restore
    s = ids.shape[1]
    is_k = is_sampled_slot(ids, valid, sampled)
    ls = log_sums(tail_max, sums[:, :s], sums[:, s], sums[:, s + 1], sums[:, s + 2], valid, is_k)
    logprob = ls.sampled_rel - ls.log_z
    stats = assemble_token_stats(
        logprob, ls, support_logprobs_NS=lp, support_valid_NS=valid, support_ids_NS=ids,
        is_sampled_NS=is_k, vocab_size=case["vocab_size"])
    g = torch.ones(logits.shape[0], dtype=work)

    def local_grad(p, c, sh):
        rows = GradRows.of(c, is_k, ls)
        if inplace:
            return grad_in_storage(p, rows, g, shard=sh, temperature=temperature)
        return grad_recomputed(p, rows, g, shard=sh, temperature=temperature, chunk_elems=chunk)

    grad = torch.cat([local_grad(p, c, sh) for p, c, sh in zip(parts, cols, shards)], 1)
    return stats, grad[:, :vp]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 12),
    vocab=st.integers(8, 90),
    pad=st.integers(0, 9),
    k=st.integers(1, 6),
    tp=st.sampled_from([1, 2, 3, 4]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    hot=st.booleans(),
    temperature=st.sampled_from([1.0, 0.6]),
    chunk=st.sampled_from([5, 1 << 24]),
    inplace=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_simulated_shards(n, vocab, pad, k, tp, dtype, hot, temperature, chunk, inplace,
                                   seed):
    k = min(k, vocab - 1)
    case = make_case(seed, n, vocab, k, padded_vocab=vocab + pad, dtype=dtype,
                     hot_range=(0, max(k, vocab // 4)) if hot else None)
    stats, grad = _simulated(case, tp, temperature, chunk, inplace)
    atol = 1e-10 if dtype == torch.float64 else 3e-6
    _compare(stats, _ref(case, temperature=temperature), atol)
    ref_logits = case["logits"].double().requires_grad_()
    reference_logprob(ref_logits, case["sampled_ids"], vocab_size=vocab,
                      temperature=temperature).sum().backward()
    assert torch.allclose(grad.double(), ref_logits.grad, atol=atol if dtype != torch.bfloat16
                          else 1e-2)


def _bad_inputs():
    case = make_case(5, 6, 40, 3)
    return case["logits"], *op_args(case)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a[2].__setitem__((2, 1), 40), r"support_ids: row 2, slot 1: id 40 out of range"),
        (lambda a: a[2].__setitem__((4, 0), -3), r"support_ids: row 4, slot 0: id -3"),
        (lambda a: a[2].__setitem__((1, 1), int(a[2][1, 0])), r"row 1: duplicate valid id"),
        (lambda a: a[3].__setitem__((3, 2), float("nan")), r"row 3, slot 2: non-finite"),
        (lambda a: a[3].__setitem__((5, 0), -1e-6) or a[3].__setitem__((5, 1), -1e-6),
         r"row 5: sum of behavior probabilities"),
        (lambda a: None, None),
    ],
)
def test_bad_support_raises_naming_row(mutate, match):
    args = list(_bad_inputs())
    args = [args[0]] + [t.clone() for t in args[1:]]
    mutate(args)
    if match is None:
        pdm.token_stats(*args, tp_group=None, vocab_size=None)  # control: untouched inputs pass
        return
    with pytest.raises(ValueError, match=match):
        pdm.token_stats(*args, tp_group=None, vocab_size=None)


def test_sampled_missing_from_support_and_shapes_and_vocab():
    logits, k, ids, lp, valid = _bad_inputs()
    k2 = k.clone()
    row = 2
    present = set(ids[row][valid[row]].tolist())
    k2[row] = next(i for i in range(40) if i not in present)
    with pytest.raises(ValueError, match=r"row 2: sampled id .* not a valid support entry"):
        pdm.token_stats(logits, k2, ids, lp, valid, tp_group=None, vocab_size=None)
    with pytest.raises(ValueError, match=r"support_logprobs: expected shape"):
        pdm.token_stats(logits, k, ids, lp[:, :2], valid, tp_group=None, vocab_size=None)
    with pytest.raises(ValueError, match=r"sampled_ids: expected shape"):
        pdm.token_stats(logits, k[:3], ids, lp, valid, tp_group=None, vocab_size=None)
    with pytest.raises(ValueError, match=r"vocab mismatch"):
        pdm.token_stats(logits, k, ids, lp, valid, vocab_size=41, tp_group=None)
    k3 = k.clone()
    k3[4] = 45
    with pytest.raises(ValueError, match=r"sampled_ids: row 4: id 45 out of range"):
        pdm.token_stats(logits, k3, ids, lp, valid, tp_group=None, vocab_size=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_inplace_matches_default_and_reuses_storage(dtype, temperature):
    """inplace=True keeps exp(z/T - m) in the logits for backward (one exp pass): every statistic
    and the gradient equal the default path's, and backward writes into the logits' storage."""
    case = make_case(6, 12, 150, 4, padded_vocab=152, dtype=dtype)
    ref = case["logits"].clone().requires_grad_()
    ref_stats = pdm.token_stats(ref, *op_args(case), tp_group=None, vocab_size=150,
                                temperature=temperature)
    g = torch.linspace(-1.0, 2.0, 12, dtype=ref_stats.logprob.dtype)
    (ref_stats.logprob * g).sum().backward()
    x = case["logits"].clone().requires_grad_()
    stats = pdm.token_stats(x, *op_args(case), vocab_size=150, temperature=temperature,
                            inplace=True, tp_group=None)
    assert not torch.equal(x.detach(), case["logits"])  # the forward worked in the storage
    (stats.logprob * g).sum().backward()
    atol = 1e-12 if dtype == torch.float64 else 2e-6
    for name in ("logprob",) + FIELDS:
        assert torch.allclose(getattr(stats, name), getattr(ref_stats, name), atol=atol), name
    assert torch.allclose(x.grad, ref.grad, atol=atol)
    assert torch.equal(x.grad[:, 150:], torch.zeros_like(x.grad[:, 150:]))  # padding columns
    # The gradient was written into the logits' storage (a leaf's AccumulateGrad then copies it).
    assert torch.equal(x.detach(), x.grad)


def test_inplace_is_ignored_for_bf16():
    case = make_case(7, 8, 100, 3, dtype=torch.bfloat16)
    x = case["logits"].clone()
    pdm.token_stats(x, *op_args(case), vocab_size=100, inplace=True, tp_group=None)
    assert torch.equal(x, case["logits"])

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise_naming_row(bad):
    logits, k, ids, lp, valid = _bad_inputs()
    logits = logits.clone()
    logits[3, 7] = bad
    with pytest.raises(ValueError, match=r"logits: row 3 has non-finite values"):
        pdm.token_stats(logits, k, ids, lp, valid, tp_group=None, vocab_size=None)
    # padding columns (ids >= vocab_size) never enter the softmax, whatever they hold
    padded = torch.cat([logits[:, :0].new_zeros(6, 0), _bad_inputs()[0],
                        torch.full((6, 2), bad)], dim=1)
    stats = pdm.token_stats(padded, k, ids, lp, valid, vocab_size=40, tp_group=None)
    assert torch.isfinite(stats.logprob).all()
