"""The Qwen3-MoE architecture as plain data, and the layout arithmetic that depends on it.

Pure Python (no torch, no megatron): the run config's `model` section *is* `Qwen3MoeArch`, the
converter writes it to `pdm_model.json`, the dry run and the memory estimate read it, and
`mcore/model.py` turns it into a megatron-core TransformerConfig. Two rules that every one of them
needs live here and nowhere else:

* `padded_vocab_size`: megatron pads the output vocabulary to a multiple of
  `make_vocab_size_divisible_by * TP`; the padded ids are never sampled by an engine and are
  excluded from every softmax by the loss op;
* `min_world_size`: the smallest world size a (TP, PP, EP, CP, ETP) layout fits in.

Fields carry HF `Qwen3MoeConfig` names in their docstrings. Fields whose metadata says
`checkpoint=False` (the init scale and the router aux-loss coefficient) do not shape any tensor,
so a run may differ from its checkpoint there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_pdm.configtree import ConfigError, check_fields, from_mapping, to_plain

__all__ = ["Qwen3MoeArch", "min_world_size", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's output-vocab padding: the next multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def min_world_size(*, tp: int, pp: int = 1, ep: int = 1, cp: int = 1, etp: int = 1) -> int:
    """Smallest world in which the layout is valid: PP x lcm(TP x CP, EP x ETP)."""
    return pp * math.lcm(tp * cp, ep * etp)


_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
               "head_dim", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
               "max_position_embeddings", "make_vocab_size_divisible_by")


@dataclass(kw_only=True)
class Qwen3MoeArch:
    """Architecture of a Qwen3-MoE model (every layer MoE, GQA, qk-norm, untied embeddings)."""

    vocab_size: int | None = None
    """Engine/HF vocabulary (`vocab_size`); megatron pads its output layer beyond it. In a run
    config, null means: the task tokenizer's vocabulary (or the checkpoint's with load_dir)."""
    hidden_size: int = 64
    """Model width (`hidden_size`)."""
    num_layers: int = 2
    """Decoder layers (`num_hidden_layers`)."""
    num_attention_heads: int = 4
    """Query heads (`num_attention_heads`)."""
    num_query_groups: int = 2
    """Key/value heads (`num_key_value_heads`)."""
    head_dim: int = 32
    """Per-head width (`head_dim`), megatron `kv_channels`; engines' CPU kernels need >= 32."""
    num_experts: int = 4
    """Routed experts per layer (`num_experts`)."""
    moe_router_topk: int = 2
    """Experts per token (`num_experts_per_tok`)."""
    moe_ffn_hidden_size: int = 64
    """Expert FFN width (`moe_intermediate_size`)."""
    rotary_base: float = 1_000_000.0
    """RoPE base (`rope_theta`)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (`rms_norm_eps`)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for (`max_position_embeddings`)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the output vocabulary to a multiple of this times TP."""
    init_method_std: float = field(default=0.02, metadata={"checkpoint": False})
    """Std of the random initialisation (`initializer_range`); unused when weights are loaded."""
    moe_aux_loss_coeff: float = field(default=0.0, metadata={"checkpoint": False})
    """Router load-balancing loss coefficient (`router_aux_loss_coef`); 0 disables it."""

    def __post_init__(self) -> None:
        check_fields(self)
        problems = [f"{name}={getattr(self, name)} must be >= 1" for name in _INT_FIELDS
                    if getattr(self, name) is not None and getattr(self, name) < 1]
        if self.moe_router_topk > self.num_experts:
            problems.append(f"moe_router_topk={self.moe_router_topk} > num_experts="
                            f"{self.num_experts}")
        if self.num_attention_heads % self.num_query_groups:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                            f"num_query_groups={self.num_query_groups}")
        for name in ("rotary_base", "norm_epsilon", "init_method_std"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if self.moe_aux_loss_coeff < 0:
            problems.append(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")
        if problems:
            raise ConfigError("; ".join(problems))

    # ------------------------------------------------------------------ derived

    def padded_vocab(self, tp: int) -> int:
        """Rows of megatron's output layer at tensor-parallel size `tp`."""
        return padded_vocab_size(self.require_vocab(), self.make_vocab_size_divisible_by, tp)

    def require_vocab(self) -> int:
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is not resolved (set it, or let the task or the "
                              "checkpoint provide it)")
        return self.vocab_size

    @classmethod
    def checkpoint_fields(cls) -> tuple[str, ...]:
        """Fields that shape the weights: a checkpoint and a run must agree on them."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("checkpoint", True))

    def differences(self, other: Qwen3MoeArch) -> list[str]:
        """`name: mine vs theirs` for every checkpoint field that differs (None vocab skipped)."""
        out = []
        for name in self.checkpoint_fields():
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "vocab_size" and mine is None:
                continue
            if mine != theirs:
                out.append(f"{name}={mine!r}, checkpoint has {theirs!r}")
        return out

    # ------------------------------------------------------------------ conversions

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "model") -> Qwen3MoeArch:
        """From a mapping (unknown keys are an error listing the valid ones)."""
        return from_mapping(cls, data, path)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def qwen3_30b_a3b(cls) -> Qwen3MoeArch:
        """Qwen3-30B-A3B (HF config of Qwen/Qwen3-30B-A3B)."""
        return cls(vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
                   num_query_groups=4, head_dim=128, num_experts=128, moe_router_topk=8,
                   moe_ffn_hidden_size=768, rotary_base=1_000_000.0, norm_epsilon=1e-6,
                   max_position_embeddings=40960, make_vocab_size_divisible_by=128,
                   moe_aux_loss_coeff=0.001)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *,
                       make_vocab_size_divisible_by: int = 128) -> Qwen3MoeArch:
        """From an HF Qwen3-MoE `config.json`; refuses features the mapping does not cover."""
        problems = []
        if cfg.get("model_type") not in (None, "qwen3_moe"):
            problems.append(f"model_type={cfg.get('model_type')!r}, expected 'qwen3_moe'")
        if cfg.get("tie_word_embeddings", False):
            problems.append("tie_word_embeddings=True (Qwen3-MoE is untied; tied is not "
                            "supported)")
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            problems.append("dense (mlp_only_layers / decoder_sparse_step != 1) layers are not "
                            "supported")
        if not cfg.get("norm_topk_prob", True):
            problems.append("norm_topk_prob=False is not supported (megatron renormalises top-k)")
        if cfg.get("attention_bias", False):
            problems.append("attention_bias=True is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={cfg.get('hidden_act')!r}, expected 'silu'")
        rope = cfg.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            problems.append(f"rope_scaling={rope} is not supported")
        if problems:
            raise ConfigError("unsupported HF config:\n  " + "\n  ".join(problems))
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5.x nests it in rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_query_groups=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            moe_router_topk=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            rotary_base=float(rope_theta),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            init_method_std=float(cfg.get("initializer_range", 0.02)),
            moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `Qwen3MoeConfig` dict of this architecture (for exports and tiny test models)."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": self.require_vocab(), "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups, "head_dim": self.head_dim,
            "num_experts": self.num_experts, "num_experts_per_tok": self.moe_router_topk,
            "moe_intermediate_size": self.moe_ffn_hidden_size,
            "intermediate_size": self.moe_ffn_hidden_size * self.moe_router_topk,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": self.rotary_base,
            "rms_norm_eps": self.norm_epsilon,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
            "initializer_range": self.init_method_std,
            "router_aux_loss_coef": self.moe_aux_loss_coeff,
        }


# ---------------------------------------------------------------------- printer (cluster scripts)

_PRESETS = {"qwen3-30b-a3b": Qwen3MoeArch.qwen3_30b_a3b}
# megatron-style flag of each field (the flags Megatron-LM's pretrain_gpt takes for the same value)
_MEGATRON_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "head_dim": "--kv-channels", "num_experts": "--num-experts",
    "moe_router_topk": "--moe-router-topk", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "rotary_base": "--rotary-base", "norm_epsilon": "--norm-epsilon",
    "max_position_embeddings": "--max-position-embeddings", "vocab_size": "--vocab-size",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
}


def format_arch(arch: Qwen3MoeArch, fmt: str) -> str:
    """`shell`: ARCH_<FIELD>=value lines; `flags`: megatron-style flags, one token per line;
    `sets`: the driver's `--set model.<field>=value` overrides of the architecture fields, one
    token per line (what the cluster scripts pass, so their config file restates no shape)."""
    data = arch.to_dict()
    if fmt == "sets":
        return "\n".join(tok for name in _MEGATRON_FLAGS
                         for tok in ("--set", f"model.{name}={data[name]}"))
    if fmt == "shell":
        return "\n".join(f"ARCH_{k.upper()}={v}" for k, v in data.items())
    if fmt == "flags":
        tokens = []
        for name, flag in _MEGATRON_FLAGS.items():
            value = data[name]
            tokens += [flag, str(int(value) if name == "rotary_base" else value)]
        tokens += ["--group-query-attention", "--qk-layernorm", "--normalization", "RMSNorm",
                   "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights", "--moe-router-score-function",
                   "softmax", "--moe-router-dtype", "fp32"]
        return "\n".join(tokens)
    raise ConfigError(f"--format {fmt!r}: choose shell, flags or sets")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_pdm.arch",
                                     description="print a preset architecture")
    parser.add_argument("preset", choices=sorted(_PRESETS))
    parser.add_argument("--format", default="shell", choices=["shell", "flags", "sets"])
    cli = parser.parse_args()
    print(format_arch(_PRESETS[cli.preset](), cli.format))
