"""Run configuration of the RL driver: one typed tree, parsed by `megatron_pdm.configtree`.

`RunConfig.load(path, overrides)` reads a yaml file whose top-level sections map onto the
dataclasses below; `overrides` are `dotted.key=value` strings (`--set train.lr=3e-5`). Values
are converted by field type, an unknown key anywhere is a `ConfigError` listing the valid keys of
its section, and every section checks its own values (Literal fields, ranges) in `__post_init__`;
rules that span sections live in `RunConfig.__post_init__`.

Two sections are the library's own types: `model` is `megatron_pdm.arch.ModelArch` (the same
dataclass the converter writes to `pdm_model.json`) and `loss` is
`megatron_pdm.config.PolicyLossConfig` (`loss.preset` picks a preset, every other `loss.*` key
overrides a field of it). Only our knobs live here; megatron's own settings are derived from
`model` + `parallel` + `precision` (mcore/model.py, train/model_setup.py).
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
    from_mapping,
    to_plain,
)

__all__ = [
    "CheckpointConfig", "LogConfig", "ParallelConfig", "PrecisionConfig", "RolloutConfig",
    "RunConfig", "SGLangRolloutConfig", "TaskConfig", "TrainConfig", "VLLMRolloutConfig",
    "WarmupConfig", "WeightSyncConfig",
]


def _positive(section: str, obj, *names: str, allow_zero: bool = False,
              finite: bool = True) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and finite and not math.isfinite(value):
            raise ConfigError(f"{section}.{name}={value!r} must be a finite number")
        if value is not None and (value < 0 if allow_zero else value <= 0):
            raise ConfigError(f"{section}.{name}={value!r} must be "
                              f"{'>= 0' if allow_zero else '> 0'}")


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
        _positive("parallel", self, "tp", "ep", "pp")


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
        _positive("task", self, "num_digits")
        _positive("task", self, "num_filler_tokens", allow_zero=True)
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
class SGLangRolloutConfig:
    """`rollout.sglang`: the SGLang servers (rollout.engine=sglang)."""

    url: str | None = None
    """SGLang server base URL."""
    urls: list[str] | None = None
    """Several SGLang servers instead of one `url` (rollouts are spread over them; every weight
    sync reaches all). Servers, not an sglang-router: the router does not route the weight-sync
    and pause endpoints (docs/engines.md, SGLang)."""
    api_key_env: str = "PDM_SGLANG_API_KEY"
    """Environment variable holding the servers' API key (SGLang --api-key), sent on every
    request. The config holds only the variable's name, never the key."""
    api_key_file: str | None = None
    """File whose first line is the API key (wins over the variable)."""

    def __post_init__(self) -> None:
        check_fields(self, "rollout.sglang")
        if self.url and self.urls:
            raise ConfigError("rollout.sglang.url and rollout.sglang.urls are exclusive")


@dataclass(kw_only=True)
class WeightSyncConfig:
    """`rollout.weight_sync`: how the trainer's weights reach the SGLang servers."""

    mode: Literal["disk", "distributed"] = "disk"
    """"disk" (HF safetensors under rollout.hf_checkpoint, update_weights_from_disk) or
    "distributed" (the live model gathered on rank 0 and broadcast to every server over
    NCCL/gloo with update_weights_from_distributed; no disk)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """mode=distributed: broadcast backend (gloo: CPU servers and tests)."""
    master_addr: str = "127.0.0.1"
    """mode=distributed: address of trainer rank 0 that every server can reach."""
    master_port: int = 0
    """mode=distributed: TCP port of the group's rendezvous on that address (0: free)."""
    bucket_mb: int = 512
    """mode=distributed: bucket size (one request and one broadcast per bucket)."""
    load_format: Literal["flattened_bucket", "per_tensor"] = "flattened_bucket"
    """mode=distributed: one broadcast per bucket or one per tensor."""
    digest: bool = False
    """mode=distributed: hash every pushed tensor on rank 0 and log the digest (costs a sha256
    pass over the model; for tests and audits)."""

    def __post_init__(self) -> None:
        check_fields(self, "rollout.weight_sync")
        _positive("rollout.weight_sync", self, "bucket_mb")
        _positive("rollout.weight_sync", self, "master_port", allow_zero=True)


