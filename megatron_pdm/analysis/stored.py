"""Stored study results (results/mask_study/<name>/results.json) and the docs tables
regenerated from them (`megatron-pdm-study-report`, `make study-report`).

    store(results_json, out_dir)   a small copy of a study's results.json for the repository:
                                   the setup (machine: CPU model, cores, threads; command; seeds;
                                   the resolved run config) and every seed's COUNTS per criterion
                                   and control (no rate, no summary: both are recomputed)
    recompute(stored)              the summary (summary.summarize) from the stored counts, with
                                   the setup's criteria, controls, primary comparison, power
                                   analysis and bootstrap seed
    doc_block(path)                the markdown block a doc shows for one stored file
                                   (`<!-- study-table PATH -->`, megatron_pdm/analysis/doc_blocks.py)
    doc_line(path)                 its pre-registered primary comparison and the controls in one
                                   line (`<!-- study-line PATH -->`, README's headline row)

So a number inside such a block is recomputed from committed per-seed counts by one command,
and tests/analysis/test_stored_results.py fails when a doc's block differs from what the
command generates.
"""

from __future__ import annotations

import functools
import json
import os

from megatron_pdm.analysis import report
from megatron_pdm.analysis.controls import Control
from megatron_pdm.analysis.criteria import build_criteria
from megatron_pdm.analysis.summary import summarize
from megatron_pdm.config import PolicyLossConfig

__all__ = ["doc_block", "doc_line", "load", "recompute", "store"]

_KEEP_SEED = ("seed", "n_tokens", "n_active", "n_shared_state", "staleness", "batch_iteration")


def _counts(entry: dict) -> dict:
    """The counts and sums of one criterion's per-seed entry (rates are recomputed)."""
    return {k: v for k, v in entry.items()
            if k in ("divergence", "delta", "control", "base", "flip")
            or k.startswith(("n_", "sum_", "own_sign_correct", "own_sign_decided"))}


def store(results_json: str, out_dir: str) -> str:
    """Writes the small copy of `results_json` to `<out_dir>/results.json`; returns its path."""
    with open(results_json) as f:
        r = json.load(f)
    per_seed = [{**{k: s[k] for k in _KEEP_SEED if k in s},
                 "criteria": {n: _counts(e) for n, e in s["criteria"].items()}}
                for s in r["per_seed"]]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump(report.plain({"stored_from": results_json, "setup": r["setup"],
                                "per_seed": per_seed}), f, indent=0, sort_keys=True)
        f.write("\n")
    return path


def _loaded(path: str) -> tuple[dict, dict]:
    """(stored file, its recomputed summary), computed once per unchanged file and process."""
    st = os.stat(path)
    return _loaded_cached(os.path.abspath(path), st.st_size, st.st_mtime)


@functools.lru_cache(maxsize=16)
def _loaded_cached(path: str, size: int, mtime: float) -> tuple[dict, dict]:
    stored = load(path)
    return stored, recompute(stored)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def recompute(stored: dict) -> dict:
    """summarize() of the stored per-seed counts (module docstring)."""
    setup = stored["setup"]
    criteria = build_criteria(setup["criteria"], PolicyLossConfig.preset("pdm-agg"),
                              delta_kl=setup["delta_kl"], delta_tv=setup["delta_tv"])
    controls = [Control(**c) for c in setup.get("controls") or []]
    seeds = [dict(s, prediction={}) for s in stored["per_seed"]]
    return summarize(seeds, criteria, controls=controls, primary=setup.get("primary"),
                     power=setup.get("power"), bootstrap_seed=setup.get("bootstrap_seed", 0))


def _ranges(seeds: list) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out, run = [], []
    for s in list(seeds) + [None]:
        if run and (s is None or not isinstance(s, int) or s != run[-1] + 1):
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
            run = []
        if s is not None:
            run.append(s)
    return ", ".join(out)


def _checkpoint_line(path: str) -> list[str]:
    """The studied checkpoint's own numbers (the driver's summary.json stored beside the study
    as checkpoint_summary.json), or nothing when it was not stored."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        c = json.load(f)
    return ["", (f"Checkpoint (checkpoint_summary.json beside it): warm-up {c['warmup_steps']} "
                 f"steps, {c['iterations']} RL iterations (preset {c.get('preset')}, seed "
                 f"{c.get('seed')}, {c.get('torch_threads')} thread(s)); greedy held-out "
                 f"accuracy {c['greedy_acc_before_rl']:.3f} before RL, "
                 f"{c['greedy_acc_after_rl']:.3f} at the checkpoint.")]


def doc_block(path: str, label: str | None = None) -> str:
    """The markdown a doc shows for the stored file `path`, named `label` (default: the path;
    ends with a newline)."""
    stored, summary = _loaded(path)
    setup = stored["setup"]
    m = setup.get("machine") or {}
    lines = [
        (f"Regenerated by `megatron-pdm-study-report --update-doc` from `{label or path}` "
         "(per-seed counts "
         f"of {summary['seeds']} seeds: {_ranges(setup['seeds'])}). Machine: "
         f"{m.get('cpu_model', 'not recorded')}, {m.get('cpu_count', '?')} cores, "
         f"{m.get('torch_threads', '?')} torch thread(s) per process (OMP_NUM_THREADS="
         f"{m.get('omp_num_threads')}), {setup.get('world_size')} processes, torch "
         f"{m.get('torch_version', '?')}. Design {setup.get('design')}, source "
         f"{setup.get('source')} (minibatch {setup.get('minibatch')}), δ = "
         f"{setup.get('delta_kl')}, checkpoint iteration {setup.get('checkpoint_iteration')}, "
         f"wall time {report._num(setup.get('wall_s'), 0)} s."),
        *_checkpoint_line(os.path.join(os.path.dirname(path), "checkpoint_summary.json")),
        "",
        *report.criteria_table(summary),
        "",
        *report.paired_table(summary),
        "",
        *report.inference_lines(summary),
    ]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def doc_line(path: str) -> str:
    """One line (no newline) for README's headline row: the seeds, the pre-registered primary
    comparison with its tests and verdict, and whether the controls behaved."""
    stored, summary = _loaded(path)
    setup = stored["setup"]
    prim = [p for p in summary["paired"] if p["primary"]]
    if not prim:
        raise ValueError(f"{path}: no primary comparison recorded (setup.primary)")
    p = prim[0]
    m = setup.get("machine") or {}
    line = (f"{summary['seeds']} seeds ({_ranges(setup['seeds'])}), "
            f"{m.get('torch_threads', '?')} thread(s): primary {p['criterion']} - "
            f"{p['baseline']} (unsafe-keep rate) {report._pp(p['mean_difference'])}, "
            f"{p['wins']} / {p['losses']} / {p['ties']} seeds lower / higher / tied, sign-flip "
            f"p {report._p(p['sign_flip_p'])}, Holm p {report._p(p['p_holm'])}: "
            f"**{p['verdict']}**")
    cc = summary.get("controls_check")
    if cc:
        parts = [f"{v['kind']} control {'behaved' if v['ok'] else 'FAILED'} ({v['verdict']}, "
                 f"Holm p {report._p(v['p_holm'])})" for n, v in cc.items() if n != "ok"]
        line += "; " + "; ".join(parts)
    return line
