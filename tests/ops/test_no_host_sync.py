"""No device -> host synchronisation in the hot path.

On a GPU an op whose output size or Python value depends on tensor data (`nonzero`, `.item()`,
`bool(t)`, boolean-mask indexing, `unique`, ...) stalls the pipeline until the device has caught
up; on the CPU it costs nothing, so this test is the only guard. A TorchDispatchMode sees every
aten op that runs (also inside autograd's backward) and records the ones that need the host to
read device data; host conversions that do not dispatch on CPU tensors (`.numpy()`, `.tolist()`,
`.cpu()`) are recorded by wrapping those methods for the duration of the run.

Checked: `token_stats(validate=False)` forward and backward (fp32 and bf16, default and in-place,
a single device and a simulated TP group of 2) and `policy_loss(check_inputs=False)` for every
preset and aggregation, with and without the off-policy corrections. The control test shows that the detector sees the syncs of the checked
paths (validate=True, check_inputs=True), so the test can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_pdm as pdm
from megatron_pdm.config import PRESETS
from tests.support._cases import make_case, op_args

aten = torch.ops.aten

# aten ops that read device data on the host (or size their output from it).
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
    aten.nonzero.default, aten.nonzero_numpy.default, aten.argwhere.default,
    aten.masked_select.default, aten.equal.default, aten.allclose.default,
    aten.unique_consecutive.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.bincount.default, aten.histc.default,
    aten.repeat_interleave.Tensor, aten._assert_async.default, aten._assert_async.msg,
    aten.tolist.default if hasattr(aten, "tolist") else aten.item.default,
}


def _bool_index(func, args) -> bool:
    """Boolean-mask indexing sizes its result from the mask (a nonzero inside)."""
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default):
        indices = args[1]
        return any(t is not None and t.dtype == torch.bool for t in indices)
    return False


class SyncCounter(TorchDispatchMode):
    """Records every synchronising aten op (name) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS or _bool_index(func, args):
            self.syncs.append(str(func))
        return func(*args, **kwargs)


class _HostReads:
    """Wraps Tensor.numpy / tolist / cpu / __array__ (no dispatch on CPU tensors) to record them."""

    NAMES = ("numpy", "tolist", "cpu", "__array__")

    def __init__(self, log: list[str]):
        self.log, self.saved = log, {}

    def __enter__(self):
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            self.saved[name] = orig

            def wrapper(t, *a, _orig=orig, _name=name, **kw):
                self.log.append(f"Tensor.{_name}")
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(torch.Tensor, name, orig)


def _count_syncs(fn) -> list[str]:
    counter = SyncCounter()
    log: list[str] = []
    with _HostReads(log), counter:
        fn()
    return counter.syncs + log


class _FakeGroup:
    pass


@pytest.fixture
def fake_tp2(monkeypatch):
    """A TP group of 2 in one process (the other rank contributes nothing)."""
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    return _FakeGroup()


def _run_op(case, dtype, inplace, group, vocab):
    logits_in = case["logits"].to(dtype)
    if group is not None:
        logits_in = logits_in[:, : logits_in.shape[1] // 2]
    leaf = logits_in.clone().requires_grad_()

    def run():
        x = leaf * 1.0  # a non-leaf, as in megatron
        stats = pdm.token_stats(x, *op_args(case), tp_group=group, vocab_size=vocab,
                                temperature=0.9, validate=False, inplace=inplace)
        g = torch.linspace(-1.0, 1.0, x.shape[0])
        (stats.logprob * g).sum().backward()
        stats.divergence_rate("kl", "exact"), stats.divergence_rate("tv", "exact")
        stats.direction_interval(), stats.tv_tie_rate("exact")

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_token_stats_without_validation_has_no_sync(dtype, inplace, tp, request):
    case = make_case(0, 12, 100, 5, padded_vocab=104)
    group = request.getfixturevalue("fake_tp2") if tp == 2 else None
    syncs = _count_syncs(_run_op(case, dtype, inplace, group, 100))
    assert syncs == [], syncs


# the docs/math.md §10 corrections, all at once (sequence IS weight, token MIS, OPSM) and the
# sequence MIS: their segment sums must not synchronise either
_CORRECTIONS = [{}, dict(is_level="sequence", is_mask="token", is_mask_high=3.0, seq_mask_kl=0.1),
                dict(is_mask="sequence", seq_ratio="product", is_mask_high=4.0)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("corrections", range(len(_CORRECTIONS)))
def test_policy_loss_without_checks_has_no_sync(preset, aggregation, corrections):
    case = make_case(1, 10, 80, 4)
    logits = case["logits"].clone().requires_grad_()
    stats = pdm.token_stats(logits, *op_args(case), validate=False, tp_group=None, vocab_size=None)
    cfg = pdm.PolicyLossConfig.preset(preset, aggregation=aggregation,
                                      **_CORRECTIONS[corrections])
    adv = torch.linspace(-1.0, 1.0, 10)
    lm = torch.ones(10, dtype=torch.bool)
    lm[3] = False
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, -1, 3])

    def run():
        out = pdm.policy_loss(stats, adv, case["behavior_logprob"], lm, cfg, seq_ids=seq,
                              check_inputs=False)
        out.loss_sum.backward()

    assert _count_syncs(run) == []


def test_detector_sees_the_checked_paths():
    """Control: validation and the input checks do synchronise, and the detector records them."""
    case = make_case(2, 8, 60, 3)
    stats_syncs = _count_syncs(lambda: pdm.token_stats(case["logits"], *op_args(case),
                                                       tp_group=None, vocab_size=None))
    assert stats_syncs, "validate=True reads the support on the host"
    stats = pdm.token_stats(case["logits"], *op_args(case), validate=False, tp_group=None,
                            vocab_size=None)
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    loss_syncs = _count_syncs(lambda: pdm.policy_loss(
        stats, torch.ones(8), case["behavior_logprob"], torch.ones(8, dtype=torch.bool), cfg))
    assert loss_syncs, "check_inputs=True reads a flag on the host"
    assert _count_syncs(lambda: torch.tensor([1.0, 0.0]).nonzero()) == ["aten.nonzero.default"]
    assert _count_syncs(lambda: bool(torch.tensor(True))) != []
    x = torch.arange(4.0)
    assert _count_syncs(lambda: x[x > 1]) != []
