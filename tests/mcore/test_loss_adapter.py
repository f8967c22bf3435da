"""The megatron loss_func adapter (mcore/loss_adapter.py): layout, shift, padding, TP parity.

Single-process tests compare `policy_loss_func` on a row-aligned PackedBatch against the core API
called by hand on the rows that score each response token (row P + t - 1 scores response token t),
with the logits given as [b, s, V] and as [s, b, V], with Megatron vocab padding columns (huge
values that must be ignored) and a temperature. Tolerance: 1e-6 (same fp32 math, different row
selection code).

The 2-process test builds the tiny Qwen3-MoE GPTModel at TP=1, saves it with dist_checkpointing,
reloads it at TP=2 (sequence parallel on, vocab split unevenly over the real vocabulary) and checks
that loss and metrics of the same rollout batch agree (fp32, atol 1e-5: different matmul splits).
"""

from __future__ import annotations

import math

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.mcore.loss_adapter import policy_loss_func, to_bsv
from rollout_bridge.core.packing import pack_padded
from rollout_bridge.core.types import RolloutBatch, RolloutSample
from tests.support._dist import run_gloo

V, V_PADDED, K = 11, 16, 4


def _sample(prompt, response, gen, group):
    t = len(response)
    lp = torch.log_softmax(torch.randn(t, V, generator=gen), -1)
    top_v, top_i = torch.topk(lp, K, dim=-1)
    ids = torch.zeros(t, K + 1, dtype=torch.int32)
    lps = torch.full((t, K + 1), -math.inf)
    valid = torch.zeros(t, K + 1, dtype=torch.bool)
    ids[:, :K], lps[:, :K], valid[:, :K] = top_i.int(), top_v, True
    for j, tok in enumerate(response):
        hit = (top_i[j] == tok).nonzero()
        if len(hit) == 0:
            ids[j, K], lps[j, K], valid[j, K] = tok, lp[j, tok], True
    beh = lp[torch.arange(t), torch.tensor(response)]
    return RolloutSample(prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
                         behavior_logprob=beh, support_ids=ids, support_logprobs=lps,
                         support_valid=valid, finish_reason="stop", group_index=group)


def _batch():
    gen = torch.Generator().manual_seed(0)
    samples = [_sample([1, 5, 6], [3, 7, 2], gen, 0), _sample([1, 4], [9, 2], gen, 0),
               _sample([1, 8, 8, 3], [2], gen, 1)]
    return RolloutBatch(samples=samples, temperature=0.7, weight_version="0", top_logprobs=K,
                        vocab_size=V), samples


@pytest.mark.parametrize("preset", ["pdm-agg", "grpo", "drpo"])
@pytest.mark.parametrize("layout", ["bsv", "sbv"])
def test_loss_func_matches_manual_rows(preset, layout):
    batch, samples = _batch()
    adv_b = torch.tensor([0.5, -0.5, 1.0])
    packed = pack_padded(batch, adv_b)
    b, s = packed.tokens.shape
    gen = torch.Generator().manual_seed(1)
    logits_bsv = torch.randn(b, s, V_PADDED, generator=gen)
    logits_bsv[..., V:] = 50.0  # Megatron padding columns: must not enter the softmax
    cfg = pdm.PolicyLossConfig.preset(preset)
    # A copy: the adapter consumes fp32 logits in place, as megatron's CE does.
    out_logits = logits_bsv.clone() if layout == "bsv" else logits_bsv.transpose(0, 1).contiguous()
    # The batch carries temperature 0.7 and vocab 11: the adapter takes both from there.
    loss, ntok, metrics = policy_loss_func(out_logits, batch=packed, cfg=cfg, layout=layout,
                                           tp_group=None)
    # By hand: response token t of sample i is scored by logits row P + t - 1.
    rows, fields = [], {k: [] for k in ("ids", "lp", "valid", "beh", "adv", "seq", "lab")}
    for i, smp in enumerate(samples):
        p = len(smp.prompt_ids)
        for t in range(len(smp.response_ids)):
            rows.append(logits_bsv[i, p + t - 1, :V])
            fields["lab"].append(int(smp.response_ids[t]))
            fields["ids"].append(smp.support_ids[t].long())
            fields["lp"].append(smp.support_logprobs[t])
            fields["valid"].append(smp.support_valid[t])
            fields["beh"].append(float(smp.behavior_logprob[t]))
            fields["adv"].append(float(adv_b[i]))
            fields["seq"].append(i)
    stats = pdm.token_stats(torch.stack(rows), torch.tensor(fields["lab"]),
                            torch.stack(fields["ids"]), torch.stack(fields["lp"]),
                            torch.stack(fields["valid"]), tp_group=None, vocab_size=None,
                            temperature=0.7)
    ref_loss, ref_n, ref_metrics = pdm.policy_loss(
        stats, torch.tensor(fields["adv"]), torch.tensor(fields["beh"]),
        torch.ones(len(rows), dtype=torch.bool), cfg, seq_ids=torch.tensor(fields["seq"]))
    assert int(ntok) == int(ref_n)
    assert ntok.dtype == torch.int32
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key].double(), value.double(), atol=1e-6, rtol=1e-6,
                                   equal_nan=True)
    assert metrics["tokens/loss"][1] == len(rows)


