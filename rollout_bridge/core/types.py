"""Data types and errors of the rollout bridge.

What: the per-sample rollout record (`RolloutSample`), the batch handed to the trainer
(`RolloutBatch`, including every prompt that could not be generated as a `RolloutFailure`), the
row-aligned tensor batch (`PackedBatch`, see docs/design.md) and the error classes.

Why: one format shared by the SGLang client and the in-process engine, so that the trainer never
knows which engine produced a rollout. All logprobs are *after* temperature: they are
`log_softmax(logits / temperature)` over the engine's full (unpadded) vocabulary, evaluated before
any top-k / top-p / min-p truncation (that is what SGLang returns; see docs/engines.md, SGLang).

Support layout (docs/math.md §3.9), width S = K + 1 per response token:
  * slots 0..K-1 hold the engine's top-K in rank order (descending logprob);
  * if the sampled token is among them, its slot holds the independently returned sampled-token
    logprob; otherwise the sampled token sits in slot K;
  * unused slots (sampled token inside the top-K, short or ragged top-K lists) have
    `valid=False`, id 0 and logprob -inf. An invalid slot is never id 0 / logprob 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class RolloutValidationError(ValueError):
    """A rollout response failed validation.

    Attributes:
        sample_index: Index of the offending sample in the parsed response (or batch), or None.
        position: Response token position (0-based), or None when the error is not positional.
    """

    def __init__(self, message: str, sample_index: int | None = None,
                 position: int | None = None):
        where = []
        if sample_index is not None:
            where.append(f"sample {sample_index}")
        if position is not None:
            where.append(f"position {position}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)
        self.sample_index = sample_index
        self.position = position


class SamplingParamsError(ValueError):
    """Sampling parameters would make the returned logprobs differ from the sampling policy."""


class RolloutFailedError(RuntimeError):
    """Raised by `generate(..., raise_on_failure=True)` when some prompts produced no sample."""

    def __init__(self, failures: list[RolloutFailure]):
        lines = ", ".join(f"prompt {f.prompt_index}/{f.sample_index} ({f.error})"
                          for f in failures[:5])
        more = f" and {len(failures) - 5} more" if len(failures) > 5 else ""
        super().__init__(f"{len(failures)} rollout(s) failed: {lines}{more}")
        self.failures = failures


class StaleRolloutError(RuntimeError):
    """A rollout was generated with weights other than the ones the trainer expects."""


class EngineMismatchError(RuntimeError):
    """The server's model, vocabulary or health does not match what the trainer expects."""


class WeightSyncError(RuntimeError):
    """A weight update was refused or failed (generation was resumed before raising)."""


