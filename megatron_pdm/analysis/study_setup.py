"""The mask study's arguments and the setup both designs share (study.py: the paired design,
own_runs.py: design "runs"): the run config, the checkpoint, the trainer with the checkpoint
loaded (`open_study`) and the setup record of the results (`gather_setup`).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_pdm.analysis import sources
from megatron_pdm.analysis.controls import build_controls
from megatron_pdm.analysis.criteria import DEFAULT_CRITERIA, build_criteria
from megatron_pdm.analysis.inference import DEFAULT_PRIMARY, parse_primary
from megatron_pdm.configtree import ConfigError, apply_override, check_fields
from megatron_pdm import hostinfo
from megatron_pdm.mcore import checkpoint as ckpt
from megatron_pdm.mcore.device import current_device
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.train.rollout import store as rollout_store
from megatron_pdm.train.config import RunConfig

__all__ = ["StudyArgs", "gather_setup", "open_study", "resolve_config", "rollouts_dir",
           "server_summary"]


@dataclass
class StudyArgs:
    """What the CLI passes (see megatron_pdm/tools/analyze_masks.py for the flags): a typed
    section like the run config's (megatron_pdm/configtree.py): built directly or with
    `from_mapping(StudyArgs, {...})`, every field is checked against its annotation on
    construction, and a bad value is a ConfigError naming its key."""

    out_dir: str
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    run_dir: str | None = None
    checkpoint: str | None = None
    batches: Literal["fresh", "saved"] = "fresh"
    rollouts: str | None = None
    seeds: list[int] = field(default_factory=lambda: list(range(1, 21)))
    """fresh batches: the seeds (saved batches: every saved file is one seed)."""
    criteria: list[str] = field(default_factory=lambda: list(DEFAULT_CRITERIA))
    delta_kl: float = 0.15
    delta_tv: float = 0.2
    minibatch: int | None = None
    tol: float = 0.0
    bootstrap_seed: int = 0
    plots: bool = True
    stats_dtype: Literal["fp64", "fp32"] = "fp64"
    """"fp64" or "fp32": dtype of the statistics in the evaluations (MegatronProbe)."""
    adam_state: Literal["checkpoint", "fresh"] = "checkpoint"
    """"checkpoint" (model + optimizer state) or "fresh" (model only; see `_load`)."""
    source: Literal["drift", "precision", "stale"] = "drift"
    """Where the out-of-region tokens come from (sources.py): drift inside the iteration, the
    engine copy's precision (rollout.rollout_precision), or staleness (`stale_iterations`)."""
    stale_iterations: int = 1
    """source "stale": whole driver iterations trained between the batch and the study."""
    sgd_lr: float | None = 1e-4
    """Step size of the own-gradient control (plain SGD on the masked loss); with it the
    zero-gradient control runs too. None: no decomposition controls."""
    design: Literal["paired", "runs"] = "paired"
    """"paired": every criterion's one step from the same state (this module); "runs": each
    criterion's own training run from the same start, measured at every step (own_runs.py)."""
    run_iterations: int = 3
    """design "runs": RL iterations of each criterion's run (x minibatches steps each)."""
    power: dict | None = None
    """The power analysis that chose the seeds (power.seeds_needed output), recorded in setup."""
    primary: str = DEFAULT_PRIMARY
    """The pre-registered primary comparison "CRITERION:BASELINE[:RATE]" (inference.py),
    named before the run; marked in the results, Holm-adjusted with the other comparisons."""
    controls: str | None = None
    """The base criterion of the synthetic controls (controls.py: its oracle with `control_flip`
    of its wrong decisions set right, and an identical copy); None: no controls."""
    control_flip: float = 0.5
    """The oracle control's probability of setting a wrong decision right."""

    def __post_init__(self):
        check_fields(self)  # types and Literal members, converted like a parsed section
        if not self.seeds:
            raise ConfigError("seeds: at least one seed")
        if self.minibatch is not None and self.minibatch < 0:
            raise ConfigError(f"minibatch={self.minibatch}: must be >= 0")
        if self.stale_iterations < 1:
            raise ConfigError(f"stale_iterations={self.stale_iterations}: must be >= 1")
        if self.sgd_lr is not None and not self.sgd_lr > 0:
            raise ConfigError(f"sgd_lr={self.sgd_lr}: must be > 0 (None: no controls)")
        if self.run_iterations < 1:
            raise ConfigError(f"run_iterations={self.run_iterations}: must be >= 1")
        if not 0.0 <= self.control_flip <= 1.0:
            raise ConfigError(f"control_flip={self.control_flip}: must be in [0, 1]")
        names = list(self.criteria) + [c.name for c in self.synthetic_controls()]
        try:
            parse_primary(self.primary, names)
        except ValueError as exc:
            raise ConfigError(f"primary={self.primary!r}: {exc}") from None

    def synthetic_controls(self) -> list:
        """The synthetic controls (controls.Control) of `controls`, [] without."""
        if self.controls is None:
            return []
        try:
            return build_controls(self.controls, list(self.criteria), flip=self.control_flip)
        except ValueError as exc:
            raise ConfigError(f"controls={self.controls!r}: {exc}") from None


