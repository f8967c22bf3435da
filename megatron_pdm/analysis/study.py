"""The mask study over a run's checkpoint: what `megatron-pdm-analyze-masks` runs under torchrun.

Setup (the driver's own building blocks): `Trainer(cfg)` builds the layout, the megatron model,
the run's optimizer and rollout source from the run config; the chosen dist checkpoint is loaded
into model AND optimizer (Adam state included) with `mcore/checkpoint.load_checkpoint` (or the
model only with `adam_state="fresh"`), its train state (engine counters, RNG) restored, and the
engine synced to its weights.

What a seed is. Every seed starts from the checkpoint's exact state (snapshot, restored bit for
bit before each seed) and gets its own rollout batch:

    fresh  seed s: the batch the driver would generate at the checkpoint's iteration i if its
           seed were s: prompts `task.problems(s, i, P)`, samples from the configured engine at
           the checkpoint's weights (the local engine's sampling generator is seeded by s; a
           server engine samples with its own randomness), rewards, Dr.GRPO advantages.
    saved  seed = one batch saved by the driver (`log.save_rollouts`; all saved batches, oldest
           first); the distance of the weights that generated it to the checkpoint is recorded
           as staleness (0: the checkpoint is the state that generated it, the driver's own
           situation without rollout.overlap).

The batch is split into the driver's minibatches (the driver's permutation for (seed,
iteration)); the driver's own optimizer steps with the run's loss are taken on minibatches
0..j-1, and minibatch j is the study batch: `measure_seed` evaluates it, takes one step per
criterion from that state (and the decomposition controls: the zero-gradient step and plain
SGD on each criterion's masked loss, `sgd_lr`), and counts (seed_study.py, counting.py). Where
the out-of-region tokens come from (`source`, sources.py): drift inside the iteration (default
j: the last minibatch), the engine copy's precision (j = 0), or staleness (whole driver
iterations between generation and study, j = 0). Outputs (rank 0): results.json, results.md,
tokens.npz (per-token arrays of all seeds) and the PNGs of plots.py.

Design "runs" (each criterion's own training run from the same start, measured at every step)
is own_runs.py; it shares `open_study` and `write_outputs`.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from megatron_pdm.analysis import plots, report, sources
from megatron_pdm.analysis import snapshot as snap_mod
from megatron_pdm.analysis.controls import build_controls
from megatron_pdm.analysis.criteria import (
    DEFAULT_CRITERIA,
    build_criteria,
    keep_all_config,
)
from megatron_pdm.analysis.inference import DEFAULT_PRIMARY, parse_primary
from megatron_pdm.analysis.megatron_probe import MegatronProbe, verify_all_ranks
from megatron_pdm.analysis.seed_log import SeedLog
from megatron_pdm.analysis.seed_study import measure_seed, token_arrays
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.configtree import ConfigError, apply_override, check_fields
from megatron_pdm.mcore import checkpoint as ckpt
from megatron_pdm.mcore.device import current_device
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.train import rollout_store
from megatron_pdm.train import schedule as sched
from megatron_pdm.train.config import RunConfig

__all__ = ["StudyArgs", "resolve_config", "run_study"]

logger = logging.getLogger(__name__)


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


def _rollouts_dir(a: StudyArgs) -> str | None:
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
    saved = rollout_store.list_rollouts(_rollouts_dir(a) or "")
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


def study_step_lrs(train_cfg, step0: int, j: int) -> list[float]:
    """Learning rates of the driver's steps on minibatches 0..j of an iteration that starts at RL
    optimizer step `step0`: the trainer's schedule (`train.lr` after `train.lr_warmup_steps`)."""
    return [sched.rl_lr(train_cfg, step0 + k) for k in range(j + 1)]


