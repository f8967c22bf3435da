"""The study's JSON and Markdown outputs.

`results.json`: {"setup": what was run (checkpoint, batch source, seeds, delta, criteria, layout,
timing), "summary": `summarize` output, "per_seed": the `count_seed` dicts}.

`results.md`: three tables (per criterion; paired comparison against the ratio direction; the
first-order prediction scored against the unmasked step) with the PDM paper's reported numbers
as a reference row, so the comparison is on the page.
"""

from __future__ import annotations

import json
import math

from megatron_pdm.analysis.summary import sign_test_p

__all__ = ["PAPER", "criteria_table", "inference_lines", "markdown", "paired_table", "write_json"]

PAPER = {
    "unsafe_keep_rate_ratio": 0.369, "unsafe_keep_rate_predictive": 0.342, "wins": 38,
    "seeds": 61, "disagree_per_seed": 82, "out_of_region_per_seed": 1435,
    "source": "PDM (arXiv 2607.10848) as summarised in docs/math.md §3.7, §8.1",
}


def plain(x):
    """`x` with every non-finite float replaced by None (JSON has no inf / NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def write_json(path: str, setup: dict, summary: dict, per_seed: list[dict], **extra) -> str:
    """results.json; `extra` (e.g. design "runs"' per_step rows) is stored beside."""
    with open(path, "w") as f:
        json.dump(plain({"setup": setup, "summary": summary, "per_seed": per_seed, **extra}),
                  f, indent=1)
    return path


def _pct(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def _pp(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f} pp"


def _ci(ci, scale: float = 100.0, unit: str = "") -> str:
    return "" if not ci else f" [{scale * ci[0]:.1f}, {scale * ci[1]:.1f}]{unit}"


def _num(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _wilson(r: dict) -> str:
    """"k / n = rate [Wilson 95%]" of a pooled rate summary."""
    if not r.get("n"):
        return "n/a (0 eligible)"
    lo, hi = r["wilson95"]
    return f"{r['k']} / {r['n']} = {_pct(r['pooled'])} [{_pct(lo)}, {_pct(hi)}]"


def criteria_table(summary: dict) -> list[str]:
    header = ("| criterion | D, δ | out-of-region / seed | kept out-of-region / seed | "
              "disagree with ratio (out-of-region / all) / seed | unsafe keep, pooled: "
              "k / n = rate [Wilson 95%] | seeds without a rate | "
              "unsafe-keep rate, seed mean [bootstrap 95%, descriptive] | shrink share, pooled | "
              "own-step sign accuracy |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in summary["criteria"].items():
        u = c["unsafe_keep_rate"]
        dis = ("—" if c["mean_n_disagree"] is None else
               f"{_num(c['mean_n_disagree_out_of_region'])} / {_num(c['mean_n_disagree'])}")
        lines.append(
            f"| {name} | {c['divergence']}, {c['delta']:g} | {_num(c['mean_n_out_of_region'])} | "
            f"{_num(c['mean_n_kept_out_of_region'])} | {dis} | {_wilson(u)} | "
            f"{u.get('n_seeds_no_rate', 'n/a')} | "
            f"{_pct(u['mean'])}{_ci(u['bootstrap_ci95_descriptive'])} | "
            f"{_pct(c['shrink_share']['pooled'])} | "
            f"{_pct(c['own_sign_accuracy']['pooled'])} |")
    return lines


def _controls_table(summary: dict) -> list[str]:
    """Each criterion's rates under its full step and the two controls, side by side."""
    crit = summary["criteria"]
    if not any("unsafe_keep_rate@momentum" in c for c in crit.values()):
        return ["(decomposition controls not run: pass --sgd-lr)"]
    lines = [("| criterion | unsafe-keep rate: full step / momentum only / own gradient | "
              "shrink share: full / momentum / gradient | mean ΔD of kept out-of-region: "
              "full / momentum / gradient | Ḋ sign accuracy on kept tokens: full / momentum / "
              "gradient |"), "|---|---|---|---|---|"]

    def three(c, key, fmt):
        return " / ".join(fmt(c.get(f"{key}{sfx}", {}).get("pooled") if key != "mean_delta_d"
                              else c.get(f"mean_delta_d_kept_out_of_region{sfx}"))
                          for sfx in ("", "@momentum", "@gradient"))

    for name, c in crit.items():
        lines.append(f"| {name} | {three(c, 'unsafe_keep_rate', _pct)} | "
                     f"{three(c, 'shrink_share', _pct)} | "
                     f"{three(c, 'mean_delta_d', lambda x: _num(x, 5) if x is not None else 'n/a')}"
                     f" | {three(c, 'own_sign_accuracy', _pct)} |")
    return lines


def _p(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def paired_table(summary: dict) -> list[str]:
    """The comparisons: seeds entered / run, the two tests, Holm, verdict; primary marked."""
    lines = [("| comparison (unsafe-keep rate) | seeds entered / run (no rate: criterion, "
              "baseline) | wins / losses / ties | mean difference [bootstrap 95%, descriptive] "
              "| SD of the difference | sign-flip p | sign test p | Holm p (sign-flip; family "
              "of all rows) | verdict |"), "|---|---|---|---|---|---|---|---|---|"]
    for p in summary["paired"]:
        ci = p["bootstrap_ci95_descriptive"]
        ci = "" if not ci else f" [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]"
        nr = p["n_seeds_no_rate"]
        sd = "n/a" if p["sd_difference"] is None else f"{100 * p['sd_difference']:.2f} pp"
        name = f"{p['criterion']} vs {p['baseline']}" + (" (**primary**)" if p["primary"] else "")
        lines.append(
            f"| {name} | {p['n_seeds_entered']} / {p['n_seeds_run']} ({nr['criterion']}, "
            f"{nr['baseline']}) | {p['wins']} / {p['losses']} / {p['ties']} | "
            f"{_pp(p['mean_difference'])}{ci} | {sd} | {_p(p['sign_flip_p'])} | "
            f"{_p(p['sign_test_p'])} | {_p(p['p_holm'])} | {p['verdict']} |")
    return lines


def inference_lines(summary: dict) -> list[str]:
    """The power check and the controls check, one paragraph each (empty when absent)."""
    out = []
    pc = summary.get("power_check")
    if pc:
        def pw(x):
            return "n/a" if x is None else f"{x:.2f}"
        sd_m = "n/a" if pc["sd_measured"] is None else f"{100 * pc['sd_measured']:.2f} pp"
        out += [(f"Power ({pc['comparison']}, effect {100 * pc['effect']:+.2f} pp): SD of the "
                 f"per-seed difference assumed {100 * pc['sd_assumed']:.2f} pp "
                 f"({pc['sd_source']}), measured on this study's {pc['n_seeds_entered']} "
                 f"entered seeds {sd_m}; power at {pc['n_seeds_entered']} seeds "
                 f"{pw(pc['power_at_assumed_sd'])} at the assumed SD, "
                 f"{pw(pc['power_at_measured_sd'])} at the measured one (the measured SD would "
                 f"ask {pc['seeds_needed_at_measured_sd'] or 'n/a'} seeds; asked: "
                 f"{pc['seeds_asked']})."), ""]
    cc = summary.get("controls_check")
    if cc:
        parts = [f"{name} ({v['kind']}, flip {v['flip']:g}): expected {v['expected']}, got "
                 f"{v['verdict']} (Holm p {_p(v['p_holm'])}, mean "
                 f"{_pp(v['mean_difference'])}) - {'ok' if v['ok'] else 'FAILED'}"
                 for name, v in cc.items() if name != "ok"]
        out += [("Synthetic controls (counted on their base criterion's step; "
                 "megatron_pdm/analysis/controls.py): " + "; ".join(parts) + "."), ""]
        if not cc["ok"]:
            out += ["**A control failed: the comparisons of this study are not to be read "
                    "as evidence.**", ""]
    return out


def _prediction_table(summary: dict) -> list[str]:
    lines = [("| direction | sign accuracy, all active tokens | out of region | tokens with "
              "a state of their own | tokens sharing their state | on its disagreement set "
              "with ratio: this direction / ratio direction (tokens) |"),
             "|---|---|---|---|---|---|"]
    for name, c in summary["criteria"].items():
        pr = c.get("prediction")
        if not pr:
            continue
        dis = "—"
        if "disagree_accuracy" in pr:
            n = c["total_n_disagree"]
            dis = (f"{_pct(pr['disagree_accuracy']['pooled'])} / "
                   f"{_pct(pr['baseline_disagree_accuracy']['pooled'])} ({n})")
        own = pr.get("accuracy_unique_state", {}).get("pooled")
        shared = pr.get("accuracy_shared_state", {}).get("pooled")
        lines.append(f"| {name} | {_pct(pr['accuracy']['pooled'])} | "
                     f"{_pct(pr['accuracy_out_of_region']['pooled'])} | {_pct(own)} | "
                     f"{_pct(shared)} | {dis} |")
    return lines


def _engine_words(setup: dict) -> str:
    """Who generated the behaviour policy: the in-process engine's copy at its precision, or a
    server (its version and serving dtype, and the precision of the pushed weights)."""
    server = setup.get("engine_server")
    if not server:
        return f"engine copy {setup.get('rollout_precision')}"
    version = server.get("vllm_version")
    return (f"engine {server.get('engine') or setup.get('engine')} server"
            f"{f' {version}' if version else ''} serving in {server.get('dtype') or '?'}, "
            f"weights pushed in {setup.get('rollout_precision')}")


def markdown(setup: dict, summary: dict) -> str:
    """The results page (see the module docstring)."""
    p = PAPER
    if setup.get("design") == "runs":
        where = ("design: each criterion's own training run from the same start, counted at "
                 f"every one of its {setup.get('steps_per_run')} optimizer steps and pooled per "
                 "run (a seed = one run per criterion)")
    else:
        where = (f"design: one step per criterion from the same state, out-of-region source "
                 f"{setup.get('source')}, analysis minibatch {setup.get('minibatch')} after "
                 f"{setup.get('stale_steps')} driver steps since the batch was generated")
    power = setup.get("power")
    head = [
        f"# Token-level mask study: {summary['seeds']} seeds",
        "",
        (f"Checkpoint `{setup.get('checkpoint')}` (iteration "
         f"{setup.get('checkpoint_iteration')}), batches: {setup.get('batch_source')}, {where}, "
         f"{_engine_words(setup)}, "
         f"layout TP={setup.get('tp')} DP={setup.get('dp')} "
         f"PP={setup.get('pp')}, optimizer {setup.get('optimizer')} with "
         f"{setup.get('adam_state')} Adam state, lr {setup.get('lr')}, statistics in "
         f"{setup.get('stats_dtype')}, wall time {_num(setup.get('wall_s'), 0)} s "
         f"({_num(setup.get('seconds_per_seed'), 1)} s per seed)."),
        "",
        *([] if not power else [
            (f"Seeds from the power analysis made before the run: {power['t_test']} for a "
             f"paired difference of {100 * power['effect']:+.2f} pp at a per-seed SD of "
             f"{100 * power['sd']:.2f} pp ({power.get('sd_source', 'stated')}; two-sided "
             f"alpha {power['alpha']}, power {power['power']}; normal approximation "
             f"{power['normal']}); run: {summary['seeds']}."), ""]),
        ("Active tokens: loss tokens with A ≠ 0. Out of region: D > δ before the step. "
         "Unsafe keep: kept by the mask, out of region, and D grew after ONE optimizer step "
         "(each criterion's own step, from the same state, on the same tokens; D against the "
         "stored behaviour policy)."),
        "",
        "## Per criterion",
        "",
        *criteria_table(summary),
        "",
        (f"Paper (PDM, 61 seeds): unsafe-keep rate {_pct(p['unsafe_keep_rate_ratio'])} (ratio) "
         f"vs {_pct(p['unsafe_keep_rate_predictive'])} (predictive); ~{p['disagree_per_seed']} "
         f"disagreeing tokens of ~{p['out_of_region_per_seed']:,} out-of-region tokens per seed "
         f"({p['source']}; the denominator is our reading)."),
        "",
        "## What the rate measures: the same tokens and masks under two control steps",
        "",
        *_controls_table(summary),
        "",
        (f"Full step: the run's optimizer (Adam with its state). Momentum only: the same "
         f"optimizer step from the same state with every gradient zero. Own gradient: plain SGD "
         f"(lr {setup.get('sgd_lr')}) on the criterion's masked loss alone, no optimizer state. "
         "Pooled over seeds; the kept set is the criterion's in all three columns."),
        "",
        "## Paired comparison (unsafe-keep rate; a lower rate wins)",
        "",
        *paired_table(summary),
        "",
        *inference_lines(summary),
        (f"Paper: predictive better in {p['wins']} of {p['seeds']} seeds (two-sided sign test "
         f"p = {sign_test_p(p['wins'], p['seeds'] - p['wins']):.3f} if the other "
         f"{p['seeds'] - p['wins']} were losses)."),
        "",
        "## First-order prediction vs the realised change (unmasked reference step)",
        "",
        *_prediction_table(summary),
        "",
        ("On a disagreement set the two signs differ, so exactly one of them matches the "
         "realised change of every decided token: the two percentages sum to 100%. A token's "
         "state is its prompt + response prefix; tokens of one state share one softmax, so one "
         "step moves their D together whatever their own advantages say (share of active tokens "
         f"sharing their state: {_pct(summary.get('shared_state_fraction'))})."),
        "",
    ]
    return "\n".join(head)