@dataclasses.dataclass
class RolloutSample:
    """One generated response with its behavior-policy support.

    Shapes: T = number of response tokens, S = K + 1. Logprobs are tempered (see module doc).

    Attributes:
        prompt_ids: [P] int64 prompt token ids.
        response_ids: [T] int64 sampled token ids (the engine's `output_ids`).
        behavior_logprob: [T] fp32 log mu(sampled token), from `output_token_logprobs`.
        support_ids: [T, S] int32 support ids (layout in the module doc).
        support_logprobs: [T, S] fp32 log mu at the support ids; -inf on invalid slots.
        support_valid: [T, S] bool.
        finish_reason: "stop", "length" or "abort" (or another engine string).
        loss_mask: [T] bool, True where the token should carry a loss (default all True).
        prompt_index: Index of the prompt in the `generate` call.
        group_index: GRPO group index (== prompt_index for `generate(..., n)`).
        sample_index: Index of this sample inside its group (0..n-1).
        reward: Reward slot, filled by the caller (None until then).
        meta_info: Free-form metadata: weight_version, num_invalid_slots, num_short_positions,
            sampled_in_topk, the engine's id, latency, ...
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    behavior_logprob: torch.Tensor
    support_ids: torch.Tensor
    support_logprobs: torch.Tensor
    support_valid: torch.Tensor
    finish_reason: str
    loss_mask: torch.Tensor | None = None
    prompt_index: int = 0
    group_index: int = 0
    sample_index: int = 0
    reward: float | None = None
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = torch.ones(self.response_ids.shape[0], dtype=torch.bool)

    @property
    def num_tokens(self) -> int:
        """Number of response tokens T."""
        return int(self.response_ids.shape[0])

    @property
    def weight_version(self) -> str | None:
        """Weight version that generated this sample (from meta_info), if known."""
        return self.meta_info.get("weight_version")


@dataclasses.dataclass
class RolloutFailure:
    """A requested sample that ended without a usable response.

    Attributes:
        prompt_index: Index of the prompt in the `generate` call.
        sample_index: Index of the requested sample inside its group (0..n-1).
        attempts: Number of attempts made.
        error: Description of the last error.
        kind: Short category: "timeout", "connection", "http", "malformed", "abort", "invalid",
            "paused" (a vLLM server paused beyond `pause_wait_s`).
    """

    prompt_index: int
    sample_index: int
    attempts: int
    error: str
    kind: str


@dataclasses.dataclass
class RolloutBatch:
    """Samples of one `generate` call plus the failures; nothing requested is lost.

    For `generate(prompts, params, n)` every pair (prompt_index, sample_index) with
    0 <= sample_index < n appears exactly once, either in `samples` or in `failures`.

    Attributes:
        samples: Generated samples, ordered by (prompt_index, sample_index).
        temperature: Sampling temperature the logprobs are tempered with.
        weight_version: Weight version shared by all samples (None if unknown; a
            comma-joined list if they differ, which `check_weight_version` rejects).
        top_logprobs: K of the support (S = K + 1).
        failures: Requested samples that ended without a response.
        n: Samples requested per prompt.
        num_prompts: Number of prompts in the call.
        vocab_size: The engine's real vocabulary (ids >= vocab_size never occur), or None when
            the engine does not know it. The loss reads it from here.
        validated: Every sample's support was checked against the support contract
            (`megatron_pdm.ops.support.check_support`) when it was produced, so the training
            step can skip re-checking it.
    """

    samples: list[RolloutSample]
    temperature: float
    weight_version: str | None
    top_logprobs: int
    failures: list[RolloutFailure] = dataclasses.field(default_factory=list)
    n: int = 1
    num_prompts: int = 0
    vocab_size: int | None = None
    validated: bool = False

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    def set_rewards(self, rewards: list[float]) -> None:
        """Fills the reward slot of every sample, in `samples` order."""
        if len(rewards) != len(self.samples):
            raise ValueError(f"got {len(rewards)} rewards for {len(self.samples)} samples")
        for sample, reward in zip(self.samples, rewards):
            sample.reward = float(reward)


def group_advantages(batch: RolloutBatch) -> torch.Tensor:
    """Dr.GRPO advantages: reward minus the mean reward of the sample's group (no std scaling).

    Groups are formed from the samples present (failed samples do not enter the mean).

    Args:
        batch: Batch whose samples all have a reward.

    Returns:
        [b] fp32 advantages in `batch.samples` order.
    """
    rewards_b = []
    for i, sample in enumerate(batch.samples):
        if sample.reward is None:
            raise ValueError(f"sample {i} has no reward")
        rewards_b.append(sample.reward)
    rewards_b = torch.tensor(rewards_b, dtype=torch.float64)
    groups_b = torch.tensor([s.group_index for s in batch.samples], dtype=torch.int64)
    adv_b = torch.empty_like(rewards_b)
    for g in torch.unique(groups_b):
        sel = groups_b == g
        adv_b[sel] = rewards_b[sel] - rewards_b[sel].mean()
    return adv_b.float()


def sampled_entropy(batch: RolloutBatch) -> float:
    """Mean -log mu over the sampled response tokens (loss tokens) of the batch: the Monte-Carlo
    estimate of the behaviour policy's entropy on the tokens trained."""
    total, count = 0.0, 0
    for s in batch.samples:
        lp_T = s.behavior_logprob if s.loss_mask is None else s.behavior_logprob[s.loss_mask]
        total += float(-lp_T.double().sum())
        count += int(lp_T.numel())
    return total / max(count, 1)


def frac_solved_groups(rewards: list[float], group: int) -> float:
    """Share of the groups (consecutive runs of `group` rewards) with at least one reward > 0."""
    groups = [rewards[i:i + group] for i in range(0, len(rewards), group)]
    return sum(1.0 for g in groups if max(g) > 0) / max(len(groups), 1)


