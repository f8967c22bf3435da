"""fused_token_stats against token_stats on the materialised logits hidden @ weight.T.

Exactness (fp64 to round-off, fp32 / bf16 within stated bounds), gradients of the hidden states
and of the weight against autograd of the unfused path, chunkings that do and do not divide the
shapes, padded vocabularies, the collective budget, the argument errors, and the memory claim:
no tensor larger than one logits chunk is allocated, whatever the vocabulary.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_pdm as pdm
from megatron_pdm.parallel.fused_head import fused_token_stats
from tests.support._cases import make_case, op_args

FIELDS = [f.name for f in dataclasses.fields(pdm.TokenStats)
          if f.name not in ("vocab_size", "support_ids")]


def _head_case(seed, n, vocab, k, *, padded=None, h=24, dtype=torch.float64):
    """A support case (tests/support/_cases.py) with hidden states and a weight of the padded
    vocab."""
    case = make_case(seed, n, vocab, k, padded_vocab=padded)
    g = torch.Generator().manual_seed(seed + 100)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    weight = (torch.randn(padded or vocab, h, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    return case, hidden, weight


def _run(fn, hidden, weight):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    stats = fn(h, w)
    (stats.logprob * torch.linspace(0.5, 1.5, stats.logprob.shape[0],
                                    dtype=stats.logprob.dtype)).sum().backward()
    return stats, h.grad, w.grad


def _both(case, hidden, weight, *, temperature=1.0, **chunks):
    args = op_args(case)
    kw = dict(tp_group=None, vocab_size=case["vocab_size"], temperature=temperature)
    ref = _run(lambda h, w: pdm.token_stats(h @ w.t(), *args, **kw), hidden, weight)
    out = _run(lambda h, w: fused_token_stats(h, w, *args, **kw, **chunks), hidden, weight)
    return ref, out


def _assert_close(ref, out, atol, rtol=0.0):
    (rs, rgh, rgw), (fs, fgh, fgw) = ref, out
    for name in FIELDS:
        a, b = getattr(rs, name), getattr(fs, name)
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
            continue
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
        fin = torch.isfinite(a)
        torch.testing.assert_close(b[fin].double(), a[fin].double(), atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(fgh.double(), rgh.double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(fgw.double(), rgw.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("n,vocab,padded,chunks", [
    (37, 100, None, dict(token_chunk=8, vocab_chunk=13)),      # chunks divide nothing
    (37, 100, 104, dict(token_chunk=37, vocab_chunk=100)),     # one chunk, padding skipped
    (16, 97, 128, dict(token_chunk=5, vocab_chunk=32)),        # padding inside the last chunk
    (9, 50, None, dict(token_chunk=1, vocab_chunk=1)),         # degenerate chunks
])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp64_matches_unfused_to_round_off(n, vocab, padded, chunks, temperature):
    case, hidden, weight = _head_case(n + vocab, n, vocab, 4, padded=padded)
    ref, out = _both(case, hidden, weight, temperature=temperature, **chunks)
    _assert_close(ref, out, atol=1e-12, rtol=1e-12)
    if padded:  # padding rows of the weight never enter the softmax: zero gradient
        assert torch.all(out[2][vocab:] == 0)


def test_fp32_within_bound():
    """fp32: the chunked matmul sums in another order than the full one; the stats and the
    gradients agree to 1e-5 (relative 1e-4)."""
    case, hidden, weight = _head_case(3, 64, 500, 8, padded=512, dtype=torch.float32)
    ref, out = _both(case, hidden, weight, token_chunk=16, vocab_chunk=96)
    _assert_close(ref, out, atol=1e-5, rtol=1e-4)


def test_bf16_within_bound():
    """bf16: both paths form bf16 logits (one rounding of each logit, possibly on either side
    for a different summation order) then work in fp32: statistics within 0.05 absolute of the
    unfused op, gradients (fp32-accumulated here, bf16 on the unfused path) within 0.05."""
    case, hidden, weight = _head_case(4, 48, 300, 6, dtype=torch.bfloat16)
    ref, out = _both(case, hidden, weight, token_chunk=16, vocab_chunk=64)
    _assert_close(ref, out, atol=5e-2, rtol=5e-2)


def test_fp64_stats_match_unfused_with_a_dominant_token():
    """A row where the sampled token dominates: log(1 - pi_k) stays exact in both."""
    case, hidden, weight = _head_case(5, 12, 80, 4)
    weight[case["sampled_ids"][0]] = hidden[0] * 4.0
    ref, out = _both(case, hidden, weight, token_chunk=4, vocab_chunk=16)
    _assert_close(ref, out, atol=1e-12, rtol=1e-10)
    assert ref[0].log1m_pi_k[0] < -20


def test_two_collectives_forward_none_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce",
                        lambda t, op=None, group=None, async_op=False: calls.append(
                            (op, tuple(t.shape))))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    case, hidden, weight = _head_case(6, 8, 100, 4)
    h, w = hidden.clone().requires_grad_(), weight[:50].clone().requires_grad_()
    stats = fused_token_stats(h, w, *op_args(case), tp_group=object(), vocab_size=100,
                              token_chunk=3, vocab_chunk=7)
    assert calls == [(dist.ReduceOp.MAX, (8,)), (dist.ReduceOp.SUM, (8, 5 + 3))]
    stats.logprob.sum().backward()
    assert len(calls) == 2, f"extra collectives: {calls[2:]}"
    assert h.grad is not None and w.grad is not None


def test_collectives_commented_in_the_module():
    import pathlib
    path = (pathlib.Path(__file__).resolve().parents[2] / "megatron_pdm" / "parallel"
            / "fused_head.py")
    lines = path.read_text().splitlines()
    calls = [i for i, line in enumerate(lines)
             if "all_reduce(" in line and "import" not in line]
    assert len(calls) == 2
    for i in calls:
        assert lines[i - 1].lstrip().startswith("# Collective"), lines[i - 1]


class _LargestOutput(TorchDispatchMode):
    """Records the numel of every tensor an op returns, except those of the given shapes and
    meta tensors (shape-only stand-ins that allocate nothing)."""

    def __init__(self, skip_shapes):
        super().__init__()
        self.skip = {tuple(s) for s in skip_shapes}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.device.type != "meta"
                    and tuple(t.shape) not in self.skip):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_temporary(fn, n, v, h):
    """Largest tensor allocated by forward + backward that is neither an input-shaped tensor
    nor a gradient ([N, H], [V, H]: those are the op's inputs and outputs)."""
    case = make_case(7, n, 200, 4)
    case["support_ids"] = case["support_ids"] * (v // 200)  # spread the support over V
    case["sampled_ids"] = case["sampled_ids"] * (v // 200)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    args = op_args(case)
    with _LargestOutput([(n, h), (v, h)]) as mode:
        fn(hidden, weight, args, v).logprob.sum().backward()
    assert weight.grad is not None
    return mode.largest


def test_memory_flat_in_vocab():
    """V 8k -> 128k at fixed N: the fused op's largest temporary stays one chunk (so its peak
    extra memory does not grow with V), while the unfused path's grows as N * V."""
    n, h, tc, vc = 64, 8, 32, 1024

    def fused(hid, w, args, v):
        return fused_token_stats(hid, w, *args, tp_group=None, vocab_size=v, token_chunk=tc,
                                 vocab_chunk=vc, validate=False)

    def unfused(hid, w, args, v):
        return pdm.token_stats(hid @ w.t(), *args, tp_group=None, vocab_size=v, validate=False)

    fused_sizes = [_largest_temporary(fused, n, v, h) for v in (8192, 131072)]
    assert fused_sizes[0] == fused_sizes[1] <= tc * vc, fused_sizes
    unfused_sizes = [_largest_temporary(unfused, n, v, h) for v in (8192, 131072)]
    assert unfused_sizes == [n * 8192, n * 131072], unfused_sizes


@pytest.mark.parametrize("bad,match", [
    (lambda h, w: (h[:, :-1], w), "hidden size mismatch"),
    (lambda h, w: (h, w.float()), "dtype mismatch"),
    (lambda h, w: (h[None], w), "hidden_nh: expected"),
    (lambda h, w: (h, w[:10]), "vocab mismatch"),
])
def test_bad_head_arguments_are_named(bad, match):
    case, hidden, weight = _head_case(9, 6, 40, 3)
    h, w = bad(hidden, weight)
    with pytest.raises(ValueError, match=match):
        fused_token_stats(h, w, *op_args(case), tp_group=None, vocab_size=40)


def test_bad_chunk_and_required_keywords():
    case, hidden, weight = _head_case(10, 6, 40, 3)
    with pytest.raises(ValueError, match="vocab_chunk"):
        fused_token_stats(hidden, weight, *op_args(case), tp_group=None, vocab_size=40,
                          vocab_chunk=0)
    with pytest.raises(TypeError):
        fused_token_stats(hidden, weight, *op_args(case), vocab_size=40)


def test_bad_support_is_named_like_the_op():
    case, hidden, weight = _head_case(11, 6, 40, 3)
    case["support_ids"][2, 0] = 41
    with pytest.raises(ValueError, match="row 2"):
        fused_token_stats(hidden, weight, *op_args(case), tp_group=None, vocab_size=40)


def test_non_finite_hidden_is_named():
    case, hidden, weight = _head_case(12, 6, 40, 3)
    hidden[3, 1] = float("nan")
    with pytest.raises(ValueError, match="row 3 has non-finite"):
        fused_token_stats(hidden, weight, *op_args(case), tp_group=None, vocab_size=40)


def test_minus_inf_logits_never_enter_the_sums():
    """-inf logits (a weight row of -inf against positive hidden states): whole vocabulary
    chunks whose tail is -inf (the running max starts at -inf, then grows) give the unfused
    op's statistics (forward; the product's gradient is NaN there for both paths)."""
    case, hidden, weight = _head_case(13, 6, 40, 3)
    hidden = hidden.abs() + 0.1
    used = set(case["support_ids"].flatten().tolist()) | set(case["sampled_ids"].tolist())
    cut = [i for i in range(14) if i not in used]  # the first two chunks of 7 columns
    weight[cut, 0] = -torch.inf
    args, kw = op_args(case), dict(tp_group=None, vocab_size=40)
    logits = hidden @ weight.t()
    assert torch.isinf(logits[:, cut]).all()
    ref = pdm.token_stats(logits, *args, **kw)
    out = fused_token_stats(hidden, weight, *args, **kw, token_chunk=4, vocab_chunk=7)
    for name in FIELDS:
        a, b = getattr(ref, name), getattr(out, name)
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
            fin = torch.isfinite(a)
            torch.testing.assert_close(b[fin], a[fin], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2])
def test_without_validation_no_host_sync(dtype, tp, monkeypatch):
    """validate=False: forward and backward read no tensor data on the host (the detector of
    tests/ops/test_no_host_sync.py, which also sees aten ops inside backward)."""
    from tests.ops.test_no_host_sync import _count_syncs

    group = None
    if tp == 2:
        monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: None)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        group = object()
    case, hidden, weight = _head_case(14, 12, 100, 5, padded=104, dtype=dtype)
    h = hidden.clone().requires_grad_()
    w = (weight[:52] if tp == 2 else weight).clone().requires_grad_()

    def run():
        stats = fused_token_stats(h, w, *op_args(case), tp_group=group, vocab_size=100,
                                  temperature=0.9, validate=False, token_chunk=5, vocab_chunk=17)
        stats.logprob.sum().backward()

    assert _count_syncs(run) == []
    assert _count_syncs(lambda: fused_token_stats(
        h, w, *op_args(case), tp_group=group, vocab_size=100)) != []  # the detector sees them
