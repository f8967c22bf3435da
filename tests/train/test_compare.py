"""`python -m megatron_pdm.train.compare` runs the supervised warm-up once and starts every run's
RL from its saved weights (it used to repeat the warm-up for every run).

Evidence that the runs start from the shared warm-up: the warm-up exists once, each run's config
has `warmup.steps=0` and `checkpoint.load_dir=<warm-up>`, and a run with the warm-up's own seed
measures the same greedy accuracy before RL as the warm-up did on the same held-out prompts (the
same weights, greedy decoding). A second invocation reuses the warm-up instead of redoing it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.support._launch import CONFIG, ROOT, SHORT

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _compare(out: str, presets: list[str], seeds: list[int]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_pdm.train.compare", "--config", CONFIG,
           "--output-dir", out, "--presets", *presets, "--seeds", *map(str, seeds)]
    for item in SHORT + ["warmup.steps=20", "train.iterations=2"]:
        cmd += ["--set", item]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.gloo
def test_compare_shares_one_warmup(tmp_path):
    from megatron_pdm.train.config import RunConfig

    seed = RunConfig.load(CONFIG).seed
    out = str(tmp_path / "cmp")
    proc = _compare(out, ["grpo"], [seed, seed + 1])
    warm = os.path.join(out, "warmup")
    assert os.path.exists(os.path.join(warm, "latest_checkpointed_iteration.txt"))
    with open(os.path.join(warm, "warmup.json")) as f:
        evals = json.load(f)["evals"]
    assert evals["warmup_steps"] > 0
    for s in (seed, seed + 1):
        run = os.path.join(out, f"grpo_s{s}")
        with open(os.path.join(run, "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        assert cfg["warmup"]["steps"] == 0 and cfg["checkpoint"]["load_dir"] == warm
        with open(os.path.join(run, "summary.json")) as f:
            summary = json.load(f)
        assert summary["warmup_steps"] == 0
        if s == seed:  # same weights, same held-out prompts, greedy
            assert summary["greedy_acc_before_rl"] == evals["before_rl"]
    assert os.path.exists(os.path.join(out, "compare.png"))
    assert "runs in" in proc.stdout and "s left" in proc.stdout  # time estimate per run
    again = _compare(out, ["pdm-agg"], [seed])
    assert "reusing the warm-up" in again.stdout
