"""`torchrun -m megatron_pdm.tools.analyze_masks` end to end on the tiny CPU model (2 gloo
processes).

One short driver run (TP=2, the default DistributedOptimizer, `log.save_rollouts=2`, a dense
partial-credit reward so that a short warm-up already gives non-zero advantages) provides
checkpoints with Adam state and the two rollout batches it saved. The tool then runs on the saved
batches from the iteration-1 checkpoint:

- at TP=2 with the checkpoint's optimizer state (the default path): every output is written
  (results.json with one record per saved batch, results.md, tokens.npz, the three PNGs), and the
  batch of iteration 1 is on-policy for that checkpoint (staleness 0);
- at TP=2 and at TP=1 (DP=2: the data-parallel gather of the tables and the DP-sharded optimizer
  are exercised too), both with `--adam-state fresh` because the checkpoint's optimizer state
  cannot be resharded from TP=2 to TP=1 on CPU (expert parameters form a second optimizer group
  only at TP > 1); the driver's step before the study minibatch builds the Adam state in both.
  Every count and rate is equal, and the per-token values agree to 1e-5. The counts can only be
  equal because no decision lies near its boundary compared with the TP=1/TP=2 rounding
  difference, which is asserted too (a failure then says whether the tool or the case is at
  fault).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_pdm.analysis.seed_log import read_partial
from megatron_pdm.netutil import LOCAL_TORCHRUN
from tests.support._launch import ROOT, launch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

DELTA = 0.01  # the tiny short run is barely off-policy: a small delta puts tokens out of region
RUN = ["log.save_rollouts=2",
       "train.iterations=2", "checkpoint.save_interval=1", "checkpoint.keep_last=3",
       "rollout.prompts_per_iteration=8", "loss.preset=pdm-exact",
       "task.partial_credit=true"]  # a dense reward: non-zero advantages after a short warm-up


def _tool(run_dir: str, out: str, tp: int, *extra: str) -> None:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", *LOCAL_TORCHRUN,
           "-m", "megatron_pdm.tools.analyze_masks", "--run-dir", run_dir,
           "--checkpoint", os.path.join(run_dir, "checkpoints", "iter_0000001"),
           "--batches", "saved", "--delta-kl", str(DELTA), "--out-dir", out,
           "--set", f"parallel.tp={tp}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                          check=False)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines()
                  if "Error" in line or line.startswith("error:")]
        raise AssertionError(f"analyze_masks failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                             f"\n{proc.stderr[-3000:]}\nerror lines:\n" + "\n".join(errors[-20:]))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("masks")
    run_dir = str(base / "run")
    launch(run_dir, RUN)
    out = {"default": str(base / "tp2_checkpoint_adam")}
    _tool(run_dir, out["default"], 2)
    for tp in (2, 1):
        out[tp] = str(base / f"tp{tp}_fresh_adam")
        # no decomposition controls: the own-gradient control refuses DP > 1 with the
        # DistributedOptimizer (TP=1 here is DP=2), and the two layouts must match
        _tool(run_dir, out[tp], tp, "--adam-state", "fresh", "--no-controls")
    return out


def _results(out: str) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


@pytest.mark.gloo
def test_all_outputs_written(outputs):
    out = outputs["default"]
    for name in ("results.json", "results.md", "tokens.npz", "paired.png",
                 "predicted_vs_realised.png", "global_term.png"):
        path = os.path.join(out, name)
        assert os.path.getsize(path) > 1000, name
    r = _results(out)
    assert [s["batch_iteration"] for s in r["per_seed"]] == [0, 1]
    assert [s["staleness"] for s in r["per_seed"]] == [1, 0]
    assert r["setup"]["tp"] == 2 and r["setup"]["checkpoint_iteration"] == 1
    assert r["setup"]["adam_state"] == "checkpoint" and r["setup"]["stale_steps"] == 1
    assert set(r["summary"]["criteria"]) == {"ratio", "pdm-agg", "pdm-uniform", "pdm-exact"}
    assert [p["criterion"] for p in r["summary"]["paired"]] == ["pdm-agg", "pdm-uniform",
                                                                 "pdm-exact"]
    for s in r["per_seed"]:
        assert s["n_active"] > 0
        for c in s["criteria"].values():
            assert c["n_kept_out_of_region"] + c["n_masked_out_of_region"] == c["n_out_of_region"]
    # The case is informative: tokens out of region (in the stale batch at least).
    assert r["summary"]["criteria"]["ratio"]["total_n_out_of_region"] > 0
    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert "unsafe-keep rate" in md and "36.9%" in md  # the paper's number is on the page
    # every seed was on disk as it finished, the same record as results.json's
    assert read_partial(out) == r["per_seed"]


def _flat(x, path=""):
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flat(val, f"{path}/{key}").items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in _flat(val, f"{path}[{i}]").items()}
    return {path: x}


@pytest.mark.gloo
def test_study_steps_use_the_runs_learning_rate_schedule(outputs):
    """Each optimizer step of the study (the driver's earlier minibatches and the study's own)
    ran at the lr the trainer's schedule gives that step, read back from the optimizer."""
    from megatron_pdm.analysis.study import study_step_lrs
    from megatron_pdm.configtree import from_mapping
    from megatron_pdm.train.config import RunConfig

    setup = _results(outputs["default"])["setup"]
    cfg = from_mapping(RunConfig, setup["run_config"])
    want = study_step_lrs(cfg.train, setup["checkpoint_step"], setup["minibatch"])
    assert setup["lr_per_step"] == pytest.approx(want, rel=1e-12)