@dataclass(kw_only=True)
class VLLMRolloutConfig:
    """`rollout.vllm`: the vLLM server (rollout.engine=vllm)."""

    url: str | None = None
    """Base URL of vLLM's OpenAI-compatible server (weights are pushed in memory, no shared
    disk; `python -m megatron_pdm.train.vllm_server` starts one for a config)."""
    api_key_env: str = "PDM_VLLM_API_KEY"
    """Environment variable holding the server's API key (sent on every request; never put the
    key itself in a config)."""
    allow_insecure_dev_routes: bool = False
    """Accept a non-loopback server whose dev routes (/collective_rpc runs worker methods)
    answer without the API key. Refused by default (docs/engines.md, vLLM)."""
    push_dir: str | None = None
    """Weight pushes through a safetensors file in this directory (the server must read it: a
    server on the same machine; /dev/shm keeps it in memory) instead of base64 in the request
    body, which vLLM's HTTP server dropped for a 270 MB push (docs/real-model.md). Digest-checked
    the same way. None: in the body."""
    restart_wait_s: float = 0.0
    """After a connection failure, wait up to this long for the server to come back (a
    supervisor restarting it); a restarted server gets the last weights again and the lost
    samples are re-drawn. 0: no waiting, the run fails with an error naming the samples."""
    pause_wait_s: float = 60.0
    """How long a rollout request answered HTTP 503 by a paused server waits for `/resume`
    before its samples fail (kind "paused", not retried). vLLM 0.33 answers new requests 503
    while paused (0.32 holds them); the client's own weight pushes pause for well under this,
    so a longer pause is someone else's. The wait is not a retry attempt. 0: no waiting."""

    def __post_init__(self) -> None:
        check_fields(self, "rollout.vllm")
        _positive("rollout.vllm", self, "restart_wait_s", "pause_wait_s", allow_zero=True)


