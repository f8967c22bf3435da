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
is own_runs.py; the arguments and the setup both designs share are in study_setup.py.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from megatron_pdm.analysis import plots, report, sources
from megatron_pdm.analysis import snapshot as snap_mod
from megatron_pdm.analysis.criteria import keep_all_config
from megatron_pdm.analysis.megatron_probe import MegatronProbe, verify_all_ranks
from megatron_pdm.analysis.seed_log import SeedLog
from megatron_pdm.analysis.seed_study import measure_seed, token_arrays
from megatron_pdm.analysis.study_setup import (
    StudyArgs,
    gather_setup,
    open_study,
    resolve_config,
    rollouts_dir,
)
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.configtree import ConfigError
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.train.rollout import store as rollout_store
from megatron_pdm.train import schedule as sched

__all__ = ["StudyArgs", "resolve_config", "run_study"]

logger = logging.getLogger(__name__)


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
    saved = rollout_store.list_rollouts(rollouts_dir(a) or "")
    if not saved:
        raise ConfigError(f"--batches saved: no saved rollouts in {rollouts_dir(a)}")
    for _, path in saved:
        batch, it, _ = rollout_store.load_rollout(path)
        yield it, batch, it, cfg.seed  # the driver's own plan


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
        setup = gather_setup(a, cfg, path, ckpt_iteration, trainer, j)
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
