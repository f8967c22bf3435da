"""The model architecture as plain data, and the layout arithmetic that depends on it.

One typed architecture, `ModelArch`, covers three HF families; which one a value describes
follows from two fields (`family`):

    num_experts > 0, qk_layernorm            qwen3_moe  (Qwen3-MoE: every layer MoE)
    num_experts = 0, qk_layernorm            qwen3      (dense Qwen3: q/k RMSNorm per head)
    num_experts = 0, no qk_layernorm         llama      (Llama, e.g. SmolLM2)

All three are pre-norm RMSNorm decoders with GQA, RoPE, SwiGLU and no biases; embeddings are
tied or untied (`tie_word_embeddings`). The defaults are the Qwen3-MoE shape the project started
with, so run configs and `pdm_model.json` files written before the dense families load unchanged.

Pure Python (no torch, no megatron): the run config's `model` section *is* `ModelArch`, the
converter writes it to `pdm_model.json`, the dry run and the memory estimate read it, and
`mcore/model.py` turns it into a megatron-core TransformerConfig. Two rules that every one of them
needs live here and nowhere else:

* `padded_vocab_size`: megatron pads the output vocabulary to a multiple of
  `make_vocab_size_divisible_by * TP`; the padded ids are never sampled by an engine and are
  excluded from every softmax by the loss op; `vocab_shard_width` is one TP rank's share of it
  (Qwen3's 151,936: 76,032 at TP 2, 38,016 at TP 4);
* `min_world_size`: the smallest world size a (TP, PP, EP, CP, ETP) layout fits in.

Fields carry HF config names in their docstrings. Fields whose metadata says `checkpoint=False`
(the init scale and the router aux-loss coefficient) do not shape any tensor, so a run may differ
from its checkpoint there. The MoE fields (`MOE_FIELDS`) are unused by a dense model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_pdm.configtree import ConfigError, check_fields, from_mapping, to_plain
from megatron_pdm.intmath import round_up

__all__ = ["FAMILIES", "MOE_FIELDS", "ModelArch", "min_world_size",
           "padded_vocab_size", "vocab_shard_width"]


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's output-vocab padding: the next multiple of `divisible_by * tp`."""
    return round_up(vocab_size, divisible_by * tp)


def vocab_shard_width(vocab_size: int, divisible_by: int, tp: int) -> int:
    """V_local: the columns of one TP rank's shard of megatron's padded output vocabulary."""
    return padded_vocab_size(vocab_size, divisible_by, tp) // tp


def min_world_size(*, tp: int, pp: int = 1, ep: int = 1, cp: int = 1, etp: int = 1) -> int:
    """Smallest world in which the layout is valid: PP x lcm(TP x CP, EP x ETP)."""
    return pp * math.lcm(tp * cp, ep * etp)


_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
               "head_dim", "moe_router_topk", "moe_ffn_hidden_size", "ffn_hidden_size",
               "max_position_embeddings", "make_vocab_size_divisible_by")
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff")
"""Fields a dense model (`num_experts=0`) does not use."""
FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM"}
"""HF `model_type` -> `architectures` entry of the families `ModelArch` describes."""
_ROPE_DEFAULTS = {"qwen3_moe": 1_000_000.0, "qwen3": 1_000_000.0, "llama": 10_000.0}


