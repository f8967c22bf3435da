"""Run outputs: rank-0 logging helper, metrics.jsonl, TensorBoard scalars and the progress bar.

`metrics.jsonl` contract (tools read it): one JSON object per optimizer step with at least
`step`, `reward/mean`, `pdm/masked_frac` and `mismatch/abs_logprob_diff`, plus every other
`pdm/*` metric of the loss, `iteration`, `minibatch`, `lr`, `grad_norm` and `time/*` (wall-clock
keys, the only ones that differ between an interrupted-and-resumed run and an uninterrupted one).
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings

import torch.distributed as dist

logger = logging.getLogger(__name__)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log_rank0(msg: str, *args, level: int = logging.INFO) -> None:
    """Logs on rank 0 only."""
    if is_rank0():
        logger.log(level, msg, *args)


def setup_logging(level: int = logging.INFO) -> None:
    # Non-zero ranks only report warnings: every rank runs the same loop. Python warnings (from
    # megatron-core and torch) are shown by rank 0 only, once per call site, not once per rank.
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        warnings.simplefilter("ignore")
    logging.basicConfig(level=level if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("rollout_bridge").setLevel(logging.WARNING)  # one line per weight sync
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    # megatron-core is chatty at INFO on every rank.
    logging.getLogger("megatron").setLevel(logging.WARNING)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON line per optimizer step (rank 0) and mirrors scalars to TensorBoard."""

    def __init__(self, output_dir: str, *, resume_step: int | None, tensorboard: bool):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = is_rank0()
        self.tb = None
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        rows = []
        if resume_step is not None and os.path.exists(self.path):
            # Drop rows written after the checkpoint we resume from (an interrupted tail).
            rows = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
        with open(self.path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(output_dir, "tb"), purge_step=(
                    resume_step + 1 if resume_step is not None else None))
            except ImportError:  # pragma: no cover - tensorboard is a declared dependency
                logger.warning("tensorboard not installed; skipping TensorBoard scalars")

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """tqdm bar on rank 0 with reward, masked fraction and train/rollout mismatch."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled and is_rank0():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="RL", unit="it", dynamic_ncols=True)

    def update(self, reward: float, masked: float, mismatch: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{reward:.3f}", masked=f"{masked:.4f}",
                                 mismatch=f"{mismatch:.2e}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
