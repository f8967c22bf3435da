"""Design "runs": each criterion's own training run from the same start, measured at every step.

The paired design (study.py) asks what ONE step from one state does to the tokens each mask
keeps. This design asks what a criterion does along its own training: for every seed s and
criterion c, from the checkpoint's exact state (model + optimizer, restored bit for bit, the
engine re-synced to it):

    for iteration i in 0..run_iterations-1:
        batch = a fresh rollout at the current weights (prompts task.problems(s, I + i, P),
                the local engine seeded by (s, i)); i = 0 is the same batch for every criterion
        for each minibatch j of the driver's plan for (s, I + i):
            measure: D, masks and Ddot before the step; the step with c's OWN loss (the
                     criterion's mask is the training mask); D after, on the same tokens,
                     against the stored behaviour policy (with the decomposition controls
                     from the same state when sgd_lr is set: seed_study.measure_seed)
            train:   that step (the run continues from it)
        sync the engine to the trained weights

so the out-of-region tokens of later steps are the ones THIS criterion's run produced (drift
inside the iteration, the engine copy's precision, and the policy its own earlier masks shaped).
Per seed and criterion the counts of all steps are pooled (one rate per run: unsafe keep,
shrink share, realised mean dD of kept out-of-region tokens), and `summary.summarize` compares
the runs of one seed paired, exactly as the paired design compares its one-step counts.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_pdm.analysis import report, sources
from megatron_pdm.analysis import snapshot as snap_mod
from megatron_pdm.analysis.counting import rate
from megatron_pdm.analysis.megatron_probe import MegatronProbe, verify_all_ranks
from megatron_pdm.analysis.seed_log import SeedLog
from megatron_pdm.analysis.seed_study import measure_seed
from megatron_pdm.analysis.study_setup import gather_setup, open_study
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.mcore import optimizer as mopt
from megatron_pdm.train import schedule as sched

__all__ = ["pool_steps", "run_own_runs"]

logger = logging.getLogger(__name__)

_POOLED_RATES = {  # rate -> (numerator, denominator) recomputed from the pooled counts
    "unsafe_keep_rate": ("n_unsafe_kept", "n_kept_out_of_region"),
    "shrink_share": ("n_shrink_kept", "n_kept_out_of_region"),
    "own_sign_accuracy": ("own_sign_correct", "own_sign_decided"),
    "mean_delta_d_kept_out_of_region": ("sum_delta_d_kept_out_of_region",
                                        "n_kept_out_of_region"),
}


def pool_steps(entries: list[dict]) -> dict:
    """One criterion's per-step `count_seed` entries pooled into one entry: counts and sums
    added, rates recomputed from them (also the "@momentum" / "@gradient" controls')."""
    if not entries:
        raise ValueError("pool_steps: no steps")
    out = {"divergence": entries[0]["divergence"], "delta": entries[0]["delta"],
           "steps": len(entries)}
    for key, v in entries[0].items():
        if key.startswith(("n_", "own_sign_correct", "own_sign_decided", "sum_")) and (
                isinstance(v, (int, float)) and not isinstance(v, bool)):
            out[key] = sum(e[key] for e in entries)
    for suffix in ("", "@momentum", "@gradient"):
        for name, (num, den) in _POOLED_RATES.items():
            n_key = num + suffix
            d_key = den if den == "n_kept_out_of_region" else den + suffix
            if n_key in out:
                out[name + suffix] = rate(out[n_key], out[d_key])
    return out


def _one_run(a, trainer, c, criteria, seed: int, start, stats_dtype, rows: list,
             controls: list = ()) -> dict:
    """Criterion c's run for `seed` from the snapshot `start`; appends a row per step.
    Returns {name: pooled entry} for c and the synthetic controls based on c (controls.py,
    counted at every step of c's run on c's tokens)."""
    cfg = trainer.cfg
    snap_mod.restore_snapshot(start, trainer.model, trainer.optimizer)
    bad = verify_all_ranks(start, trainer.model, trainer.optimizer)
    if bad:
        raise RuntimeError(f"seed {seed}, criterion {c.name}: the start state is not restored "
                           f"bit-exactly ({len(bad)} entries differ, first: {bad[:5]})")
    trainer.sync_weights()  # the engine samples from the start state's weights
    mine = [k for k in controls if k.base == c.name]
    step, it0 = trainer.step, trainer.iteration
    entries: dict[str, list] = {n: [] for n in [c.name] + [k.name for k in mine]}
    for i in range(a.run_iterations):
        it = it0 + i
        batch = sources.fresh_batch(trainer, seed, it, engine_seed=seed * 1000 + i)
        for j, mbs in enumerate(sources.minibatches(trainer, batch, seed, it)):
            lr = sched.rl_lr(cfg.train, step)
            mopt.set_lr(trainer.optimizer, lr)
            probe = MegatronProbe(trainer.model, trainer.optimizer, mbs, criteria,
                                  pp=cfg.parallel.pp, stats_dtype=stats_dtype)
            m = measure_seed(probe, [c], None, tol=a.tol, sgd_lr=a.sgd_lr, controls=mine,
                             control_seed=(seed * 1000 + i) * 100 + j)  # state restored
            probe.step(c.cfg)  # the run's own step (the measured one, taken for real)
            step += 1
            for name, lst in entries.items():
                lst.append(m.counts["criteria"][name])
            e = m.counts["criteria"][c.name]
            rows.append({"seed": seed, "criterion": c.name, "iteration": i, "minibatch": j,
                         "lr": lr, "n_active": m.counts["n_active"],
                         **{k: e.get(k) for k in (
                             "n_out_of_region", "n_kept_out_of_region", "n_unsafe_kept",
                             "n_shrink_kept", "mean_delta_d_kept_out_of_region",
                             "n_unsafe_kept@momentum", "n_unsafe_kept@gradient")}})
        trainer.sync_weights()  # the next iteration samples from this run's weights
    return {name: pool_steps(lst) for name, lst in entries.items()}


def run_own_runs(a) -> dict | None:
    """Design "runs" (module docstring); collective. Returns the results on rank 0."""
    if a.batches != "fresh":
        raise ValueError("design 'runs' generates its own batches along each run: "
                         "use --batches fresh")
    stats_dtype = {"fp64": torch.float64, "fp32": torch.float32}[a.stats_dtype]
    cfg, path, trainer, criteria, j, t_start = open_study(a)
    controls = a.synthetic_controls()
    start = snap_mod.take_snapshot(trainer.model, trainer.optimizer)
    per_seed, rows, seed_times = [], [], []
    seed_log = SeedLog(a.out_dir, enabled=dist.get_rank() == 0)
    for seed in a.seeds:
        t0 = time.time()
        pooled = {}
        for c in criteria:
            pooled.update(_one_run(a, trainer, c, criteria, seed, start, stats_dtype, rows,
                                   controls))
        for entry in pooled.values():  # the disagreement count needs the baseline's entry too
            entry.setdefault("n_disagree", None)
            entry.setdefault("n_disagree_out_of_region", None)
        per_seed.append({"seed": seed, "criteria": pooled, "prediction": {},
                         "n_active": sum(r["n_active"] for r in rows if r["seed"] == seed)})
        # on disk before the next seed (with its per-step rows): a killed study keeps it
        seed_log.append(dict(per_seed[-1], per_step=[r for r in rows if r["seed"] == seed]))
        seed_times.append(time.time() - t0)
        logger.info("seed %s: unsafe-keep %s, %.1f s", seed,
                    {n: p["unsafe_keep_rate"] for n, p in pooled.items()}, seed_times[-1])
    result = None
    if dist.get_rank() == 0:
        import os

        setup = gather_setup(a, cfg, path, trainer.iteration, trainer, j)
        m = cfg.train.minibatches_per_iteration
        setup.update(seeds=list(a.seeds), wall_s=time.time() - t_start,
                     seconds_per_seed=sum(seed_times) / len(seed_times), seed_seconds=seed_times,
                     run_iterations=a.run_iterations, steps_per_run=a.run_iterations * m,
                     batch_source=(f"each criterion's own run: {a.run_iterations} iterations x "
                                   f"{m} steps, fresh rollouts of {cfg.rollout.prompts_per_iteration}"
                                   f" prompts x {cfg.rollout.group_size} samples at the run's "
                                   "current weights"),
                     minibatch="every", stale_steps="0..3 (every step of the run)")
        summary = summarize(per_seed, criteria, controls=controls, primary=a.primary,
                            power=a.power, bootstrap_seed=a.bootstrap_seed)
        os.makedirs(a.out_dir, exist_ok=True)
        report.write_json(os.path.join(a.out_dir, "results.json"), setup, summary, per_seed,
                          per_step=rows)
        with open(os.path.join(a.out_dir, "results.md"), "w") as f:
            f.write(report.markdown(setup, summary))
        result = {"setup": setup, "summary": summary, "per_seed": per_seed,
                  "files": ["results.json", "results.md"]}
    # Barrier (all ranks): no rank returns before rank 0 has written the outputs.
    dist.barrier()
    return result
