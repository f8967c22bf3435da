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
    pp: int = 1
    """Pipeline-parallel size (megatron's 1F1B schedule; needs rollout.engine=sglang)."""
    use_distributed_optimizer: bool = True
    """megatron DistributedOptimizer (with the cpu-megatron.md §5.3 checkpoint workarounds);
    False gives the plain FP32Optimizer."""


@dataclass(kw_only=True)
class ModelConfig:
    """Qwen3-MoE architecture in miniature.

    With `checkpoint.load_dir` every field must agree with the checkpoint's `pdm_model.json`
    (a mismatch is an error naming the field) unless `from_checkpoint` is true, in which case the
    architecture is taken from the checkpoint and these values are ignored.
    """

    from_checkpoint: bool = False
    """Take the architecture from checkpoint.load_dir's pdm_model.json."""
    vocab_size: int | None = None
    """Model vocabulary (None: the task tokenizer's, or the checkpoint's with load_dir)."""
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
    """"addition": a+b, zero-padded operands, answer digits least significant first;
    "jsonl": prompts from `path` tokenized with the HF tokenizer in `tokenizer_dir`."""
    path: str | None = None
    """jsonl: one JSON object per line with "prompt" and "answer"."""
    tokenizer_dir: str | None = None
    """jsonl: local HF tokenizer directory (AutoTokenizer, local files only)."""
    eval_fraction: float = 0.0
    """jsonl: last fraction of the file held out for the greedy evaluation (0: no evaluation)."""
    num_digits: int = 2
    """Digits per operand."""
    num_filler_tokens: int = 3
    """Unused vocabulary entries (makes the vocabulary a non-multiple of megatron's padding)."""
    partial_credit: bool = False
    """addition: reward = fraction of answer positions (digits + eos) that are correct instead
    of exact match (a denser signal, used by tests on untrained models)."""


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
    """Weights of the rollout copy: None (identical to training), "bf16" or "fp8". With SGLang:
    the dtype of the exported weights (bf16; fp8 exports bf16 and the server quantises on load,
    `launch_sglang.sh ROLLOUT_PRECISION=fp8`)."""
    engine: str = "local"
    """"local": LocalEngine over a megatron copy on every rank (CPU demo); "sglang": rank 0
    requests rollouts from SGLang servers and broadcasts them."""
    sglang_url: str | None = None
    """SGLang server base URL (engine=sglang)."""
    hf_checkpoint: str | None = None
    """engine=sglang: directory visible to the SGLang servers; the trainer writes the current
    weights as HF safetensors to `<hf_checkpoint>/v<version>` at every weight sync."""
    max_sequence_length: int | None = None
    """Prompt + response tokens (None: the task's fixed length). Longer prompts are dropped."""
    max_new_tokens: int | None = None
    """Response cap (None: max_sequence_length - prompt length, or the task's answer length)."""
    sync_at_start: bool = True
    """engine=sglang: push the trainer's initial weights (version "0") before the first
    rollout, so rollout and training start from identical weights."""
    timeout_s: float = 600.0
    """engine=sglang: total timeout of one /generate request."""
    max_retries: int = 3
    topk_transport: str = "json"
    """engine=sglang: "json", "flat_b64" or "scoring_b64" (README, "Binary top-K path")."""
    keep_synced: int = 2
    """engine=sglang: exported weight directories kept on disk (older ones are deleted)."""


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
    recompute: str = "none"
    """Activation recomputation: "none", "full" (every layer, uniform) or "selective"
    (core attention)."""


@dataclass(kw_only=True)
class PrecisionConfig:
    params_dtype: str = "fp32"
    """"fp32" or "bf16" (megatron bf16 params with fp32 main grads and fp32 Adam state)."""
    fp8: str | None = None
    """None, "e4m3" or "hybrid" (Transformer Engine FP8 linear layers; CUDA + TE only)."""
    fp8_recipe: str = "delayed"
    """"delayed", "tensorwise", "blockwise" or "mxfp8" (megatron's fp8_recipe names)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    save_interval: int = 25
    """Save every this many iterations (0: only at the end)."""
    keep_last: int = 2
    load_dir: str | None = None
    """Initial weights: a dist checkpoint written by tools/convert_hf_to_megatron.py (with its
    pdm_model.json), loaded at this run's layout. `--resume` from output_dir wins over it."""
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
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loss: dict = field(default_factory=lambda: {"preset": "pdm-agg"})
    """`preset` plus optional PolicyLossConfig field overrides."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        cfg = _build(cls, data, "")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Refuses unknown enum values and inconsistent settings (all problems at once)."""
        problems = []
        for key, value, allowed in (
                ("rollout.engine", self.rollout.engine, ("local", "sglang")),
                ("rollout.rollout_precision", self.rollout.rollout_precision,
                 (None, "fp32", "bf16", "fp8")),
                ("rollout.topk_transport", self.rollout.topk_transport,
                 ("json", "flat_b64", "scoring_b64")),
                ("precision.params_dtype", self.precision.params_dtype, ("fp32", "bf16")),
                ("precision.fp8", self.precision.fp8, (None, "e4m3", "hybrid")),
                ("precision.fp8_recipe", self.precision.fp8_recipe,
                 ("delayed", "tensorwise", "blockwise", "mxfp8")),
                ("train.recompute", self.train.recompute, ("none", "full", "selective")),
                ("task.name", self.task.name, ("addition", "jsonl"))):
            if value not in allowed:
                problems.append(f"{key}={value!r}, expected one of {list(allowed)}")
        for key, value in (("parallel.tp", self.parallel.tp), ("parallel.ep", self.parallel.ep),
                           ("parallel.pp", self.parallel.pp)):
            if not isinstance(value, int) or value < 1:
                problems.append(f"{key}={value!r}, expected an integer >= 1")
        if self.rollout.engine == "sglang":
            for key in ("sglang_url", "hf_checkpoint"):
                if not getattr(self.rollout, key):
                    problems.append(f"rollout.engine=sglang needs rollout.{key}")
        if self.task.name == "jsonl":
            for key in ("path", "tokenizer_dir"):
                if not getattr(self.task, key):
                    problems.append(f"task.name=jsonl needs task.{key}")
        if self.model.from_checkpoint and not self.checkpoint.load_dir:
            problems.append("model.from_checkpoint=true needs checkpoint.load_dir")
        if problems:
            raise ValueError("invalid config:\n  " + "\n  ".join(problems))

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