def check_weight_version(batch: RolloutBatch, expected: str | list[str] | set[str]) -> None:
    """Refuses rollouts generated by weights other than `expected`.

    Checks the batch version and every sample's `meta_info["weight_version"]`.

    Args:
        batch: The rollouts.
        expected: Accepted version (or collection of versions, e.g. for one step of allowed
            staleness).

    Raises:
        StaleRolloutError: If any sample's version is missing or not accepted.
    """
    accepted = {expected} if isinstance(expected, str) else set(expected)
    if batch.weight_version not in accepted:
        raise StaleRolloutError(
            f"batch weight_version {batch.weight_version!r} not in accepted {sorted(accepted)}")
    for i, sample in enumerate(batch.samples):
        if sample.weight_version not in accepted:
            raise StaleRolloutError(
                f"sample {i} (prompt {sample.prompt_index}) has weight_version "
                f"{sample.weight_version!r}, accepted {sorted(accepted)}")


@dataclasses.dataclass
class PackedBatch:
    """Row-aligned training batch (docs/design.md): row p of the logits scores token p+1.

    Padded layout: every tensor is [b, s] (support [b, s, S]) and `cu_seqlens` is None.
    THD layout: every tensor is [1, total] (support [1, total, S]) and `cu_seqlens` [b+1] int32
    marks the sample boundaries; packed rows never cross a sample (the last row of each sample has
    loss_mask False).

    Attributes:
        tokens: int64 prompt+response ids (model input); pad = pad_id.
        position_ids: int64 positions, restarting at 0 per sample.
        labels: int64, labels[..., p] = tokens[..., p+1] (pad_id on the last row of a sample).
        loss_mask: bool, True on rows whose label is a response token with a loss.
        behavior_logprob: fp32 log mu(label) on loss rows, 0 elsewhere.
        support_ids: int32 [..., S]; support_logprobs fp32 [..., S]; support_valid bool [..., S]
            (all-invalid with id 0 / logprob -inf on non-loss rows).
        advantages: fp32 per-sample advantage broadcast to that sample's loss rows, 0 elsewhere.
        seq_ids: int64 sample index in `samples` order, -1 on padding.
        temperature: Temperature the behavior logprobs are tempered with (the loss divides the
            training logits by it; there is no other source).
        weight_version: Weight version of the rollouts.
        vocab_size: The engine's real vocabulary (ids beyond it are megatron padding, excluded
            from the training softmax); None if the engine did not report it.
        validated: The supports were checked when the rollouts were produced.
        cu_seqlens: [b+1] int32 cumulative sample lengths (THD only).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprob: torch.Tensor
    support_ids: torch.Tensor
    support_logprobs: torch.Tensor
    support_valid: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor
    temperature: float
    weight_version: str | None
    vocab_size: int | None = None
    validated: bool = False
    cu_seqlens: torch.Tensor | None = None

    @property
    def is_thd(self) -> bool:
        """True for the packed THD layout."""
        return self.cu_seqlens is not None

    @property
    def num_rows(self) -> int:
        """Rows b of the padded layout (1 for THD)."""
        return int(self.tokens.shape[0])

    def select_rows(self, idx: torch.Tensor) -> PackedBatch:
        """Rows `idx` of a padded batch (a micro-batch); the batch facts are kept."""
        if self.is_thd:
            raise ValueError("select_rows needs the padded layout (THD batches are one row)")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in fields.items():
            if torch.is_tensor(value):
                fields[name] = value[idx]
        return PackedBatch(**fields)

    def flat(self) -> dict[str, torch.Tensor]:
        """Per-token fields flattened to [N] / [N, S] (N = all rows), for `token_stats`."""
        out = {}
        for name in ("tokens", "labels", "loss_mask", "behavior_logprob", "advantages",
                     "seq_ids"):
            out[name] = getattr(self, name).reshape(-1)
        s = self.support_ids.shape[-1]
        for name in ("support_ids", "support_logprobs", "support_valid"):
            out[name] = getattr(self, name).reshape(-1, s)
        return out