def rollouts_dir(a: StudyArgs) -> str | None:
    if a.rollouts:
        return a.rollouts
    return rollout_store.rollout_dir(a.run_dir) if a.run_dir else None


def resolve_config(a: StudyArgs) -> RunConfig:
    """The run config (+ --set): --config, else `<run-dir>/config.yaml` (the driver writes it),
    else the one stored with the newest saved batch."""
    if a.config:
        return RunConfig.load(a.config, list(a.overrides))
    if a.run_dir and os.path.exists(os.path.join(a.run_dir, "config.yaml")):
        return RunConfig.load(os.path.join(a.run_dir, "config.yaml"), list(a.overrides))
    saved = rollout_store.list_rollouts(rollouts_dir(a) or "")
    if not saved:
        raise ConfigError("no run config: pass --config (the driver's yaml), or a --run-dir "
                          "holding config.yaml or saved rollouts (log.save_rollouts > 0)")
    _, _, data = rollout_store.load_rollout(saved[-1][1])
    for item in a.overrides:
        apply_override(data, item)
    return RunConfig.from_dict(data)


def _checkpoint_path(a: StudyArgs) -> str:
    if a.checkpoint:
        if not os.path.isdir(a.checkpoint):
            raise ConfigError(f"--checkpoint {a.checkpoint}: not a directory")
        return a.checkpoint
    if not a.run_dir:
        raise ConfigError("pass --checkpoint (a dist checkpoint iter_N) or --run-dir")
    path = ckpt.latest_checkpoint(os.path.join(a.run_dir, "checkpoints"))
    if path is None:
        raise ConfigError(f"--run-dir {a.run_dir}: no complete checkpoint in checkpoints/")
    return path


def _load(path: str, trainer, adam_state: str) -> dict:
    """Loads the checkpoint into the trainer's model (and optimizer); returns its train state.

    adam_state "checkpoint": model + optimizer (Adam moments and step) as the run saved them.
    "fresh": the model only, the optimizer as built (no Adam state yet): the state a layout
    change needs when the checkpoint's optimizer state cannot be resharded to it (the CPU
    layouts group expert parameters differently at TP = 1 and TP > 1), and an ablation that
    removes the momentum of the run's earlier steps.
    """
    if adam_state == "checkpoint":
        return ckpt.load_checkpoint(path, trainer.model, trainer.optimizer)
    from megatron.core import dist_checkpointing

    ckpt.load_model(path, trainer.model)
    for sub in mopt.sub_optimizers(trainer.optimizer):
        if hasattr(sub, "reload_model_params"):  # fp32 main copies of 16-bit params
            sub.reload_model_params()
    return dist_checkpointing.load_common_state_dict(path)["train_state"]


