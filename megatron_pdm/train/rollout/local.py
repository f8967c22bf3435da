"""The local rollout side of the loop: a separate Megatron copy of the policy behind `LocalEngine`.

Every rank holds a second GPTModel with the trainer's TP/EP layout (the "engine copy"). Weight
sync copies this rank's TP/EP-local trainer parameters into it through
`LocalEngine.update_weights`, which applies the rollout precision (bf16 rounding by default), so
the behavior policy mu differs from the training policy pi the way a bf16 inference engine does.

Lockstep (TP collectives and the EP all-to-all inside the engine copy): `LocalEngine` stops a
batch only when every sequence has finished, and it samples with a generator seeded by
(seed, call counter). `GatheredGPT` gathers the vocab shards and broadcasts rank 0's logits to
every rank, so all ranks see bit-identical logits, sample identical tokens and therefore call the
model the same number of times with the same shapes. It also right-pads inputs to a multiple of
TP (sequence parallelism splits the sequence), which cannot change earlier positions of a causal
model.

Pipeline parallelism is not supported here (the engine copy would need its own pipeline
schedule for every decode step); at scale rollouts come from SGLang (`rollout.engine: sglang`,
sglang.py) or vLLM (`rollout.engine: vllm`, vllm.py), which work with any PP. factory.py picks
the source and builds the engine copy.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from megatron_pdm.mcore.device import current_device
from megatron_pdm.intmath import round_up
from rollout_bridge.local.engine import LocalEngine
from rollout_bridge.core.types import RolloutBatch


class GatheredGPT(torch.nn.Module):
    """`LongTensor [B, L] -> logits [B, L, V_padded]` over a (TP/EP-sharded) GPTModel."""

    def __init__(self, gpt: torch.nn.Module, *, pad_id: int, tp_size: int):
        super().__init__()
        self.gpt = gpt
        self.pad_id = pad_id
        self.tp_size = tp_size

    @torch.no_grad()
    def forward(self, ids_bl: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        b, length = ids_bl.shape
        padded = round_up(length, self.tp_size)
        if padded != length:
            pad = torch.full((b, padded - length), self.pad_id, dtype=ids_bl.dtype,
                             device=ids_bl.device)
            ids_bl = torch.cat([ids_bl, pad], dim=1)
        pos_bl = torch.arange(padded, device=ids_bl.device).expand(b, padded)
        logits_blv = self.gpt(ids_bl, pos_bl, attention_mask=None)  # [b, L, V/TP], causal
        logits_blv = gather_from_tensor_model_parallel_region(logits_blv)[:, :length]
        logits_blv = logits_blv.float().contiguous()
        # Bit-identical logits on every rank => identical samples => lockstep collectives.
        dist.broadcast(logits_blv, src=0)
        return logits_blv


def latest_weights(rollout):
    """Context: the rollout source with its newest weights (LocalRollout with staleness), else
    as it is."""
    return rollout.latest() if hasattr(rollout, "latest") else nullcontext()


def engine_weights(trainer_module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's local parameters under the engine copy's names (`gpt.` prefix)."""
    return {f"gpt.{name}": p.detach() for name, p in trainer_module.named_parameters()}


def build_engine(rollout_gpt: torch.nn.Module, *, vocab_size: int, top_logprobs: int,
                 seed: int, rollout_precision: str | None, eos_id: int, pad_id: int,
                 tp_size: int, fp8_block_size: int | None = None) -> LocalEngine:
    model = GatheredGPT(rollout_gpt, pad_id=pad_id, tp_size=tp_size).eval()
    # Precision is applied by every update_weights; the trainer syncs before the first rollout.
    engine = LocalEngine(model, vocab_size=vocab_size, top_logprobs=top_logprobs, seed=seed,
                         rollout_precision=None, eos_token_id=eos_id, pad_token_id=pad_id,
                         max_batch_size=1 << 20, fp8_block_size=fp8_block_size,
                         device=current_device())
    engine.rollout_precision = rollout_precision
    return engine


class LocalRollout:
    """Rollouts from the in-process engine copy (all ranks in lockstep).

    `staleness` k > 0 (rollout.local.staleness): every sync appends a copy of this rank's trainer
    weights to a queue of the last k + 1 versions and loads the OLDEST into the engine, so
    rollouts come from the policy k versions behind (fewer while fewer exist). `latest()` loads
    the newest copy for the duration of a block (evaluations) and puts the stale one back.
    """

    def __init__(self, engine: LocalEngine, trainer_module_fn, *, staleness: int = 0):
        self.engine = engine
        self._module = trainer_module_fn
        self.staleness = int(staleness)
        self._queue: deque[tuple[str, dict[str, torch.Tensor]]] = deque(maxlen=staleness + 1)

    def generate(self, prompt_ids: list[list[int]], params: dict, n: int) -> RolloutBatch:
        return self.engine.generate(prompt_ids, params, n=n)

    def sync(self, version: str) -> None:
        weights = engine_weights(self._module())
        if not self.staleness:
            self.engine.update_weights(weights, version=version)
            return
        copy_ = (version, {k: v.clone() for k, v in weights.items()})
        if self._queue and self._queue[-1][0] == version:
            self._queue[-1] = copy_  # a re-push of the same version (after the warm-up)
        else:
            self._queue.append(copy_)
        old_version, old = self._queue[0]
        self.engine.update_weights(old, version=old_version)

    @contextmanager
    def latest(self):
        """The newest synced weights in the engine inside the block (no-op when on-policy)."""
        if not self.staleness or len(self._queue) < 2:
            yield
            return
        self.engine.update_weights(self._queue[-1][1], version=self._queue[-1][0])
        try:
            yield
        finally:
            self.engine.update_weights(self._queue[0][1], version=self._queue[0][0])

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def sampling_state(self) -> dict:
        """What seeds the next samples (the engine's call counter); `restore_sampling_state`
        puts it back. Weights are not part of it."""
        return self.engine.state_dict()

    def restore_sampling_state(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        if self.staleness:
            raise ValueError(f"rollout.local.staleness={self.staleness}: the queue of old weight "
                             "copies is not checkpointed, so this run cannot be resumed "
                             "(start it again without --resume)")
        self.engine.load_state_dict(state)