@dataclass(kw_only=True)
class ModelArch:
    """Architecture of a Qwen3-MoE, dense Qwen3 or Llama model (see the module docstring)."""

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
    """Routed experts per layer (`num_experts`); 0 = a dense model (MLP layers)."""
    moe_router_topk: int = 2
    """Experts per token (`num_experts_per_tok`); MoE only."""
    moe_ffn_hidden_size: int = 64
    """Expert FFN width (`moe_intermediate_size`); MoE only."""
    ffn_hidden_size: int | None = None
    """Dense MLP width (`intermediate_size`); required when num_experts=0, null for MoE."""
    qk_layernorm: bool = True
    """RMSNorm on queries and keys per head (`q_norm`/`k_norm`): Qwen3 yes, Llama no."""
    tie_word_embeddings: bool = False
    """Output layer shares the input embedding (`tie_word_embeddings`; SmolLM2: true)."""
    rotary_base: float = 1_000_000.0
    """RoPE base (`rope_theta`)."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon (`rms_norm_eps`), kept exactly as the HF config writes it."""
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
        if self.num_experts < 0:
            problems.append(f"num_experts={self.num_experts} must be >= 0 (0 = dense)")
        if self.is_moe:
            if self.moe_router_topk > self.num_experts:
                problems.append(f"moe_router_topk={self.moe_router_topk} > num_experts="
                                f"{self.num_experts}")
            if self.ffn_hidden_size is not None:
                problems.append(f"ffn_hidden_size={self.ffn_hidden_size} is for dense models "
                                "(num_experts=0); an MoE model's FFN width is moe_ffn_hidden_size")
            if not self.qk_layernorm:
                problems.append("num_experts>0 with qk_layernorm=false is no supported family "
                                "(Qwen3-MoE has q/k norms)")
        elif self.ffn_hidden_size is None:
            problems.append("num_experts=0 (dense) needs ffn_hidden_size (HF intermediate_size)")
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> str:
        """HF `model_type`: qwen3_moe (MoE), qwen3 (dense, qk norm) or llama (dense, none)."""
        if self.is_moe:
            return "qwen3_moe"
        return "qwen3" if self.qk_layernorm else "llama"

    @property
    def mlp_width(self) -> int:
        """Width of one MLP (dense) or of one expert (MoE)."""
        return self.moe_ffn_hidden_size if self.is_moe else self.ffn_hidden_size

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

    def differences(self, other: ModelArch) -> list[str]:
        """`name: mine vs theirs` for every checkpoint field that differs (None vocab skipped;
        the MoE fields are skipped when both models are dense)."""
        out = []
        both_dense = not self.is_moe and not other.is_moe
        for name in self.checkpoint_fields():
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "vocab_size" and mine is None:
                continue
            if both_dense and name in MOE_FIELDS:
                continue
            if mine != theirs:
                out.append(f"{name}={mine!r}, checkpoint has {theirs!r}")
        return out

    # ------------------------------------------------------------------ conversions

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "model") -> ModelArch:
        """From a mapping (unknown keys are an error listing the valid ones)."""
        return from_mapping(cls, data, path)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def qwen3_30b_a3b(cls) -> ModelArch:
        """Qwen3-30B-A3B (HF config of Qwen/Qwen3-30B-A3B)."""
        return cls(vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
                   num_query_groups=4, head_dim=128, num_experts=128, moe_router_topk=8,
                   moe_ffn_hidden_size=768, rotary_base=1_000_000.0, norm_epsilon=1e-6,
                   max_position_embeddings=40960, make_vocab_size_divisible_by=128,
                   moe_aux_loss_coeff=0.001)

    @classmethod
    def smollm2_135m(cls) -> ModelArch:
        """SmolLM2-135M(-Instruct) (HF config of HuggingFaceTB/SmolLM2-135M-Instruct): Llama,
        tied embeddings, 9 query / 3 KV heads (TP must divide 3)."""
        return cls(vocab_size=49152, hidden_size=576, num_layers=30, num_attention_heads=9,
                   num_query_groups=3, head_dim=64, num_experts=0, ffn_hidden_size=1536,
                   qk_layernorm=False, tie_word_embeddings=True, rotary_base=100_000.0,
                   norm_epsilon=9.999999747378752e-06, max_position_embeddings=8192)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *,
                       make_vocab_size_divisible_by: int = 128) -> ModelArch:
        """From an HF `config.json` of model_type qwen3_moe, qwen3 or llama; refuses features the
        mapping does not cover (naming each)."""
        family = cfg.get("model_type") or "qwen3_moe"
        if family not in FAMILIES:
            raise ConfigError(f"unsupported HF config: model_type={family!r}; supported: "
                              f"{', '.join(FAMILIES)}")
        problems = _unsupported_features(cfg, family)
        if problems:
            raise ConfigError(f"unsupported HF {family} config:\n  " + "\n  ".join(problems))
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5.x nests it in rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta",
                                                                 _ROPE_DEFAULTS[family])
        kwargs: dict[str, Any] = {}
        if family == "qwen3_moe":
            kwargs = dict(num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
                          moe_router_topk=cfg["num_experts_per_tok"],
                          moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                          moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))
        else:
            kwargs = dict(num_experts=0, ffn_hidden_size=cfg["intermediate_size"],
                          qk_layernorm=family == "qwen3")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_query_groups=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rotary_base=float(rope_theta),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            init_method_std=float(cfg.get("initializer_range", 0.02)),
            **kwargs,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF config dict of this architecture's family (for exports and tiny test models)."""
        family = self.family
        cfg: dict[str, Any] = {
            "architectures": [FAMILIES[family]], "model_type": family,
            "vocab_size": self.require_vocab(), "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups, "head_dim": self.head_dim,
            "rope_theta": self.rotary_base, "rms_norm_eps": self.norm_epsilon,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False,
            "hidden_act": "silu", "initializer_range": self.init_method_std,
        }
        if family == "qwen3_moe":
            cfg.update({
                "num_experts": self.num_experts, "num_experts_per_tok": self.moe_router_topk,
                "moe_intermediate_size": self.moe_ffn_hidden_size,
                "intermediate_size": self.moe_ffn_hidden_size * self.moe_router_topk,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "router_aux_loss_coef": self.moe_aux_loss_coeff,
            })
        elif family == "qwen3":
            cfg.update({"intermediate_size": self.ffn_hidden_size, "use_sliding_window": False})
        else:
            cfg.update({"intermediate_size": self.ffn_hidden_size, "mlp_bias": False,
                        "pretraining_tp": 1})
        return cfg



