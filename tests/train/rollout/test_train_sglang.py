"""The driver on a converted checkpoint with SGLang rollouts (fake server over transformers).

Setup (once per module): a tiny random HF Qwen3-MoE (tests/convert/conftest.py), converted with
megatron-pdm-convert-hf-to-megatron at TP=1 (vocab 1000 pads to 1024 at TP 1 and 2, so it loads at
TP=2). For every run a fresh fake SGLang server (tests/support/fake_sglang.py, HF mode: a
transformers Qwen3MoeForCausalLM from the HF dir, reloaded on /update_weights_from_disk, items
seeded by (prompt, sample index)) is started in its own process.

- TP=2, `checkpoint.load_dir` + `checkpoint.arch_from_load_dir`, `rollout.engine=sglang`, no
  initial sync:
  the server rolls out with the *original HF* weights, the trainer scores with the *converted and
  loaded* ones, so at step 1 the train/rollout mismatch is tiny (conversion + load correct) and
  the PDM mask keeps every token. Weight versions advance 0, 1, 2 (one sync per iteration,
  each verified through /get_weight_version; stale batches would raise).
- PP=2 (TP=1) on the same checkpoint and server seeds: identical rollouts, and every loss metric
  of the first optimizer step equals the TP=2 run's (same weights, same batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.fake_proc import read_call_log
from tests.support._launch import ROOT, launch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests.convert.conftest import make_tiny_hf

    root = tmp_path_factory.mktemp("sglang_e2e")
    hf = root / "hf"
    model = make_tiny_hf(hf)
    # Put most output mass on the addition task's digits and eos (ids 2..12), so that partial
    # credit rewards vary within groups (non-zero advantages exercise the PDM mask).
    import torch

    with torch.no_grad():
        w = model.lm_head.weight
        keep = torch.zeros(w.shape[0], dtype=torch.bool)
        keep[2:13] = True
        w[~keep] = 0.0
        w[keep] *= 3.0
    model.save_pretrained(hf)
    mcore = root / "mcore"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-m", "megatron_pdm.tools.convert_hf_to_megatron",
                    "--hf-dir", str(hf), "--out", str(mcore), "--tp", "1"], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=180)
    return hf, mcore


class _Server:
    def __init__(self, hf_dir, workdir):
        self.port_file = os.path.join(workdir, "port")
        self.log_file = os.path.join(workdir, "server_calls.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "support", "fake_sglang_cli.py"),
             "--hf-dir", str(hf_dir), "--port-file", self.port_file, "--seed", "7",
             "--log-file", self.log_file], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"fake server failed: {self.proc.stderr.read()[-3000:]}")
            time.sleep(0.1)
        with open(self.port_file) as f:
            self.url = f"http://127.0.0.1:{int(f.read())}"

    def calls(self):
        return read_call_log(self.log_file)  # each call is logged before it is answered

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _run(tmp_path, name, converted, layout):
    hf, mcore = converted
    work = tmp_path / name
    work.mkdir()
    server = _Server(hf, str(work))
    try:
        out = str(work / "run")
        launch(out, layout + [
            f"checkpoint.load_dir={mcore}", "checkpoint.arch_from_load_dir=true",
            "rollout.engine=sglang", f"rollout.sglang.url={server.url}",
            f"rollout.sglang.hf_checkpoint={work / 'sync'}", "rollout.max_sequence_length=16",
            "rollout.rollout_precision=null", "rollout.sync_at_start=false",
            "rollout.temperature=1.0", "task.partial_credit=true", "warmup.steps=0",
            "train.iterations=3",
            "loss.preset=pdm-exact", "checkpoint.save_interval=0",
            "train.eval_prompts=4"], timeout=300)
        calls = server.calls()
    finally:
        server.stop()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows, calls, work


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, converted):
    return _run(tmp_path_factory.mktemp("tp2"), "tp2", converted,
                ["parallel.tp=2", "parallel.ep=1", "parallel.pp=1"])


@pytest.mark.gloo
def test_sglang_tp2_from_converted_checkpoint(tp2_run):
    rows, calls, work = tp2_run
    assert [r["step"] for r in rows] == list(range(1, 7))  # 3 iterations x 2 minibatches
    # one weight version per iteration: the server's initial "0", then each sync's version
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1, 1, 2, 2]
    first = rows[0]
    # step 1: server = original HF weights, trainer = converted + loaded weights
    assert first["mismatch/abs_logprob_diff"] < 1e-4, first
    # masked fraction over tokens with A != 0: None when the first minibatch has none (every
    # group of it has equal rewards), else nothing is masked while the policies agree
    assert first["pdm/masked_frac"] in (0.0, None), first
    assert any(r["pdm/masked_frac"] is not None for r in rows), rows
    assert first["pdm/topk_kl_mean"] < 1e-6, first
    updates = [c["body"] for c in calls if c["call"] == "update_weights_from_disk"]
    assert [u["weight_version"] for u in updates] == ["1", "2", "3"]
    assert all(os.path.basename(u["model_path"]) == f"v{u['weight_version']}" for u in updates)
    names = [c["call"] for c in calls]
    i = names.index("update_weights_from_disk")
    assert names[i - 1] == "pause_generation" and names[i + 1] == "continue_generation"
    # the last exports are kept (rollout.sglang.keep_synced=2), HF safetensors + config
    kept = sorted(os.listdir(work / "sync"))
    assert kept == ["v2", "v3"], kept
    assert os.path.exists(work / "sync" / "v3" / "config.json")


@pytest.mark.gloo
def test_sglang_pp2_matches_tp2(tmp_path, converted, tp2_run):
    rows_pp, _, _ = _run(tmp_path, "pp2", converted,
                         ["parallel.tp=1", "parallel.ep=1", "parallel.pp=2"])
    rows_tp = tp2_run[0]
    assert len(rows_pp) == len(rows_tp)
    a, b = rows_tp[0], rows_pp[0]
    assert a["reward/mean"] == b["reward/mean"]  # identical rollouts
    for k in ("loss/pg", "pdm/masked_frac", "pdm/out_of_region_frac", "pdm/mu_tail_mean",
              "pdm/pi_tail_mean", "pdm/ratio_mean", "tokens/loss"):
        if a[k] is None:  # a frac over no counted token (e.g. no A != 0 in the minibatch)
            assert b[k] is None, k
        else:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    # train/rollout differences are at fp32 noise level (~1e-6) in both layouts; their signs
    # (pdm/direction_*) are noise and not compared
    for k in ("mismatch/abs_logprob_diff", "pdm/abs_prob_diff", "pdm/topk_kl_mean",
              "pdm/topk_tv_mean"):
        assert abs(b[k] - a[k]) < 1e-5, k
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
