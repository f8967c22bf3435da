"""The driver's opt-in rollout saver, and the loader the mask study uses.

With `log.save_rollouts: N` (> 0) the driver hands every iteration's scored `RolloutBatch` to
`save_rollout`; rank 0 writes `<output_dir>/rollouts/rollout_<iteration:07d>.pt` and deletes all
but the newest N files, so the disk used is bounded by N batches. Each file holds plain
containers only (tensors, lists, numbers, strings), so `torch.load(weights_only=True)` reads it:

    format      "megatron_pdm.rollout/1"
    iteration   the driver's iteration that trained on it; the weights that generated it are
                `batch.weight_version` (= the iteration, i.e. checkpoint iter_<iteration> is its
                on-policy state, unless rollout.overlap generated it one version earlier)
    batch       the RolloutBatch facts (temperature, weight_version, top_logprobs, n,
                num_prompts, vocab_size, validated)
    fields      the samples' tensors concatenated per field (prompt/response ids, behaviour
                log-probs, support ids / log mu / valid, loss mask), with prompt_lengths and
                response_lengths to split them; scalars: finish reason, prompt/group/sample
                index, reward; weight_versions per sample
    config      the run's resolved config tree (RunConfig.to_dict())

Size per file: about (response tokens) x (9 S + 13) bytes with S = K + 1 support slots, plus the
prompts: 64 KB measured for the tiny CPU demo batch (128 samples x 4 tokens, S = 9); ~6 GB for
4,096 samples x 8k tokens at K = 20, so choose N accordingly.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re

import torch
import torch.distributed as dist

from rollout_bridge.core.types import RolloutBatch, RolloutFailure, RolloutSample

__all__ = ["FORMAT", "decode_batch", "encode_batch", "list_rollouts", "load_rollout",
           "rollout_dir", "save_rollout"]

logger = logging.getLogger(__name__)

FORMAT = "megatron_pdm.rollout/1"
_NAME = re.compile(r"^rollout_(\d{7})\.pt$")
_SAMPLE_TENSORS = ("prompt_ids", "response_ids", "behavior_logprob", "support_ids",
                   "support_logprobs", "support_valid", "loss_mask")
_SAMPLE_SCALARS = ("finish_reason", "prompt_index", "group_index", "sample_index", "reward")
_BATCH_FACTS = ("temperature", "weight_version", "top_logprobs", "n", "num_prompts",
                "vocab_size", "validated")


def rollout_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "rollouts")


def list_rollouts(directory: str) -> list[tuple[int, str]]:
    """(iteration, path) of every saved batch in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def _to_plain(batch: RolloutBatch, iteration: int, config: dict) -> dict:
    """Per-sample tensors concatenated along their first dim (one tensor per field, not one per
    sample: a torch.save entry costs far more than a few tokens), lengths kept to split them."""
    smp = batch.samples
    fields = {k: torch.cat([getattr(s, k).detach().cpu() for s in smp]) if smp else
              torch.empty(0) for k in _SAMPLE_TENSORS}
    return {"format": FORMAT, "iteration": int(iteration),
            "batch": {k: getattr(batch, k) for k in _BATCH_FACTS},
            "prompt_lengths": [int(s.prompt_ids.shape[0]) for s in smp],
            "response_lengths": [int(s.response_ids.shape[0]) for s in smp],
            "fields": fields,
            "scalars": {k: [getattr(s, k) for s in smp] for k in _SAMPLE_SCALARS},
            "weight_versions": [s.weight_version for s in smp],
            "config": config}


def _from_plain(data: dict) -> list[RolloutSample]:
    p_len, r_len = data["prompt_lengths"], data["response_lengths"]
    f = data["fields"]
    split = {k: torch.split(f[k], p_len if k == "prompt_ids" else r_len) for k in f}
    out = []
    for i in range(len(r_len)):
        kw = {k: split[k][i].clone() for k in _SAMPLE_TENSORS}
        kw.update({k: data["scalars"][k][i] for k in _SAMPLE_SCALARS})
        version = data["weight_versions"][i]
        out.append(RolloutSample(**kw, meta_info={} if version is None else
                                 {"weight_version": version}))
    return out


def save_rollout(cfg, iteration: int, batch: RolloutBatch) -> str | None:
    """Rank 0 writes the scored batch of `iteration` and keeps the newest `cfg.log.save_rollouts`.

    Args:
        cfg: the run's RunConfig (output_dir, log.save_rollouts; its resolved tree is stored).
        iteration: the driver's iteration that generated the batch.
        batch: the batch, with rewards set.

    Returns:
        The written path on rank 0, None elsewhere or when keep == 0.

    Raises:
        ValueError: a sample without a reward (the batch must be scored first).
    """
    keep = cfg.log.save_rollouts
    if keep <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    missing = [i for i, s in enumerate(batch.samples) if s.reward is None]
    if missing:
        raise ValueError(f"save_rollout: iteration {iteration}: samples {missing[:5]} have no "
                         "reward; score the batch before saving it")
    directory = rollout_dir(cfg.output_dir)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rollout_{iteration:07d}.pt")
    tmp = path + ".tmp"
    torch.save(_to_plain(batch, iteration, cfg.to_dict()), tmp)
    os.replace(tmp, path)  # a reader never sees a half-written file
    for _, old in list_rollouts(directory)[:-keep]:
        os.remove(old)
    return path


def load_rollout(path: str) -> tuple[RolloutBatch, int, dict]:
    """(the scored RolloutBatch, its iteration, the run config dict) of a saved file.

    Raises:
        ValueError: not a file written by `save_rollout` (path named).
    """
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a saved rollout batch (expected format {FORMAT!r})")
    batch = RolloutBatch(samples=_from_plain(data), **data["batch"])
    return batch, int(data["iteration"]), data["config"]


def encode_batch(problems: list, batch: RolloutBatch) -> bytes:
    """A collected (not yet scored) batch and its problems as bytes of plain containers, for the
    checkpoint's train_state (rollout.overlap); `decode_batch` reads it with weights_only=True,
    so a checkpoint holds no pickled object of ours."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "problems": problems, "rollout": _to_plain(batch, -1, {}),
                "failures": [dataclasses.asdict(f) for f in batch.failures]}, buf)
    return buf.getvalue()


def decode_batch(blob: bytes) -> tuple[list, RolloutBatch]:
    """(problems, batch) of `encode_batch`; ValueError on anything else."""
    data = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"checkpoint overlap batch: expected format {FORMAT!r}")
    rollout = data["rollout"]
    batch = RolloutBatch(samples=_from_plain(rollout), **rollout["batch"],
                         failures=[RolloutFailure(**f) for f in data["failures"]])
    return data["problems"], batch
