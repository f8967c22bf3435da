"""A megatron-core GPTModel from the architecture dataclass (`arch.py`): Qwen3-MoE, dense Qwen3,
Llama.

Qwen3-MoE (e.g. Qwen3-30B-A3B) in megatron-core terms:
- pre-norm decoder, RMSNorm (eps 1e-6), no biases anywhere;
- grouped-query attention with `kv_channels` = head_dim (128 for 30B-A3B, so q heads x head_dim
  need not equal hidden), RMSNorm on queries and keys per head (qk-layernorm), RoPE with a
  configurable base (1e6 for Qwen3);
- every layer is MoE: a softmax router (fp32) picking top-k experts whose probabilities are
  renormalised over the chosen k (HF `norm_topk_prob=True`; megatron's default top-k-then-softmax
  computes the same thing), SwiGLU experts (`gated_linear_unit`, silu), no shared expert;
- untied input embedding and output layer; the output vocabulary is padded by megatron to a
  multiple of `make_vocab_size_divisible_by * TP` (the padding ids are masked by our loss op).

The dense families differ only in: an MLP per layer (SwiGLU, `ffn_hidden_size`) instead of the
MoE block; q/k norms on (Qwen3) or off (Llama); tied embeddings optional
(`share_embeddings_and_output_weights`): with PP = 1 the output layer reads the embedding weight
itself; with PP > 1 the last stage holds a copy that megatron initialises from the first stage by
an all-reduce over parallel_state's embedding group (created by `initialize_model_parallel`) and
keeps equal by all-reducing the two copies' gradients over that group in `finalize_model_grads`.

Two layer specs:
- local (pure megatron-core modules, works on CPU and without TE/apex). Norms are our own
  `TorchRMSNorm`, which tags its parameters with `sequence_parallel` so that
  `finalize_model_grads` all-reduces their gradients over TP: with sequence parallelism each rank
  sees a different slice of the sequence (input/pre-MLP norms) or of the heads (q/k norms), so the
  full gradient is the sum over TP ranks. megatron's own torch-norm wrapper refuses SP outright.
- transformer-engine (GPU; needed for FP8): megatron's TE spec with the same architecture.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_pdm.arch import ModelArch


class TorchRMSNorm:
    """torch.nn.RMSNorm built from a megatron config; parameters tagged `sequence_parallel`.

    A drop-in for megatron's norm slot (`build_module(spec, config=..., hidden_size=..., eps=...)`).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            # finalize_model_grads all-reduces grads of params carrying this flag over TP.
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    sequence_parallel: Optional[bool] = None,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    moe_token_dispatcher_type: str = "alltoall",
    use_cpu_initialization: Optional[bool] = None,
    fp8: Optional[str] = None,
    fp8_recipe: Optional[str] = None,
    **overrides,
) -> TransformerConfig:
    """The megatron-core TransformerConfig for `arch` at a parallel layout.

    `overrides` are further TransformerConfig fields (they win over the derived ones).

    Sequence parallelism defaults to on whenever TP > 1 (megatron requires it for MoE with TP;
    dense models keep the same default so both families shard activations alike).
    `use_cpu_initialization` defaults to "no GPU": with a GPU the weights are created on the
    rank's device. Expert tensor parallelism is 1 (the layout used for Qwen3-30B-A3B in practice, and the only one
    gloo supports with the alltoall dispatcher).
    """
    if sequence_parallel is None:
        sequence_parallel = tp > 1
    if use_cpu_initialization is None:
        # On a GPU megatron initialises the weights on torch.cuda.current_device(); on CPU the
        # shim maps that device to the CPU, but megatron's GPU init path needs real CUDA.
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.mlp_width,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        qk_layernorm=arch.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **(_moe_kwargs(arch, moe_token_dispatcher_type) if arch.is_moe else {}),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        init_method_std=arch.init_method_std,
    )
    if fp8 is not None:
        kwargs.update(fp8=fp8, fp8_recipe=fp8_recipe or "delayed")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_kwargs(arch: ModelArch, dispatcher: str) -> dict:
    """TransformerConfig fields of the MoE block (absent for a dense model)."""
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_router_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_load_balancing_type="aux_loss" if arch.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
    )


def layer_spec(arch: ModelArch, *, use_te: bool = False) -> TransformerBlockSubmodules:
    """Block spec: `num_layers` identical MoE or dense layers plus the final norm."""
    num_experts = arch.num_experts or None  # megatron: None = dense MLP
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.extensions.transformer_engine import TENorm

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True, qk_layernorm=arch.qk_layernorm
        )
        final_norm = TENorm
    else:
        spec = copy.deepcopy(
            get_gpt_layer_local_spec(
                num_experts=num_experts, moe_grouped_gemm=False,
                qk_layernorm=arch.qk_layernorm,
                normalization="RMSNorm",
            )
        )
        sub = spec.submodules
        sub.input_layernorm = TorchRMSNorm
        sub.pre_mlp_layernorm = TorchRMSNorm
        if arch.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = TorchRMSNorm
            sub.self_attention.submodules.k_layernorm = TorchRMSNorm
        final_norm = TorchRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * arch.num_layers, layer_norm=final_norm)


def _local_layer_count(config: TransformerConfig, pp_rank: int) -> int:
    if config.num_layers % config.pipeline_model_parallel_size:
        raise ValueError(
            f"num_layers={config.num_layers} not divisible by "
            f"PP={config.pipeline_model_parallel_size}"
        )
    return config.num_layers // config.pipeline_model_parallel_size


def build_model(
    arch: ModelArch,
    config: TransformerConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    use_te: bool = False,
    parallel_output: bool = True,
    vp_stage: Optional[int] = None,
) -> GPTModel:
    """Builds the (TP/EP/PP-local) GPTModel; call after `initialize_model_parallel`."""
    block = layer_spec(arch, use_te=use_te)
    n_local = _local_layer_count(config, 0)
    block = TransformerBlockSubmodules(
        layer_specs=block.layer_specs[:n_local], layer_norm=block.layer_norm
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=arch.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rotary_base),
        vp_stage=vp_stage,
    )