# Flat `rollout.*` keys of earlier releases -> their place in the nested sections.
ROLLOUT_MOVED_KEYS = {
    "sglang_url": "sglang.url", "sglang_urls": "sglang.urls",
    "sglang_api_key_env": "sglang.api_key_env", "sglang_api_key_file": "sglang.api_key_file",
    "weight_sync_backend": "weight_sync.backend",
    "weight_sync_master_addr": "weight_sync.master_addr",
    "weight_sync_master_port": "weight_sync.master_port",
    "weight_sync_bucket_mb": "weight_sync.bucket_mb",
    "weight_sync_load_format": "weight_sync.load_format",
    "weight_sync_digest": "weight_sync.digest",
    "vllm_url": "vllm.url", "vllm_api_key_env": "vllm.api_key_env",
    "vllm_allow_insecure_dev_routes": "vllm.allow_insecure_dev_routes",
    "vllm_restart_wait_s": "vllm.restart_wait_s",
}


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_iteration: int = 16
    """Distinct prompts per rollout batch (GRPO groups)."""
    group_size: int = 8
    """Samples per prompt (n)."""
    temperature: float = 1.0
    """Sampling temperature. The rollout batch records it and the loss reads it from there."""
    top_logprobs: int = 8
    """K: how many top log-probs the engine returns per generated token (the behaviour support
    is these K plus the sampled token, S = K + 1). Not a sampling truncation: sampling is never
    truncated (top_k / top_p / min_p are refused)."""
    rollout_precision: Literal["fp32", "bf16", "fp8"] | None = "bf16"
    """Weights of the rollout copy: None/"fp32" (identical to training), "bf16" or "fp8". With a
    server engine: the dtype of the exported weights (fp8 exports bf16 and the server quantises
    on load, `launch_sglang.sh ROLLOUT_PRECISION=fp8`)."""
    fp8_scales: Literal["tensor", "block128"] = "tensor"
    """rollout_precision=fp8 with the local engine: the simulated FP8 scales. "tensor" (one scale per
    weight tensor, i.e. per expert) is what SGLang's `--quantization fp8` gives a BF16 checkpoint
    when it quantises on load (online, per tensor; `launch_sglang.sh`); "block128" (128x128 block
    scales) is what an FP8 checkpoint (e.g. Qwen3-30B-A3B-FP8) carries."""
    engine: Literal["local", "sglang", "vllm"] = "local"
    """"local": LocalEngine over a megatron copy on every rank (CPU demo); "sglang" / "vllm":
    rank 0 requests rollouts from SGLang servers / a vLLM server and broadcasts them."""
    sglang: SGLangRolloutConfig = field(default_factory=SGLangRolloutConfig)
    """engine=sglang: the servers and their API key (`rollout.sglang.*`)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """engine=sglang: disk or broadcast weight sync (`rollout.weight_sync.*`)."""
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    """engine=vllm: the server and its API key (`rollout.vllm.*`)."""
    hf_checkpoint: str | None = None
    """engine=sglang, weight_sync.mode=disk: directory visible to the SGLang servers; the trainer
    writes the current weights as HF safetensors to `<hf_checkpoint>/v<version>` at every
    weight sync."""
    max_sequence_length: int | None = None
    """Prompt + response tokens (None: the task's fixed length). Longer prompts are dropped."""
    max_new_tokens: int | None = None
    """Response cap (None: max_sequence_length - prompt length, or the task's answer length)."""
    sync_at_start: bool = True
    """Server engines: push the trainer's initial weights (version "0") before the first
    rollout, so rollout and training start from identical weights."""
    timeout_s: float = 600.0
    """Server engines: total timeout of one generation request."""
    max_retries: int = 3
    """Server engines: retries of a failed sample before it is reported as failed."""
    topk_transport: Literal["json", "flat_b64", "scoring_b64"] = "json"
    """engine=sglang: "json", "flat_b64" or "scoring_b64" (docs/engines.md)."""
    keep_synced: int = 2
    """engine=sglang: exported weight directories kept on disk (older ones are deleted)."""
    overlap: bool = False
    """Server engines: generate iteration i+1's rollouts while iteration i trains (one-step
    off-policy, as slime's async mode / verl's one-step-off-policy). Each batch records the
    weight version it was generated with; `rollout/staleness` (trainer version minus that) is
    1 from the second iteration on, and the loss's mu is that older policy's log-probs."""
    staleness: int = 0
    """engine=local: rollouts generated by the policy this many optimizer-version syncs behind
    (a queue of the last `staleness + 1` trainer weight copies; the engine copy holds the oldest).
    Iteration i's batch comes from version max(0, i - staleness), so `rollout/staleness` is
    min(i, staleness). Evaluations always use the newest weights. A stress knob for the
    trust-region benchmark (docs/stability.md); server engines get one step of staleness from
    `overlap` instead. 0: on-policy (the default)."""

    @classmethod
    def _from_mapping(cls, data: dict, path: str) -> dict:
        """Refuses the flat engine keys of earlier releases, naming their new place."""
        prefix = f"{path}." if path else ""
        moved = [k for k in ROLLOUT_MOVED_KEYS if k in data]
        if isinstance(data.get("weight_sync"), str):
            raise ConfigError(f"{prefix}weight_sync={data['weight_sync']!r}: the weight sync is "
                              f"a section now; use {prefix}weight_sync.mode="
                              f"{data['weight_sync']}")
        if moved:
            raise ConfigError("; ".join(f"{prefix}{k} moved to {prefix}{ROLLOUT_MOVED_KEYS[k]}"
                                        for k in moved))
        return data

    def __post_init__(self) -> None:
        check_fields(self, "rollout")
        _positive("rollout", self, "prompts_per_iteration", "group_size", "timeout_s",
                  "max_sequence_length", "max_new_tokens", "keep_synced")
        _positive("rollout", self, "temperature")
        _positive("rollout", self, "top_logprobs", "max_retries", "staleness",
                  allow_zero=True)
        if self.staleness and self.engine != "local":
            raise ConfigError(f"rollout.staleness={self.staleness} needs rollout.engine=local (a "
                              "queue of old engine weight copies); server engines: "
                              "rollout.overlap=true gives one version of staleness")
        if self.engine == "sglang":
            missing = [] if (self.sglang.url or self.sglang.urls) else ["sglang.url"]
            if self.weight_sync.mode == "disk" and not self.hf_checkpoint:
                missing.append("hf_checkpoint")
            if missing:
                raise ConfigError("rollout.engine=sglang needs " +
                                  " and ".join(f"rollout.{k}" for k in missing) +
                                  (" (or rollout.sglang.urls)" if "sglang.url" in missing
                                   else "") +
                                  (" (or rollout.weight_sync.mode=distributed)"
                                   if "hf_checkpoint" in missing else ""))
        if self.engine == "vllm" and not self.vllm.url:
            raise ConfigError("rollout.engine=vllm needs rollout.vllm.url")
        if self.overlap and self.engine == "local":
            raise ConfigError("rollout.overlap=true needs a server engine (rollout.engine=sglang "
                              "or vllm): the local engine runs in the trainer's own processes on "
                              "the same cores, so there is nothing to overlap with")


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
        _positive("warmup", self, "steps", allow_zero=True)
        _positive("warmup", self, "batch_size", "lr", "check_every", "probe_prompts")
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
        _positive("train", self, "iterations", "minibatches_per_iteration",
                  "microbatches_per_minibatch", "lr", "epochs_per_batch")
        _positive("train", self, "weight_decay", "clip_grad", "eval_prompts", "lr_warmup_steps",
                  allow_zero=True)
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
        _positive("checkpoint", self, "save_interval", "keep_last", allow_zero=True)
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
        _positive("log", self, "save_rollouts", allow_zero=True)


def check_consistency(cfg: RunConfig) -> None:
    """Rules across sections that need no process group (the world size comes later)."""
    samples = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    if samples < cfg.train.minibatches_per_iteration:
        raise ConfigError(
            f"train.minibatches_per_iteration={cfg.train.minibatches_per_iteration} exceeds the "
            f"{samples} samples per iteration (rollout.prompts_per_iteration x group_size)")
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