def _unsupported_features(cfg: dict[str, Any], family: str) -> list[str]:
    """Every HF config feature of `family` the megatron mapping does not reproduce."""
    problems = []
    if cfg.get("attention_bias", False):
        problems.append("attention_bias=True is not supported")
    if cfg.get("mlp_bias", False):
        problems.append("mlp_bias=True is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg.get('hidden_act')!r}, expected 'silu'")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            problems.append(f"{key}={rope} is not supported (only default RoPE)")
    if cfg.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={cfg.get('pretraining_tp')} is not supported")
    if cfg.get("use_sliding_window", False):
        problems.append("use_sliding_window=True is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types {sorted(set(layer_types))} is not supported (only "
                        "full_attention)")
    if family == "qwen3_moe":
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            problems.append("dense (mlp_only_layers / decoder_sparse_step != 1) layers are not "
                            "supported")
        if not cfg.get("norm_topk_prob", True):
            problems.append("norm_topk_prob=False is not supported (megatron renormalises top-k)")
    return problems


# ---------------------------------------------------------------------- printer (cluster scripts)

_PRESETS = {"qwen3-30b-a3b": ModelArch.qwen3_30b_a3b, "smollm2-135m": ModelArch.smollm2_135m}
# megatron-style flag of each shape field (the flags Megatron-LM's pretrain_gpt takes for the same
# value); the MoE ones only for an MoE model, --ffn-hidden-size only for a dense one
_MEGATRON_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
    "head_dim": "--kv-channels", "num_experts": "--num-experts",
    "moe_router_topk": "--moe-router-topk", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "rotary_base": "--rotary-base", "norm_epsilon": "--norm-epsilon",
    "max_position_embeddings": "--max-position-embeddings", "vocab_size": "--vocab-size",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
}
_MOE_ONLY = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size")
_DENSE_SETS = ("qk_layernorm", "tie_word_embeddings")  # switches a dense model states in `sets`


def _shape_fields(arch: ModelArch) -> list[str]:
    """The `_MEGATRON_FLAGS` fields that apply to `arch` (MoE or dense)."""
    skip = ("ffn_hidden_size",) if arch.is_moe else _MOE_ONLY
    return [name for name in _MEGATRON_FLAGS if name not in skip]


def _set_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_arch(arch: ModelArch, fmt: str) -> str:
    """`shell`: ARCH_<FIELD>=value lines; `flags`: megatron-style flags, one token per line;
    `sets`: the driver's `--set model.<field>=value` overrides of the architecture fields, one
    token per line (what the cluster scripts pass, so their config file restates no shape).
    A dense model gets no MoE flags but --ffn-hidden-size; a tied one no --untie flag."""
    data = arch.to_dict()
    if fmt == "sets":
        names = _shape_fields(arch)
        if not arch.is_moe:
            names = ["num_experts"] + names + list(_DENSE_SETS)
        return "\n".join(tok for name in names
                         for tok in ("--set", f"model.{name}={_set_value(data[name])}"))
    if fmt == "shell":
        return "\n".join(f"ARCH_{k.upper()}={v}" for k, v in data.items())
    if fmt == "flags":
        tokens = []
        for name in _shape_fields(arch):
            value = data[name]
            tokens += [_MEGATRON_FLAGS[name], str(int(value) if name == "rotary_base" else value)]
        tokens += ["--group-query-attention"]
        tokens += ["--qk-layernorm"] if arch.qk_layernorm else []
        tokens += ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                   "--position-embedding-type", "rope"]
        tokens += [] if arch.tie_word_embeddings else ["--untie-embeddings-and-output-weights"]
        if arch.is_moe:
            tokens += ["--moe-router-score-function", "softmax", "--moe-router-dtype", "fp32"]
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
