"""Run configuration of the RL driver: one typed tree, parsed by `megatron_pdm.configtree`.

`RunConfig.load(path, overrides)` reads a yaml file whose top-level sections map onto the
dataclasses below; `overrides` are `dotted.key=value` strings (`--set train.lr=3e-5`). Values
are converted by field type, an unknown key anywhere is a `ConfigError` listing the valid keys of
its section, and every section checks its own values (Literal fields, ranges) in `__post_init__`;
rules that span sections live in `RunConfig.__post_init__`.

Two sections are the library's own types: `model` is `megatron_pdm.arch.ModelArch` (the same
dataclass the converter writes to `pdm_model.json`) and `loss` is
`megatron_pdm.config.PolicyLossConfig` (`loss.preset` picks a preset, every other `loss.*` key
overrides a field of it). The `rollout` section (`RolloutConfig` and its per-engine sections)
lives with the rollout side, in train/rollout/config.py. Only our knobs live here; megatron's own
settings are derived from `model` + `parallel` + `precision` (mcore/model.py,
train/model_setup.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_pdm.arch import ModelArch
from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.configfile import read_yaml, write_yaml
from megatron_pdm.configtree import (
    ConfigError,
    apply_override,
    check_fields,
    check_positive,
    from_mapping,
    to_plain,
)
from megatron_pdm.train.rollout.config import RolloutConfig

__all__ = [
    "CheckpointConfig", "LogConfig", "ParallelConfig", "PrecisionConfig", "RunConfig",
    "TaskConfig", "TrainConfig", "WarmupConfig",
]


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 2
    """Tensor-parallel size (sequence parallelism on when > 1)."""
    ep: int = 1
    """Expert-parallel size (expert tensor parallel size is always 1)."""
    pp: int = 1
    """Pipeline-parallel size (megatron's 1F1B schedule; needs a server rollout engine)."""
    use_distributed_optimizer: bool = True
    """megatron DistributedOptimizer (with the docs/cpu-megatron.md §5.3 checkpoint
    workarounds); False gives the plain FP32Optimizer."""

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        check_positive("parallel", self, "tp", "ep", "pp")


@dataclass(kw_only=True)
class TaskConfig:
    name: Literal["addition", "jsonl", "arithmetic"] = "addition"
    """"addition": a+b, zero-padded operands, answer digits least significant first;
    "jsonl": prompts from `path` tokenized with the HF tokenizer in `tokenizer_dir`;
    "arithmetic": generated word problems (train/word_task.py) through the chat template of
    the HF tokenizer in `tokenizer_dir`, exact-match reward of the final number."""
    path: str | None = None
    """jsonl: one JSON object per line with "prompt" and "answer"."""
    tokenizer_dir: str | None = None
    """jsonl, arithmetic: local HF tokenizer directory (AutoTokenizer, local files only)."""
    max_operand: int = 20
    """arithmetic: operands are drawn from [2, max_operand]."""
    eval_fraction: float = 0.0
    """jsonl: last fraction of the file held out for the greedy evaluation (0: no evaluation);
    a training prompt identical to a held-out one is dropped from training."""
    heldout_fraction: float = 0.2
    """addition, arithmetic: fraction of the arithmetic facts that are evaluation only
    (train/heldout.py: a digest of the fact decides; training streams never draw them)."""
    num_digits: int = 2
    """addition: digits per operand."""
    operand_order: Literal["msb_first", "lsb_first"] = "msb_first"
    """addition: digit order of the operands in the prompt ("lsb_first" writes them least
    significant digit first, like the answer, so answer digit i sits at a fixed distance from
    the operand digits it sums)."""
    num_filler_tokens: int = 3
    """addition: unused vocabulary entries (makes the vocabulary a non-multiple of megatron's
    padding)."""
    partial_credit: bool = False
    """addition: reward = fraction of answer positions (digits + eos) that are correct instead
    of exact match (a denser signal, used by tests on untrained models)."""

    def __post_init__(self) -> None:
        check_fields(self, "task")
        check_positive("task", self, "num_digits")
        check_positive("task", self, "num_filler_tokens", allow_zero=True)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"task.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError(f"task.heldout_fraction={self.heldout_fraction} must be in (0, 1)")
        if self.max_operand < 2:
            raise ConfigError(f"task.max_operand={self.max_operand} must be >= 2")
        if self.name in ("jsonl", "arithmetic"):
            needed = ("path", "tokenizer_dir") if self.name == "jsonl" else ("tokenizer_dir",)
            missing = [k for k in needed if not getattr(self, k)]
            if missing:
                raise ConfigError(f"task.name={self.name} needs " +
                                  " and ".join(f"task.{k}" for k in missing))


@dataclass(kw_only=True)
class WarmupConfig:
    steps: int = 650
    """Supervised steps on correct answers before RL (gives a non-zero starting reward); with
    `stop_at_accuracy` the most steps the warm-up may take."""
    batch_size: int = 64
    lr: float = 3e-3
    stop_at_accuracy: float | None = None
    """Stop the warm-up at the first check where the engine's greedy accuracy on
    `probe_prompts` held-out prompts (disjoint from the evaluation prompts) reaches this value,
    so RL starts from a measured accuracy rather than from a step count whose outcome depends on
    the machine's floating-point summation order. None: always run `steps`."""
    check_every: int = 10
    """Supervised steps between two probes (with `stop_at_accuracy`)."""
    probe_prompts: int = 128

    def __post_init__(self) -> None:
        check_fields(self, "warmup")
        check_positive("warmup", self, "steps", allow_zero=True)
        check_positive("warmup", self, "batch_size", "lr", "check_every", "probe_prompts")
        if self.stop_at_accuracy is not None and not 0.0 < self.stop_at_accuracy <= 1.0:
            raise ConfigError(f"warmup.stop_at_accuracy={self.stop_at_accuracy} must be in (0, 1]")


@dataclass(kw_only=True)
class TrainConfig:
    iterations: int = 200
    """Rollout batches (each followed by `epochs_per_batch x minibatches_per_iteration`
    optimizer steps)."""
    minibatches_per_iteration: int = 4
    """Minibatches per pass over the rollout batch; each is one optimizer step, and steps
    after the first are off-policy (stale)."""
    epochs_per_batch: int = 1
    """PPO-style epochs: passes over the rollout batch, each a fresh permutation split into
    `minibatches_per_iteration` minibatches. Optimizer steps per rollout batch =
    epochs_per_batch x minibatches_per_iteration (logged as `train/steps_this_batch`)."""
    microbatches_per_minibatch: int = 1
    lr: float = 3e-4
    lr_warmup_steps: int = 0
    """RL optimizer steps over which the learning rate rises linearly to `lr` (step k of the RL
    phase, counted from 0, uses lr * min(1, (k + 1) / lr_warmup_steps); 0 = constant `lr`). RL
    starts with a fresh Adam state, whose first steps move every parameter by about `lr`."""
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    eval_prompts: int = 256
    """Held-out prompts for the greedy exact-match evaluation before/after warm-up and RL."""
    eval_samples: int = 0
    """Sampled accuracy too: this many responses per held-out problem at rollout.temperature
    (0: greedy only). Per-problem results in OUTPUT_DIR/eval.jsonl; intervals and the paired
    gain in summary.json's "heldout" (megatron_pdm/train/evaluation.py)."""
    eval_crosscheck: int = 0
    """Teacher-force the engine's greedy responses to the first this-many held-out problems
    through the trainer's own forward at every evaluation: the share the trainer reproduces
    token by token (eval.jsonl, summary.json "heldout"). Needs parallel.pp=1 and no fused head."""
    eval_interval: int = 0
    """Also evaluate after every `eval_interval`-th RL iteration (0: before and after RL only).
    The accuracies are `summary.json`'s `greedy_acc_by_iteration` (RL iteration -> accuracy, 0
    = before RL) and tensorboard's `eval/greedy_acc_rl_iter<k>`. Evaluations use their own
    seeded generation, so they leave the training run unchanged."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recomputation: "none", "full" (every layer, uniform) or "selective"
    (core attention)."""
    fused_head: bool = False
    """Fused LM head: the last stage's output layer hands the final hidden states and its
    weight shard to the loss, which computes the token statistics chunk by chunk without the
    [tokens, V/TP] logits (mcore/lm_head.py, docs/op.md "Fused LM head in the model"). Same
    loss and gradients; false (default): megatron's output layer materialises the logits."""

    def __post_init__(self) -> None:
        check_fields(self, "train")
        check_positive("train", self, "iterations", "minibatches_per_iteration",
                       "microbatches_per_minibatch", "lr", "epochs_per_batch")
        check_positive("train", self, "weight_decay", "clip_grad", "eval_prompts",
                       "lr_warmup_steps", "eval_interval", "eval_samples", "eval_crosscheck",
                       allow_zero=True)
        if self.eval_crosscheck > self.eval_prompts:
            raise ConfigError(f"train.eval_crosscheck={self.eval_crosscheck} exceeds "
                              f"train.eval_prompts={self.eval_prompts}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be in [0, 1)")


@dataclass(kw_only=True)
class PrecisionConfig:
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    """"fp32" or "bf16" (megatron bf16 params with fp32 main grads and fp32 Adam state)."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """None, "e4m3" or "hybrid" (Transformer Engine FP8 linear layers; CUDA + TE only)."""
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """megatron's fp8_recipe names."""

    def __post_init__(self) -> None:
        check_fields(self, "precision")


@dataclass(kw_only=True)
class CheckpointConfig:
    save_interval: int = 25
    """Save every this many iterations (0: only at the end)."""
    keep_last: int = 2
    """Published checkpoints of this run kept (the highest iterations; 0: all)."""
    allow_fresh_start: bool = False
    """A run without --resume in an output_dir that already holds checkpoints moves them to
    `checkpoints.old-<k>` and starts fresh; false (default): such a start is refused."""
    load_dir: str | None = None
    """Initial weights: a dist checkpoint written by megatron-pdm-convert-hf-to-megatron (with its
    pdm_model.json), loaded at this run's layout. `--resume` from output_dir wins over it."""
    arch_from_load_dir: bool = False
    """Take the architecture from load_dir's pdm_model.json instead of the `model` section
    (otherwise every weight-shaping field of `model` must agree with it)."""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")
        check_positive("checkpoint", self, "save_interval", "keep_last", allow_zero=True)
        if self.arch_from_load_dir and not self.load_dir:
            raise ConfigError("checkpoint.arch_from_load_dir=true needs checkpoint.load_dir")


@dataclass(kw_only=True)
class LogConfig:
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    """RL progress: a tqdm bar on a terminal, one plain line per 5% when stderr is redirected."""
    wandb: bool = False
    """Mirror metrics and evaluations to Weights & Biases (`pip install 'megatron-pdm[wandb]'`;
    WANDB_MODE=offline writes locally without a network)."""
    wandb_project: str = "megatron-pdm"
    wandb_name: str | None = None
    """W&B run name (None: the output directory's name)."""
    save_rollouts: int = 0
    """Keep the scored rollout batches of the last N iterations under `<output_dir>/rollouts/`
    (rank 0 writes `rollout_<iteration>.pt` and deletes older ones; read by
    megatron-pdm-analyze-masks). 0 = off. Size ~ response tokens x (9 (K+1) + 13) bytes per
    batch."""

    def __post_init__(self) -> None:
        check_fields(self, "log")
        check_positive("log", self, "save_rollouts", allow_zero=True)


def check_consistency(cfg: RunConfig) -> None:
    """Rules across sections that need no process group (the world size comes later)."""
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    if samples < cfg.train.minibatches_per_iteration:
        raise ConfigError(
            f"train.minibatches_per_iteration={cfg.train.minibatches_per_iteration} exceeds the "
            f"{samples} samples per iteration (rollout.prompts_per_iteration x group_size)")
    if cfg.train.eval_crosscheck and (cfg.parallel.pp > 1 or cfg.train.fused_head):
        raise ConfigError(
            f"train.eval_crosscheck={cfg.train.eval_crosscheck} needs the full logits on one "
            f"stage: parallel.pp={cfg.parallel.pp} (needs 1) / train.fused_head="
            f"{cfg.train.fused_head} (needs false)")
    for name in ("weight_decay", "clip_grad"):
        if not math.isfinite(getattr(cfg.train, name)):
            raise ConfigError(f"train.{name}={getattr(cfg.train, name)!r} must be finite")


def check_world(cfg: RunConfig, world_size: int) -> None:
    """Rules checked by the CLI on every rank before the process group forms: the layout against
    the world size, samples per minibatch against DP, the sequence length against the model."""
    from megatron_pdm.arch import min_world_size

    p = cfg.parallel
    n = min_world_size(tp=p.tp, pp=p.pp, ep=p.ep)
    if world_size % n:
        raise ConfigError(f"parallel.tp={p.tp} x pp={p.pp} x ep={p.ep} needs a multiple of "
                          f"{n} ranks, got WORLD_SIZE={world_size}")
    seq = cfg.rollout.max_sequence_length
    if seq is None and cfg.task.name == "addition":
        from megatron_pdm.train.task import AdditionTask, Tokenizer

        task = AdditionTask(cfg.task.num_digits,
                            Tokenizer(num_filler_tokens=cfg.task.num_filler_tokens))
        seq = task.prompt_len + task.answer_len
    if seq is not None and seq > cfg.model.max_position_embeddings:
        raise ConfigError(f"model.max_position_embeddings={cfg.model.max_position_embeddings} is "
                          f"shorter than the task's {seq}-token sequences "
                          "(rollout.max_sequence_length or the task's prompt + answer)")
    dp = world_size // (p.tp * p.pp)
    per_mb = (cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
              // cfg.train.minibatches_per_iteration)
    if per_mb < dp:
        raise ConfigError(
            f"{per_mb} samples per minibatch (rollout.prompts_per_iteration x group_size / "
            f"train.minibatches_per_iteration) is fewer than the {dp} data-parallel ranks")


@dataclass(kw_only=True)
class RunConfig:
    seed: int = 1234
    output_dir: str = "runs/tiny_cpu"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelArch = field(default_factory=ModelArch)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig.preset("pdm-agg"))
    """The trust-region method: `preset` plus optional PolicyLossConfig field overrides."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.parallel.pp > 1 and self.rollout.engine == "local":
            raise ConfigError(
                f"parallel.pp={self.parallel.pp} needs a server rollout engine: the local engine "
                "copy would need a pipeline schedule per decode step (rollout.engine=sglang)")
        check_consistency(self)

    def to_dict(self) -> dict:
        """The resolved tree as plain data (what `save` writes)."""
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        return from_mapping(cls, data)

    @classmethod
    def load(cls, path: str | None, overrides: list[str] | None = None) -> RunConfig:
        """yaml file (optional) + `dotted.key=value` overrides -> a validated RunConfig."""
        data: dict = {}
        if path:
            data = read_yaml(path) or {}
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: expected a mapping at top level")
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Writes the resolved config as yaml (loadable with `RunConfig.load`), atomically and
        with its digest line (megatron_pdm/configfile.py)."""
        write_yaml(path, self.to_dict())
