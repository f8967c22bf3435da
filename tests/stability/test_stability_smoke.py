"""`megatron-pdm-stability --smoke`: the whole command at CI size (2 methods, 1 setting, 2
iterations, 2 seeds; ~70 s on 2 loaded cores), its result schema, that the stress keys measured
in the runs equal their settings (rollout.local.staleness=1 -> rollout/staleness 1 from iteration 1;
train.epochs_per_batch=2 x 1 minibatch -> 2 optimizer steps per batch), and that a rerun skips
the recorded cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support._launch import ROOT

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _smoke(out: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_pdm.tools.stability", "--smoke", "--output-dir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.gloo
def test_stability_smoke(tmp_path):
    out = str(tmp_path / "stab")
    _smoke(out)
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    assert res["schema"] == 1 and os.path.exists(os.path.join(out, "results.md"))
    assert os.path.exists(os.path.join(out, "curves.png"))
    assert {r["method"] for r in res["runs"]} == {"no-trust-region", "pdm-agg"}
    assert len(res["runs"]) == 4 and len(res["cells"]) == 2
    for r in res["runs"]:
        assert set(r["end"]) >= {"greedy_acc_after_rl", "reward_end", "sampled_kl_end",
                                 "masked_frac_end", "entropy_end", "grad_norm_end"}
        assert set(r["collapse"]) == {"collapsed", "reasons"}
        assert len(r["curves"]["reward"]) == 2
        # measured from the run's own metrics.jsonl, not from its config
        rows = [json.loads(line) for line in
                open(os.path.join(out, "runs", r["cell"], "metrics.jsonl"))]
        stale = {row["iteration"]: row["rollout/staleness"] for row in rows}
        assert stale == {0: 0.0, 1: 1.0}
        steps = {}
        for row in rows:
            steps[row["iteration"]] = max(steps.get(row["iteration"], 0),
                                          row["train/steps_this_batch"])
        assert steps == {0: 2, 1: 2}
        assert r["measured"] == {"staleness_max": 1.0, "steps_per_batch": 2.0}
    comp = res["comparisons"]
    assert {c["outcome"] for c in comp} == {"greedy_acc_after_rl", "reward_end"}
    assert all({"mean_diff", "ci95", "p", "p_holm", "verdict"} <= set(c) for c in comp)
    again = _smoke(out)
    assert "4 cells already recorded, 0 to run" in again.stdout