def test_make_loss_func_takes_temperature_and_vocab_from_the_batch():
    """The rollout's temperature has one source: the batch (old API defaulted to T=1)."""
    from megatron_pdm.mcore.loss_adapter import make_loss_func

    batch, _ = _batch()
    packed = pack_padded(batch, torch.tensor([0.5, -0.5, 1.0]))
    logits = torch.randn(*packed.tokens.shape, V_PADDED, generator=torch.Generator().manual_seed(3))
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    loss_07, _, m07 = make_loss_func(packed, cfg)(logits.clone())
    packed.temperature = 1.0
    loss_10, _, m10 = make_loss_func(packed, cfg)(logits.clone())
    assert not torch.allclose(m07["mismatch/abs_logprob_diff"], m10["mismatch/abs_logprob_diff"])
    with pytest.raises(TypeError):
        make_loss_func(packed, cfg, temperature=0.7)  # no second source of truth
    packed.vocab_size = None
    with pytest.raises(ValueError, match="vocab_size"):
        make_loss_func(packed, cfg)(logits.clone())


def test_validated_batch_runs_without_checks_and_unvalidated_batch_is_checked():
    batch, _ = _batch()
    packed = pack_padded(batch, torch.tensor([0.5, -0.5, 1.0]))
    assert packed.validated is False  # hand-built samples: nobody checked them
    row = int(packed.loss_mask.reshape(-1).nonzero()[0])
    packed.support_logprobs.reshape(-1, K + 1)[row, 0] = float("nan")
    logits = torch.randn(*packed.tokens.shape, V_PADDED)
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    with pytest.raises(ValueError, match="support_logprobs"):
        policy_loss_func(logits.clone(), batch=packed, cfg=cfg, tp_group=None)


def test_loss_func_backward_only_touches_scoring_rows():
    batch, samples = _batch()
    packed = pack_padded(batch, torch.tensor([1.0, -1.0, 0.5]))
    b, s = packed.tokens.shape
    logits_bsv = torch.randn(b, s, V_PADDED, generator=torch.Generator().manual_seed(0),
                             requires_grad=True)  # seeded: some draws leave no row touched
    loss, _, _ = policy_loss_func(logits_bsv, batch=packed, cfg=pdm.PolicyLossConfig.preset(
        "grpo"), tp_group=None)
    loss.backward()
    touched_bs = logits_bsv.grad.abs().sum(-1) > 0
    # Only rows that score a response token can get a gradient (the clip may zero some of them).
    assert not (touched_bs & ~packed.loss_mask).any()
    assert touched_bs.sum() >= 2
    assert logits_bsv.grad[..., V:].abs().max() == 0  # padding ids get no gradient


def test_to_bsv_layouts_and_errors():
    x = torch.randn(2, 5, 3)
    assert to_bsv(x, 2, 5) is x
    assert torch.equal(to_bsv(x.transpose(0, 1), 2, 5), x)
    with pytest.raises(ValueError, match="ambiguous"):
        to_bsv(torch.randn(3, 3, 4), 3, 3)
    assert to_bsv(torch.randn(3, 3, 4), 3, 3, layout="sbv").shape == (3, 3, 4)
    with pytest.raises(ValueError, match="match neither"):
        to_bsv(torch.randn(4, 4, 2), 2, 5)


