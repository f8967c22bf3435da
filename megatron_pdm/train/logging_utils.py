"""Run outputs: rank-0 logging helper, metrics.jsonl, TensorBoard / W&B scalars, progress.

`metrics.jsonl` contract (tools read it): one JSON object per optimizer step with at least
`step`, `reward/mean`, `pdm/masked_frac` and `mismatch/abs_logprob_diff`, plus every other
`pdm/*` metric of the loss, `iteration`, `minibatch`, `lr`, `grad_norm` and `time/*` (wall-clock
keys, the only ones that differ between an interrupted-and-resumed run and an uninterrupted one).

TensorBoard (`log.tensorboard`, `<output_dir>/tb`) and Weights & Biases (`log.wandb`, the
optional `wandb` extra) receive every row plus the evaluations (`eval/<name>`: greedy
accuracy before the warm-up, before RL, after RL) and the warm-up's probes
(`warmup/probe_acc`, x = supervised step; in W&B the last probe, in the run summary).
W&B honours its own environment (WANDB_MODE=offline,
WANDB_DIR, WANDB_API_KEY); the run id is kept in `<output_dir>/wandb_id` so `--resume` continues
the same W&B run.

Progress: a tqdm bar when stderr is a terminal, else (redirected logs, CI) one plain line every
5% of the iterations, without carriage returns.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
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


def wandb_module():
    """The wandb package, or a one-line error naming the extra that provides it."""
    try:
        import wandb
    except ImportError:
        from megatron_pdm.configtree import ConfigError

        raise ConfigError("log.wandb=true needs the wandb package: pip install "
                          "'megatron-pdm[wandb]' (or pip install wandb), or set log.wandb=false"
                          ) from None
    return wandb


class MetricsWriter:
    """Appends one JSON line per optimizer step (rank 0); mirrors scalars to TensorBoard / W&B."""

    def __init__(self, output_dir: str, *, resume_step: int | None, tensorboard: bool,
                 wandb: dict | None = None):
        """`wandb`: None, or wandb.init keyword arguments (project, name, config)."""
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = is_rank0()
        self.tb = None
        self.wandb = None
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
        if wandb is not None:
            self.wandb = _wandb_run(output_dir, wandb)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        scalars = {k: v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])

    def scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar outside the per-step rows (evaluations, warm-up probes)."""
        if not self.enabled or not math.isfinite(value):
            return
        if self.tb is not None:
            self.tb.add_scalar(tag, value, step)
        if self.wandb is not None:
            if tag.startswith("warmup/"):  # W&B's x must not go back: warm-up values -> summary
                self.wandb.summary[tag] = value
            else:
                self.wandb.log({tag: value}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def wandb_init_kwargs(cfg) -> dict | None:
    """wandb.init arguments of a run config (None when log.wandb is off)."""
    if not cfg.log.wandb:
        return None
    name = cfg.log.wandb_name or os.path.basename(os.path.normpath(cfg.output_dir))
    return {"project": cfg.log.wandb_project, "name": name, "config": cfg.to_dict()}


def _wandb_run(output_dir: str, init_kwargs: dict):
    """wandb.init with a run id kept in output_dir (resume continues the same run)."""
    wandb = wandb_module()
    id_path = os.path.join(output_dir, "wandb_id")
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:12]  # W&B run ids: lowercase letters and digits
        with open(id_path, "w") as f:
            f.write(run_id)
    # W&B's step is the optimizer step; after --resume, steps it already holds are not rewritten.
    return wandb.init(id=run_id, resume="allow", dir=output_dir, **init_kwargs)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """RL progress on rank 0: a tqdm bar on a terminal, plain lines when stderr is redirected."""

    def __init__(self, total: int, initial: int, enabled: bool, *, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done, self.start_done = total, initial, initial
        self.bar = None
        self.lines = False
        self.t0 = time.time()
        if not (enabled and is_rank0()):
            return
        if _isatty(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="RL", unit="it",
                            dynamic_ncols=True, file=self.stream)
        else:
            self.lines = True
            self.every = max(1, total // 20)

    def update(self, reward: float, masked: float | None, mismatch: float) -> None:
        """`masked` is None or NaN when the batch has no token with a non-zero advantage (every
        group's rewards equal): printed as "n/a", not as a number."""
        self.done += 1
        masked_s = "n/a" if masked is None or masked != masked else f"{masked:.4f}"
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{reward:.3f}", masked=masked_s,
                                 mismatch=f"{mismatch:.2e}")
            self.bar.update(1)
        elif self.lines and (self.done % self.every == 0 or self.done == self.total):
            elapsed = time.time() - self.t0
            rate = (self.done - self.start_done) / elapsed if elapsed > 0 else float("nan")
            left = (self.total - self.done) / rate if rate > 0 else float("nan")
            print(f"RL {self.done}/{self.total} ({100 * self.done // self.total}%) "
                  f"reward {reward:.3f} masked {masked_s} mismatch {mismatch:.2e} | "
                  f"{elapsed:.0f} s, {rate:.2f} it/s, ~{left:.0f} s left",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
