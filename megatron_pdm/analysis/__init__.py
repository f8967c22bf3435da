"""Token-level analysis of the trust-region masks (docs/math.md §3.7).

Does the predictive direction keep fewer unsafe updates? For each seed the study fixes a model +
optimizer state and a batch, computes D, the masks and Ddot of several direction criteria on the
same tokens, takes ONE real optimizer step per criterion from the same state (and two control
steps: momentum only, own gradient only), recomputes D against the stored behaviour policy and
counts what happened to the tokens each mask kept.

Modules (one job each):

    criteria.py       the direction criteria (same proximity and delta; only the direction differs)
    token_table.py    per-token quantities of one evaluation (D, r, A, Ddot terms, masks)
    counting.py       per-seed counts and rates from the before/after tables (shared by the CLI
                      and the closed-form test)
    seed_study.py     one seed: evaluate, snapshot, step per criterion, re-evaluate, restore
    snapshot.py       exact snapshot / restore / verify of a megatron model + optimizer
    megatron_probe.py the Probe over the real megatron model (forward-only stats, one step)
    summary.py        across seeds: pooled and mean rates, the paired comparisons
    inference.py      pooled counts (Wilson), sign-flip / sign tests, Holm, the primary, power check
    controls.py       synthetic positive (oracle) and negative (copy) controls on the same tokens
    stored.py         stored results (results/mask_study/) and the docs tables generated from them
    plots.py          the PNGs (paired per-seed comparison, predicted vs realised, global term)
    report.py         JSON and Markdown outputs
    sources.py        where out-of-region tokens come from (drift / engine precision / staleness)
    power.py          the seed count of the paired test, from an effect and a pilot's spread
    study.py          the whole study (what megatron-pdm-analyze-masks runs under torchrun)
    own_runs.py       design "runs": each criterion's own training run, measured at every step
    real_logits.py    the real model's logits on sampled responses, with bf16 / one-step behaviour
    tail_fidelity.py  the tail estimators against the exact one by tail-mass bin (real_tails tool)

The driver's opt-in rollout saver that feeds it lives in train/rollout/store.py (the driver
may not import this package).
"""