def _batches(a: StudyArgs, trainer, ckpt_iteration: int):
    """Yields (seed label, batch, iteration, plan seed) per study seed: the minibatches are
    the driver's plan for (plan seed, iteration)."""
    cfg = trainer.cfg
    if a.batches == "fresh":
        for s in a.seeds:
            if a.source == "stale":
                trainer.sync_weights()  # the previous seed's stale steps moved the engine
            batch = sources.fresh_batch(trainer, s, ckpt_iteration)
            yield s, batch, ckpt_iteration, s  # the driver's plan had the run used seed s
        return
    saved = rollout_store.list_rollouts(_rollouts_dir(a) or "")
    if not saved:
        raise ConfigError(f"--batches saved: no saved rollouts in {_rollouts_dir(a)}")
    for _, path in saved:
        batch, it, _ = rollout_store.load_rollout(path)
        yield it, batch, it, cfg.seed  # the driver's own plan


def _server_summary(rollout) -> dict | None:
    """A server engine's start-up facts that say what produced the behaviour policy (vLLM:
    version and serving dtype); None for the in-process engine."""
    info = getattr(rollout, "server_info", None)
    if not isinstance(info, dict):
        return None
    return {k: (None if info.get(k) is None else str(info[k]))
            for k in ("engine", "model", "vllm_version", "dtype")}