DECISIONS = ("keep__", "disagree__", "out_of_region")  # per-token booleans (0/1)
BOUNDARIES = ("away__", "delta_d")  # per-token signed statistics whose sign decides


@pytest.mark.gloo
def test_tp2_equals_tp1(outputs):
    """TP=2 and TP=1 give the same tokens' statistics (to rounding) and the same decisions.

    A decision may flip between the layouts only on a token whose statistic lies within 10x
    the layouts' rounding difference of its boundary (a correct run can have such a token).
    Where no decision flipped, every count and rate is equal; where some did, each count
    differs by at most the number of flipped tokens (rates are not compared then)."""
    a, b = _results(outputs[2]), _results(outputs[1])
    assert (a["setup"]["tp"], a["setup"]["dp"]) == (2, 1)
    assert (b["setup"]["tp"], b["setup"]["dp"]) == (1, 2)
    ta, tb = (np.load(os.path.join(outputs[tp], "tokens.npz")) for tp in (2, 1))
    assert sorted(ta.files) == sorted(tb.files)
    noise = {}
    for key in ta.files:
        np.testing.assert_allclose(ta[key], tb[key], atol=1e-5, rtol=0, err_msg=key)
        noise[key] = float(np.abs(ta[key] - tb[key]).max())
    delta = a["setup"]["delta_kl"]
    near = np.abs(ta["topk_kl"] - delta) <= 10 * noise["topk_kl"]
    for key in ta.files:
        if key.startswith(BOUNDARIES):
            near |= np.abs(ta[key]) <= 10 * noise[key]
    flipped = np.zeros_like(near)
    for key in ta.files:
        if key.startswith(DECISIONS):
            flipped |= ta[key] != tb[key]
    far_flips = np.flatnonzero(flipped & ~near)
    assert far_flips.size == 0, f"decisions differ on tokens far from a boundary: {far_flips}"
    n_flipped = int(flipped.sum())
    fa, fb = _flat(a["per_seed"]), _flat(b["per_seed"])
    assert fa.keys() == fb.keys()
    for key, va in fa.items():
        vb = fb[key]
        if isinstance(va, float) and isinstance(vb, float):
            if n_flipped == 0:
                assert va == pytest.approx(vb, abs=1e-5), key
        elif isinstance(va, int) and isinstance(vb, int) and not isinstance(va, bool):
            assert abs(va - vb) <= n_flipped, key  # every count exactly when none flipped
        else:
            assert va == vb, key  # None, names, flags
    if n_flipped:
        return
    fa, fb = _flat(a["summary"]), _flat(b["summary"])
    for key, va in fa.items():  # the summary (rates, wins, bootstrap intervals) too
        if isinstance(va, float):
            assert va == pytest.approx(fb[key], abs=1e-5), key
        else:
            assert va == fb[key], key


@pytest.mark.gloo
def test_own_runs_design_end_to_end(outputs, tmp_path):
    """Design "runs" from the same checkpoint: each criterion's own 1-iteration run per seed,
    every step counted; each seed (with its step rows) on disk as it finished."""
    run_dir = os.path.dirname(outputs["default"]) + "/run"
    out = str(tmp_path / "runs")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", *LOCAL_TORCHRUN,
           "-m", "megatron_pdm.tools.analyze_masks", "--run-dir", run_dir,
           "--checkpoint", os.path.join(run_dir, "checkpoints", "iter_0000001"),
           "--design", "runs", "--run-iterations", "1", "--criteria", "ratio", "pdm-agg",
           "--seeds", "3", "4", "--delta-kl", str(DELTA), "--no-plots", "--out-dir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    r = _results(out)
    assert [s["seed"] for s in r["per_seed"]] == [3, 4]
    steps = r["setup"]["minibatches_per_iteration"]  # one optimizer step per minibatch
    assert len(r["per_step"]) == 2 * 2 * steps  # seeds x criteria x steps of one iteration
    partial = read_partial(out)
    for rec, seed in zip(partial, r["per_seed"]):
        rows = rec.pop("per_step")
        assert rec == seed
        assert rows == [x for x in r["per_step"] if x["seed"] == seed["seed"]]
