"""Run configuration of the RL driver: dataclasses, yaml loading, dotted CLI overrides.

`RunConfig.load(path, overrides)` reads a yaml file whose top-level sections map onto the
dataclasses below; an unknown key anywhere is a `ValueError` naming it. `overrides` are
`dotted.key=value` strings (`--set train.lr=3e-5`) whose values are parsed as yaml scalars. The
`loss` section is the core `PolicyLossConfig`: `loss.preset` picks a preset and every other
`loss.*` key overrides a field of it.

Only our knobs live here; megatron's own settings are derived (model.py) from `model` + `parallel`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 2
    """Tensor-parallel size (sequence parallelism on when > 1)."""
    ep: int = 1
    """Expert-parallel size (expert tensor parallel size is always 1)."""
    use_distributed_optimizer: bool = True
    """megatron DistributedOptimizer (with the cpu-megatron.md §5.3 checkpoint workarounds);
    False gives the plain FP32Optimizer."""


@dataclass(kw_only=True)
class ModelConfig:
    """Qwen3-MoE architecture in miniature (vocab_size comes from the task's tokenizer)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 16
    num_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    max_position_embeddings: int = 64
    make_vocab_size_divisible_by: int = 8
    """Megatron pads the output vocab to a multiple of this x TP (the task vocab is not)."""
    init_method_std: float = 0.02
    moe_aux_loss_coeff: float = 0.0


@dataclass(kw_only=True)
class TaskConfig:
    name: str = "addition"
    """"addition": a+b, zero-padded operands, answer digits least significant first."""
    num_digits: int = 2
    """Digits per operand."""
    num_filler_tokens: int = 3
    """Unused vocabulary entries (makes the vocabulary a non-multiple of megatron's padding)."""


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_iteration: int = 16
    """Distinct prompts per rollout batch (GRPO groups)."""
    group_size: int = 8
    """Samples per prompt (n)."""
    temperature: float = 1.0
    top_k: int = 8
    """K of the rollout top-K support (S = K + 1)."""
    rollout_precision: str | None = "bf16"
    """Weights of the rollout copy: None (identical to training), "bf16" or "fp8"."""


@dataclass(kw_only=True)
class WarmupConfig:
    steps: int = 650
    """Supervised steps on correct answers before RL (gives a non-zero starting reward)."""
    batch_size: int = 64
    lr: float = 3e-3


@dataclass(kw_only=True)
class TrainConfig:
    iterations: int = 200
    """Rollout batches (each followed by `minibatches_per_iteration` optimizer steps)."""
    minibatches_per_iteration: int = 4
    """Optimizer steps per rollout batch; steps after the first are off-policy (stale)."""
    microbatches_per_minibatch: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    eval_prompts: int = 256
    """Held-out prompts for the greedy exact-match evaluation before/after warm-up and RL."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save_interval: int = 25
    """Save every this many iterations (0: only at the end)."""
    keep_last: int = 2
    stop_after_iterations: int | None = None
    """Exit after this many iterations of this invocation (simulates an interruption)."""


@dataclass(kw_only=True)
class LogConfig:
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True


@dataclass(kw_only=True)
class RunConfig:
    seed: int = 1234
    output_dir: str = "runs/tiny_cpu"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: dict = field(default_factory=lambda: {"preset": "pdm-agg"})
    """`preset` plus optional PolicyLossConfig field overrides."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return _build(cls, data, "")

    @classmethod
    def load(cls, path: str | None, overrides: list[str] | None = None) -> "RunConfig":
        data: dict = {}
        if path:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data)

    def loss_config(self):
        """The core `PolicyLossConfig` of `loss` (preset + overrides)."""
        from megatron_pdm.config import PolicyLossConfig

        d = dict(self.loss)
        preset = d.pop("preset", "pdm-agg")
        return PolicyLossConfig.preset(preset, **d)


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {prefix or '<root>'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {[prefix + k for k in unknown]}; "
                         f"known in {prefix or '<root>'}: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, prefix + name + ".")
        elif name == "loss":
            if not isinstance(value, dict):
                raise ValueError(f"loss must be a mapping, got {value!r}")
            kwargs[name] = value
        else:
            kwargs[name] = _coerce(value, f.default, prefix + name)
    return cls(**kwargs)


def _coerce(value: Any, default: Any, key: str) -> Any:
    """yaml reads `1e-4` (no dot) as a string: turn numeric strings into the field's type."""
    if isinstance(default, float) and isinstance(value, (str, int)) and not isinstance(
            value, bool):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
    return value


def apply_override(data: dict, item: str) -> None:
    """Applies one `dotted.key=value` override (value parsed as a yaml scalar) to `data`."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r}: {p} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