def test_empty_microbatch_still_backpropagates():
    batch, _ = _batch()
    packed = pack_padded(batch, torch.zeros(3))
    packed.loss_mask[:] = False
    logits_bsv = torch.randn(*packed.tokens.shape, V_PADDED, requires_grad=True)
    loss, ntok, _ = policy_loss_func(logits_bsv, batch=packed, cfg=pdm.PolicyLossConfig.preset(
        "pdm-agg"), tp_group=None)
    loss.backward()
    assert int(ntok) == 0 and float(loss) == 0.0 and logits_bsv.grad is not None


# ----------------------------------------------------------------------------- TP=1 vs TP=2

def _tp_parity_worker(rank, world, ckpt_dir, out_path):
    from megatron.core import parallel_state as ps

    from megatron_pdm.mcore.loss_adapter import reduce_metrics
    from megatron_pdm.mcore import checkpoint as ckpt
    from megatron_pdm.mcore.model import build_model, transformer_config
    from megatron_pdm.mcore.parallel import destroy_parallel, init_parallel
    from megatron_pdm.train.rollout import local as ro
    from megatron_pdm.arch import ModelArch
    from megatron_pdm.train.task import AdditionTask, Tokenizer
    from rollout_bridge.core.types import group_advantages

    tok = Tokenizer()
    task = AdditionTask(2, tok)
    arch = ModelArch(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2,
                        num_attention_heads=4, num_query_groups=2, head_dim=16, num_experts=4,
                        moe_router_topk=2, moe_ffn_hidden_size=64, max_position_embeddings=64,
                        make_vocab_size_divisible_by=8, init_method_std=0.2)
    results = {}
    for tp in (1, 2):
        init_parallel(tp=tp, ep=1, seed=7 + tp)  # different init: TP=2 weights come from disk
        tcfg = transformer_config(arch, tp=tp, calculate_per_token_loss=True)
        model = build_model(arch, tcfg)
        if tp == 1:
            ckpt.save_model(ckpt_dir, model)
            engine = ro.build_engine(build_model(arch, tcfg), vocab_size=tok.vocab_size,
                                     top_logprobs=8, seed=3, rollout_precision="bf16",
                                     eos_id=tok.eos_id, pad_id=tok.pad_id, tp_size=1)
            engine.update_weights(ro.engine_weights(model))
            ops = task.operands_for(0, 0, 4)
            rb = engine.generate([task.prompt(a, c) for a, c in ops], {"max_new_tokens": 4}, n=4)
            rb.set_rewards([float(i % 3 == 0) for i in range(len(rb.samples))])
            packed = pack_padded(rb, group_advantages(rb), pad_to_multiple_of=2)
        else:
            ckpt.load_model(ckpt_dir, model)
        logits = model(packed.tokens, packed.position_ids, attention_mask=None)
        loss, ntok, metrics = policy_loss_func(
            logits, batch=packed, cfg=pdm.PolicyLossConfig.preset("pdm-agg"))
        results[tp] = (float(loss), int(ntok), reduce_metrics([metrics]))
        # V=18 is padded to 24 at TP=1 and to 32 at TP=2 (16 per rank): padding differs.
        assert logits.shape[-1] == {1: 24, 2: 16}[tp]
        ps.destroy_model_parallel()
    l1, n1, m1 = results[1]
    l2, n2, m2 = results[2]
    assert n1 == n2 > 0
    assert abs(l1 - l2) <= 1e-5 * max(1.0, abs(l1)), (l1, l2)
    for key, v in m1.items():
        if not math.isnan(v):
            assert abs(v - m2[key]) <= 1e-5, (key, v, m2[key])
    if rank == 0:
        torch.save(results, out_path)
    del destroy_parallel


@pytest.mark.gloo
@pytest.mark.megatron
def test_loss_tp2_equals_tp1_after_reshard(tmp_path):
    run_gloo(_tp_parity_worker, 2, str(tmp_path / "ckpt"), str(tmp_path / "res.pt"))
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    assert res[1][1] > 0 and math.isfinite(res[1][0])


