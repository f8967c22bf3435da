"""The `rollout` section of the run config: `RolloutConfig` and its per-engine sections.

`RunConfig.rollout` (train/config.py) is a `RolloutConfig`; its nested sections are
`rollout.sglang` (`SGLangRolloutConfig`), `rollout.weight_sync` (`WeightSyncConfig`, SGLang's
weight sync) and `rollout.vllm` (`VLLMRolloutConfig`). Parsed by `megatron_pdm.configtree` like
every section: each key is documented in its field's docstring, unknown keys are errors, each
section checks its own values in `__post_init__`. The flat `rollout.*` engine keys of earlier
releases are refused with their new place (`ROLLOUT_MOVED_KEYS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_pdm.configtree import ConfigError, check_fields, check_positive

__all__ = ["ROLLOUT_MOVED_KEYS", "RolloutConfig", "SGLangRolloutConfig", "VLLMRolloutConfig",
           "WeightSyncConfig"]


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
        check_positive("rollout.weight_sync", self, "bucket_mb")
        check_positive("rollout.weight_sync", self, "master_port", allow_zero=True)


@dataclass(kw_only=True)
class VLLMRolloutConfig:
    """`rollout.vllm`: the vLLM server (rollout.engine=vllm)."""

    url: str | None = None
    """Base URL of vLLM's OpenAI-compatible server (weights are pushed in memory, no shared
    disk; `python -m megatron_pdm.train.rollout.vllm_server` starts one for a config)."""
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
        check_positive("rollout.vllm", self, "restart_wait_s", "pause_wait_s", allow_zero=True)


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
        check_positive("rollout", self, "prompts_per_iteration", "group_size", "timeout_s",
                       "max_sequence_length", "max_new_tokens", "keep_synced")
        check_positive("rollout", self, "temperature")
        check_positive("rollout", self, "top_logprobs", "max_retries", "staleness",
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