def _gather_setup(a, cfg, path, ckpt_iteration, trainer, j) -> dict:
    info = trainer.info
    return {"checkpoint": path, "checkpoint_iteration": ckpt_iteration,
            "checkpoint_step": trainer.step,
            "batch_source": (f"fresh rollouts ({cfg.rollout.engine} engine), "
                             f"{cfg.rollout.prompts_per_iteration} prompts x "
                             f"{cfg.rollout.group_size} samples per seed" if a.batches == "fresh"
                             else f"saved by the driver ({_rollouts_dir(a)})"),
            "batches": a.batches, "minibatch": j, "source": a.source,
            "stale_iterations": a.stale_iterations if a.source == "stale" else 0,
            "stale_steps": j + (a.stale_iterations * cfg.train.minibatches_per_iteration
                                if a.source == "stale" else 0),
            "rollout_precision": cfg.rollout.rollout_precision,
            "engine": cfg.rollout.engine, "engine_server": _server_summary(trainer.rollout),
            "fp8_scales": cfg.rollout.fp8_scales, "sgd_lr": a.sgd_lr, "design": a.design,
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
    """What the numbers depend on besides the seeds: CPU model, cores, threads."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu_model": model or platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
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


def run_study(a: StudyArgs) -> dict | None:
    """Runs the study (collective: every rank of the torchrun job calls it); design "runs" is
    own_runs.run_own_runs.

    Returns:
        The results dict on rank 0 (also written to a.out_dir), None on other ranks.
    """
    if a.design == "runs":
        from megatron_pdm.analysis.own_runs import run_own_runs

        return run_own_runs(a)
    # a.batches, a.seeds, a.adam_state, a.stats_dtype: checked by StudyArgs.__post_init__
    stats_dtype = {"fp64": torch.float64, "fp32": torch.float32}[a.stats_dtype]
    cfg, path, trainer, criteria, j, t_start = open_study(a)
    ckpt_iteration = trainer.iteration
    m_per_it = cfg.train.minibatches_per_iteration
    start = snap_mod.take_snapshot(trainer.model, trainer.optimizer)
    keep_all = keep_all_config(cfg.loss)
    controls = a.synthetic_controls()
    pp = cfg.parallel.pp
    per_seed, tokens, labels, staleness, seed_times = [], [], [], [], []
    seed_log = SeedLog(a.out_dir, enabled=dist.get_rank() == 0)
    for label, batch, it, plan_seed in _batches(a, trainer, ckpt_iteration):
        t0 = time.time()
        snap_mod.restore_snapshot(start, trainer.model, trainer.optimizer)
        bad = verify_all_ranks(start, trainer.model, trainer.optimizer)
        if bad:
            raise RuntimeError(f"seed {label}: the checkpoint state is not restored bit-exactly "
                               f"({len(bad)} entries differ, first: {bad[:5]})")
        step0, applied = trainer.step, []
        if a.source == "stale":  # whole iterations between the batch and the study
            applied += sources.advance_iterations(trainer, plan_seed, it, a.stale_iterations,
                                                  step0)
            step0 += a.stale_iterations * m_per_it
        mbs = sources.minibatches(trainer, batch, plan_seed, it)
        applied += sources.driver_steps(trainer, mbs[:j], step0)  # the driver's steps before j
        mopt.set_lr(trainer.optimizer, study_step_lrs(cfg.train, step0, j)[j])  # the run's lr
        applied.append(trainer.optimizer.param_groups[0]["lr"])
        probe = MegatronProbe(trainer.model, trainer.optimizer, mbs[j], criteria, pp=pp,
                              stats_dtype=stats_dtype)
        m = measure_seed(probe, criteria, keep_all, tol=a.tol, sgd_lr=a.sgd_lr,
                         controls=controls, control_seed=int(label))
        # staleness: checkpoint weights minus the weights that generated the batch (its
        # weight_version when numeric, else the iteration that trained on it), plus the stale
        # source's iterations
        version = str(batch.weight_version)
        stale = ckpt_iteration - (int(version) if version.isdigit() else it)
        if a.source == "stale":
            stale += a.stale_iterations
        m.counts.update(seed=label, batch_iteration=it, batch_weight_version=batch.weight_version,
                        staleness=stale)
        per_seed.append(m.counts)
        seed_log.append(m.counts)  # on disk before the next seed: a killed study keeps it
        arrays = token_arrays(m, criteria)
        arrays["seed"] = torch.full_like(arrays["adv"], float(label))
        tokens.append(arrays)
        labels.append(label)
        staleness.append(stale)
        seed_times.append(time.time() - t0)
        c0 = m.counts["criteria"][criteria[0].name]
        logger.info("seed %s: %d active tokens, %d out of region, unsafe-keep %s (%s), %.1f s",
                    label, m.counts["n_active"], c0["n_out_of_region"],
                    {c.name: m.counts["criteria"][c.name]["unsafe_keep_rate"] for c in criteria},
                    criteria[0].name, seed_times[-1])
    wall = time.time() - t_start
    result = None
    if dist.get_rank() == 0:
        setup = _gather_setup(a, cfg, path, ckpt_iteration, trainer, j)
        setup.update(seeds=labels, staleness=staleness, wall_s=wall, lr_per_step=applied,
                     seconds_per_seed=sum(seed_times) / len(seed_times),
                     seed_seconds=seed_times)
        result = write_outputs(a, setup, per_seed, tokens, criteria, cfg.loss.ratio_cap)
    # Barrier (all ranks): no rank returns (and may tear the group down) before rank 0 has
    # written the outputs.
    dist.barrier()
    return result


def write_outputs(a: StudyArgs, setup: dict, per_seed: list[dict], tokens: list[dict],
                  criteria: list, ratio_cap: float) -> dict:
    """results.json, results.md, tokens.npz and the PNGs into a.out_dir."""
    import numpy as np

    os.makedirs(a.out_dir, exist_ok=True)
    summary = summarize(per_seed, criteria, controls=a.synthetic_controls(), primary=a.primary,
                        power=a.power, bootstrap_seed=a.bootstrap_seed)
    report.write_json(os.path.join(a.out_dir, "results.json"), setup, summary, per_seed)
    with open(os.path.join(a.out_dir, "results.md"), "w") as f:
        f.write(report.markdown(setup, summary))
    keys = list(tokens[0])
    cat = {k: torch.cat([t[k] for t in tokens]) for k in keys}
    np.savez_compressed(os.path.join(a.out_dir, "tokens.npz"),
                        **{k.replace("/", "__"): v.numpy() for k, v in cat.items()})
    files = ["results.json", "results.md", "tokens.npz"]
    kl_pred = [c.name for c in criteria if c.baseline == "ratio"]
    if a.plots and kl_pred:
        title = (f"{len(per_seed)} seeds, D_K > δ = {a.delta_kl:g}, checkpoint iteration "
                 f"{setup['checkpoint_iteration']} ({setup['adam_state']} Adam state), "
                 f"minibatch {setup['minibatch']}, TP={setup['tp']}")
        dis = "pdm-exact" if "pdm-exact" in kl_pred else kl_pred[0]
        files += [os.path.basename(p) for p in plots.plot_all(
            summary, cat, a.out_dir, title=title, ratio_cap=ratio_cap,
            disagree_key=f"disagree/{dis}")]
    return {"setup": setup, "summary": summary, "per_seed": per_seed, "files": files}