def test_batch_token_stats_row_orders():
    """The one batch -> token_stats call: [s, b, V] logits are read as a view in sb row order
    (fields transposed to match), or, with stats_dtype, as a bs-ordered copy; both equal the op
    called on the hand-flattened batch."""
    from megatron_pdm.mcore.loss_adapter import batch_token_stats

    batch, _ = _batch()
    packed = pack_padded(batch, torch.tensor([0.5, -0.5, 1.0]))
    b, s = packed.tokens.shape
    logits_bsv = torch.randn(b, s, V_PADDED, generator=torch.Generator().manual_seed(4))
    flat = packed.flat()
    ref = pdm.token_stats(logits_bsv.reshape(b * s, V_PADDED).double(), flat["labels"],
                          flat["support_ids"], flat["support_logprobs"], flat["support_valid"],
                          tp_group=None, vocab_size=V, temperature=0.7)
    logits_sbv = logits_bsv.transpose(0, 1).contiguous()
    out = batch_token_stats(logits_sbv, packed, layout="sbv", tp_group=None,
                            stats_dtype=torch.float64)
    assert out.rows == "bs" and out.checked
    torch.testing.assert_close(out.stats.logprob, ref.logprob, rtol=0, atol=0)
    torch.testing.assert_close(out.stats.topk_kl, ref.topk_kl, rtol=0, atol=0)
    assert torch.equal(out.fields["advantages"], flat["advantages"])
    view = batch_token_stats(logits_sbv.double(), packed, layout="sbv", tp_group=None)
    assert view.rows == "sb"
    sb_to_bs = torch.arange(b * s).reshape(s, b).t().reshape(-1)  # bs row n -> its sb row
    torch.testing.assert_close(view.stats.logprob[sb_to_bs], ref.logprob, rtol=0, atol=0)
    assert torch.equal(view.fields["loss_mask"][sb_to_bs], flat["loss_mask"])


def test_the_study_probe_reads_a_batch_through_batch_token_stats(monkeypatch):
    """The mask study's probe has no batch -> token_stats call of its own: it calls the
    training adapter's, with its statistics dtype."""
    from megatron_pdm.analysis.megatron_probe import MegatronProbe
    from megatron_pdm.mcore import loss_adapter

    batch, _ = _batch()
    packed = pack_padded(batch, torch.tensor([0.5, -0.5, 1.0]))
    b, s = packed.tokens.shape
    calls = []
    real = loss_adapter.batch_token_stats

    def spy(output_tensor, mb, **kwargs):
        calls.append(kwargs)
        return real(output_tensor, mb, tp_group=None, **kwargs)

    monkeypatch.setattr(loss_adapter, "batch_token_stats", spy)
    probe = MegatronProbe(None, None, [packed], [], pp=1)
    probe._table_of(torch.randn(b, s, V_PADDED), packed)
    assert calls == [{"stats_dtype": torch.float64, "head": None}]  # None: logits, no fused head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_op_reads_the_lm_head_output_in_its_own_dtype(monkeypatch, dtype):
    """The logits-dtype rule (docs/op.md): no fp32 copy of bf16 logits; fp32 logits in place."""
    from megatron_pdm.mcore import loss_adapter

    seen = {}
    real = loss_adapter.token_stats

    def spy(logits, *args, **kwargs):
        seen.update(dtype=logits.dtype, ptr=logits.untyped_storage().data_ptr(),
                    inplace=kwargs["inplace"])
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(loss_adapter, "token_stats", spy)
    batch, _ = _batch()
    packed = pack_padded(batch, torch.tensor([0.5, -0.5, 1.0]))
    logits = torch.randn(*packed.tokens.shape, V_PADDED).to(dtype).requires_grad_(True)
    out = logits * 1  # a non-leaf, as the output layer's result
    loss, _, _ = loss_adapter.make_loss_func(packed, pdm.PolicyLossConfig.preset("pdm-agg"))(out)
    loss.backward()
    assert seen["dtype"] == dtype and seen["ptr"] == out.untyped_storage().data_ptr()
    assert seen["inplace"] and logits.grad.dtype == dtype and torch.isfinite(logits.grad).all()
