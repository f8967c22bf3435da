"""The token-level mask study with behaviour from the real vLLM server (`--source precision`).

A short local-engine run gives a checkpoint with Adam state; the study then runs from it with
`rollout.engine=vllm`: the trainer pushes the checkpoint's weights (fp32) to the session's fp32
server, every seed's batch is sampled by vLLM, and the study minibatch is minibatch 0, so D
measures the engine mismatch alone. With an fp32 server that mismatch is numerical noise: D must
be far below any trust-region delta, no token out of region, staleness 0, and results.json /
results.md must say that vLLM (its version and serving dtype) produced the behaviour policy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_pdm.netutil import LOCAL_TORCHRUN
from tests.support._launch import ROOT, launch
from tests.support.vllm_common import vllm_overrides

pytestmark = [pytest.mark.vllm_server, pytest.mark.megatron, pytest.mark.slow]

SEEDS = 2
DELTA = 1e-3
D_NOISE = 1e-6
"""Bound on D_K at minibatch 0 against an fp32 server holding the trainer's weights (measured
engine vs trainer log-probs: |diff| <= 1.1e-6, docs/rollouts.md, so D_K ~ 1e-12)."""


@pytest.mark.gloo
def test_study_takes_behaviour_from_vllm(vllm_server, tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "study")
    launch(run_dir, ["train.iterations=2", "checkpoint.save_interval=0",
                     "rollout.prompts_per_iteration=8", "task.partial_credit=true"])
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", *LOCAL_TORCHRUN,
           "-m", "megatron_pdm.tools.analyze_masks", "--run-dir", run_dir, "--out-dir", out,
           "--source", "precision", "--delta-kl", str(DELTA), "--num-seeds", str(SEEDS),
           "--criteria", "ratio", "pdm-agg", "--no-plots"]
    for item in vllm_overrides(vllm_server):
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS="1", **vllm_server.env(),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"

    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    setup = res["setup"]
    assert setup["engine"] == "vllm" and setup["source"] == "precision"
    assert setup["minibatch"] == 0 and setup["stale_steps"] == 0
    server = setup["engine_server"]
    assert server["engine"] == "vllm" and server["dtype"] == "torch.float32", server
    assert server["vllm_version"].startswith("0."), server
    assert "vllm engine" in setup["batch_source"]
    assert len(res["per_seed"]) == SEEDS
    assert setup["staleness"] == [0] * SEEDS  # sampled by the checkpoint's own weights
    with open(os.path.join(out, "results.md")) as f:
        md = f.read()
    assert (f"engine vllm server {server['vllm_version']} serving in torch.float32, weights "
            "pushed in") in md

    tokens = np.load(os.path.join(out, "tokens.npz"))
    d_k = tokens["topk_kl"]
    assert d_k.size > 0  # active tokens exist, so the check below is not vacuous
    assert float(np.abs(d_k).max()) < D_NOISE, float(np.abs(d_k).max())
    assert not tokens["out_of_region"].any()