def server_summary(rollout) -> dict | None:
    """A server engine's start-up facts that say what produced the behaviour policy (vLLM:
    version and serving dtype); None for the in-process engine."""
    info = getattr(rollout, "server_info", None)
    if not isinstance(info, dict):
        return None
    return {k: (None if info.get(k) is None else str(info[k]))
            for k in ("engine", "model", "vllm_version", "dtype")}


def gather_setup(a, cfg, path, ckpt_iteration, trainer, j) -> dict:
    info = trainer.info
    return {"checkpoint": path, "checkpoint_iteration": ckpt_iteration,
            "checkpoint_step": trainer.step,
            "batch_source": (f"fresh rollouts ({cfg.rollout.engine} engine), "
                             f"{cfg.rollout.prompts_per_iteration} prompts x "
                             f"{cfg.rollout.group_size} samples per seed" if a.batches == "fresh"
                             else f"saved by the driver ({rollouts_dir(a)})"),
            "batches": a.batches, "minibatch": j, "source": a.source,
            "stale_iterations": a.stale_iterations if a.source == "stale" else 0,
            "stale_steps": j + (a.stale_iterations * cfg.train.minibatches_per_iteration
                                if a.source == "stale" else 0),
            "rollout_precision": cfg.rollout.rollout_precision,
            "engine": cfg.rollout.engine, "engine_server": server_summary(trainer.rollout),
            "fp8_scales": cfg.rollout.local.fp8_scales, "sgd_lr": a.sgd_lr, "design": a.design,
            "power": a.power, "primary": a.primary, "bootstrap_seed": a.bootstrap_seed,
            "controls": [vars(c) for c in a.synthetic_controls()],
            "machine": machine(), "command": list(sys.argv),
            "minibatches_per_iteration": cfg.train.minibatches_per_iteration,
            "criteria": list(a.criteria), "delta_kl": a.delta_kl, "delta_tv": a.delta_tv,
            "tol": a.tol, "stats_dtype": a.stats_dtype, "tp": info.tp_size, "dp": info.dp_size,
            "pp": info.pp_size, "ep": info.ep_size, "world_size": info.world_size,
            "optimizer": ("megatron DistributedOptimizer (Adam)"
                          if cfg.parallel.use_distributed_optimizer else "megatron Adam"),
            "adam_state": a.adam_state,
            "lr": cfg.train.lr, "lr_warmup_steps": cfg.train.lr_warmup_steps, "clip_grad": cfg.train.clip_grad, "run_loss": cfg.loss.name,
            "ratio_cap": cfg.loss.ratio_cap, "torch_threads": torch.get_num_threads(),
            "device": str(current_device()),
            "run_config": cfg.to_dict()}


def machine() -> dict:
    """What the numbers depend on besides the seeds: CPU (model, id, torch's kernel ISA), cores,
    threads, versions."""
    return {**hostinfo.machine(), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_version": torch.__version__, "python": platform.python_version()}


def open_study(a: StudyArgs):
    """(cfg, checkpoint path, trainer with the checkpoint loaded, criteria, study minibatch j,
    t_start): the setup both designs share (collective)."""
    from megatron_pdm.train.trainer import Trainer

    cfg = resolve_config(a)
    path = _checkpoint_path(a)
    m = cfg.train.minibatches_per_iteration
    j = sources.default_minibatch(a.source, m) if a.minibatch is None else a.minibatch
    if not 0 <= j < m:
        raise ConfigError(f"--minibatch {j} must be in [0, train.minibatches_per_iteration={m})")
    criteria = build_criteria(a.criteria, cfg.loss, delta_kl=a.delta_kl, delta_tv=a.delta_tv)
    t_start = time.time()
    trainer = Trainer(cfg)
    trainer.load_train_state(_load(path, trainer, a.adam_state))
    if a.batches == "fresh":
        trainer.sync_weights()  # the engine samples from the checkpoint's weights
    return cfg, path, trainer, criteria, j, t_start
