"""The fused LM head in the megatron model (mcore/lm_head.py): train.fused_head on == off.

The same tiny Qwen3-MoE GPTModel is built twice with the same weights, once with megatron's
output layer (the default path: logits, `token_stats(inplace=True)`) and once with the fused head
(`build_model(..., fused_head=True)`: hidden states, `fused_token_stats`); the driver's
`policy_loss_func` on one rollout batch must give the same loss, metrics and gradient of every
parameter. fp64 weights and activations (the router too), tolerance 1e-10 (relative to the
largest gradient entry): the two paths differ only in summation order. Cases, on gloo:

- TP 1; TP 2 with sequence parallelism (the output layer's all-gather of the hidden states and
  its reduce-scatter backward) and TP 2 without it (backward all-reduce of grad_h; a dense
  model there, megatron's local dense spec, untied: megatron refuses MoE with TP but without
  SP);
- untied output weight (the project's builder) and tied embeddings (megatron's GPTModel with
  share_embeddings_and_output_weights=True, built here directly): the shared embedding weight's
  gradient carries both uses.

The vocabulary (11 real ids, padded to 37 per rank: make_vocab_size_divisible_by=37) makes
V_local a size no other tensor of the model has, so a dispatch-mode probe can check that the
fused path never creates a tensor with a V_local dimension other than the [V_local, H] weight
(its gradient and the op's accumulator), while the default path creates [.., V_local] logits.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_pdm as pdm
from rollout_bridge.core.packing import pack_padded
from rollout_bridge.core.types import RolloutBatch
from tests.support._dist import run_gloo
from tests.mcore.test_loss_adapter import K, V, _sample  # rollout samples over V = 11, K = 4

H = 64
DIVISIBLE = 37  # V_local = 37 at TP 1 and 2 (padded vocab 37 / 74)


def _packed():
    gen = torch.Generator().manual_seed(0)
    samples = [_sample([1, 5, 6], [3, 7, 2], gen, 0), _sample([1, 4], [9, 2], gen, 0),
               _sample([1, 8, 8, 3], [2], gen, 1), _sample([2, 10], [4, 4, 1], gen, 1)]
    rb = RolloutBatch(samples=samples, temperature=0.8, weight_version="0", top_logprobs=K,
                      vocab_size=V)
    return pack_padded(rb, torch.tensor([0.5, -0.5, 1.0, -1.0]), pad_to_multiple_of=2)


def _arch():
    from megatron_pdm.arch import ModelArch

    return ModelArch(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=4,
                        num_query_groups=2, head_dim=16, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=48, max_position_embeddings=64,
                        make_vocab_size_divisible_by=DIVISIBLE, init_method_std=0.2)


def _build(arch, tcfg, *, tied: bool, fused: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_pdm.mcore.lm_head import install_fused_head
    from megatron_pdm.mcore.model import build_model, layer_spec

    dense = tcfg.num_moe_experts is None
    if not tied and not dense:
        return build_model(arch, tcfg, fused_head=fused)
    # Tied embeddings, or a dense model (TP without SP: megatron refuses MoE there): megatron's
    # own GPTModel over the project's MoE layer spec or megatron's dense local spec.
    spec = (get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm") if dense
            else layer_spec(arch))
    gpt = GPTModel(config=tcfg, transformer_layer_spec=spec,
                   vocab_size=arch.padded_vocab(tcfg.tensor_model_parallel_size),
                   max_sequence_length=arch.max_position_embeddings,
                   share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                   rotary_base=int(arch.rotary_base))
    return install_fused_head(gpt) if fused else gpt


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns (meta tensors excepted: shape-only
    stand-ins that allocate nothing, as the op's argument checks use)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.shapes.add(tuple(t.shape))
        return out


def _loss_and_grads(gpt, packed, cfg, *, fused: bool):
    from megatron_pdm.mcore.lm_head import lm_head_of
    from megatron_pdm.mcore.loss_adapter import policy_loss_func

    head = lm_head_of(gpt)
    assert (head is not None) == fused
    gpt.zero_grad(set_to_none=True)
    probe = _Shapes()
    with probe:
        out = gpt(packed.tokens, packed.position_ids, attention_mask=None)
        loss, ntok, metrics = policy_loss_func(out, batch=packed,
                                               cfg=pdm.PolicyLossConfig.preset("pdm-agg"),
                                               head=head)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}
    return float(loss), int(ntok), metrics, grads, out.shape, probe.shapes


def _compare_worker(rank, world, sp_flags):
    from megatron.core import parallel_state as ps

    from megatron_pdm.mcore.lm_head import FusedHeadOutputLayer, lm_head_of
    from megatron_pdm.mcore.model import transformer_config
    from megatron_pdm.mcore.parallel import init_parallel

    arch, packed = _arch(), _packed()
    b, s = packed.tokens.shape
    for sp in sp_flags:
        # The dense SP-off case checks the all-reduce branch; tying is checked with SP on.
        for tied in ((False, True) if sp or world == 1 else (False,)):
            init_parallel(tp=world, ep=1, seed=11)
            # megatron refuses MoE with TP but without SP in training: SP off is a dense model.
            dense = ({} if sp or world == 1 else
                     dict(num_moe_experts=None, moe_ffn_hidden_size=None,
                          moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0))
            tcfg = transformer_config(arch, tp=world, sequence_parallel=sp,
                                      params_dtype=torch.float64, moe_router_dtype="fp64",
                                      calculate_per_token_loss=True, **dense)
            ref = _build(arch, tcfg, tied=tied, fused=False)
            fused = _build(arch, tcfg, tied=tied, fused=True)
            fused.load_state_dict(ref.state_dict())
            # Chunks smaller than N and V_local, so that several chunks of each are streamed.
            fused.output_layer.token_chunk, fused.output_layer.vocab_chunk = 5, 8
            assert isinstance(fused.output_layer, FusedHeadOutputLayer)
            assert type(ref.output_layer).__name__ == "ColumnParallelLinear"
            assert [n for n, _ in fused.named_parameters()] == [n for n, _ in ref.named_parameters()]
            head = lm_head_of(fused)
            if tied:
                assert head.weight() is fused.embedding.word_embeddings.weight
                assert fused.output_layer.weight is None
            else:
                assert head.weight() is fused.output_layer.weight
            vl = head.weight().shape[0]
            assert vl == DIVISIBLE
            r = _loss_and_grads(ref, packed, None, fused=False)
            f = _loss_and_grads(fused, packed, None, fused=True)
            where = f"tp={world} sp={sp} tied={tied} rank={rank}"
            assert r[4] == (b, s, vl) and f[4] == (b, s, H), where
            assert r[1] == f[1] > 0, where
            assert abs(r[0] - f[0]) <= 1e-10 * max(1.0, abs(r[0])), (where, r[0], f[0])
            for key, v in r[2].items():
                torch.testing.assert_close(f[2][key], v, rtol=1e-10, atol=1e-12,
                                           msg=f"{where} metric {key}")
            assert r[3].keys() == f[3].keys(), where
            scale = max(float(g.abs().max()) for g in r[3].values())
            for name, g in r[3].items():
                err = float((f[3][name] - g).abs().max())
                assert err <= 1e-10 * scale, (where, name, err, scale)
            if tied and rank == 0:  # (TP 2: rank 1's 37 ids are all padding, no gradient)
                emb = "embedding.word_embeddings.weight"
                assert float(f[3][emb].abs().max()) > 0, where
            # Shape probe: only the [V_local, H] weight (its gradient, the op's accumulator)
            # has a V_local dimension on the fused path; the default path makes logits.
            with_vl = {sh for sh in f[5] if vl in sh}
            assert with_vl <= {(vl, H)}, (where, with_vl)
            assert any(vl in sh and len(sh) >= 2 and sh != (vl, H) for sh in r[5]), where
            ps.destroy_model_parallel()


@pytest.mark.gloo
@pytest.mark.megatron
def test_fused_head_equals_default_tp1():
    run_gloo(_compare_worker, 1, (False,))


@pytest.mark.gloo
@pytest.mark.megatron
def test_fused_head_equals_default_tp2_sp_on_and_off():
    run_gloo(_compare_worker, 2, (True, False))


def test_install_refusals_and_lookups():
    from types import SimpleNamespace

    from megatron_pdm.mcore.lm_head import install_fused_head, lm_head_of

    assert lm_head_of(None) is None
    middle = SimpleNamespace(post_process=False)  # a pipeline stage without an output layer
    assert install_fused_head(middle) is middle and lm_head_of(middle) is None
    plain = SimpleNamespace(post_process=True, output_layer=torch.nn.Linear(2, 2),
                            config=SimpleNamespace())
    assert lm_head_of(SimpleNamespace(module=plain)) is None  # megatron's own head: logits
    with pytest.raises(ValueError, match="not megatron's ColumnParallelLinear"):
        install_fused_head(plain)


@pytest.mark.parametrize("layout", ["bsv", "sbv"])
@pytest.mark.parametrize("stats_dtype", [None, torch.float64])
def test_batch_token_stats_with_a_head_equals_the_logits_path(layout, stats_dtype):
    """batch_token_stats(hidden, head=...) == batch_token_stats(hidden @ W.T): both row orders
    ([s, b, H] is read as a view in sb order, like logits), with and without a dtype cast."""
    from types import SimpleNamespace

    from megatron_pdm.mcore.loss_adapter import batch_token_stats
    from tests.mcore.test_loss_adapter import V_PADDED, _batch

    packed = pack_padded(_batch()[0], torch.tensor([0.5, -0.5, 1.0]))
    b, s = packed.tokens.shape
    g = torch.Generator().manual_seed(5)
    hidden_bsh = torch.randn(b, s, 8, generator=g, dtype=torch.float64)
    weight_vh = torch.randn(V_PADDED, 8, generator=g, dtype=torch.float64)
    head = SimpleNamespace(weight=lambda: weight_vh, token_chunk=3, vocab_chunk=5)
    out = hidden_bsh if layout == "bsv" else hidden_bsh.transpose(0, 1).contiguous()
    ref = batch_token_stats(out @ weight_vh.t(), packed, layout=layout, tp_group=None,
                            stats_dtype=stats_dtype)
    got = batch_token_stats(out, packed, layout=layout, tp_group=None, stats_dtype=stats_dtype,
                            head=head)
    assert got.rows == ref.rows == ("sb" if layout == "sbv" and stats_dtype is None else "bs")
    torch.testing.assert_close(got.stats.logprob, ref.stats.logprob, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.stats.topk_kl, ref.stats.topk_kl, rtol=0, atol=1e-12)
    assert torch.equal(got.fields["loss_mask"], ref.fields["loss_mask"])
