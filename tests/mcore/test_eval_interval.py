"""train.eval_interval / eval_samples / eval_crosscheck: held-out evaluations between the ends,
sampled accuracy and the trainer-forward cross-check, without changing the run.

Two runs of the tiny config from the same seed (fp32 engine copy), one evaluating after every RL
iteration with sampled accuracy and the cross-check, one greedy only, before and after RL: every
metrics row (all but the wall-clock times) is identical, and the first run's
`greedy_acc_by_iteration` holds every iteration with the same two ends as the second's. An
evaluation that drew from the sampling stream or touched the weights would show up as a
different row. The first run's eval.jsonl holds every evaluation's per-problem results; the
trainer reproduces every greedy response of its own fp32 engine copy.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.support._dist import run_gloo

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml")
ITERATIONS = 3


def _worker(rank, world, out, interval, samples=0, crosscheck=0):
    from megatron.core import parallel_state

    from megatron_pdm.train import report
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.logging_utils import read_metrics
    from megatron_pdm.train.trainer import Trainer

    cfg = RunConfig.load(TINY, [
        "rollout.prompts_per_iteration=2", "rollout.group_size=2",
        "train.minibatches_per_iteration=2", "train.eval_prompts=8",
        f"train.iterations={ITERATIONS}", f"train.eval_interval={interval}",
        f"train.eval_samples={samples}", f"train.eval_crosscheck={crosscheck}",
        "rollout.rollout_precision=fp32",
        "parallel.tp=1", "warmup.steps=0", f"output_dir={out}", "log.tensorboard=false",
        "log.plot=false", "log.progress=false", "checkpoint.save_interval=0"])
    try:
        tr = Trainer(cfg)
        tr.run(resume=False)
        rows = read_metrics(os.path.join(out, "metrics.jsonl"))
        with open(os.path.join(out, "by_iteration.json"), "w") as f:
            json.dump(report.summarize(rows, tr.evals, 0.0)["greedy_acc_by_iteration"], f)
    finally:
        parallel_state.destroy_model_parallel()


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
                for line in f]


@pytest.mark.gloo
@pytest.mark.megatron
def test_eval_interval_adds_evaluations_and_changes_nothing_else(tmp_path):
    every, ends = str(tmp_path / "every"), str(tmp_path / "ends")
    run_gloo(_worker, 1, every, 1, 2, 4)
    run_gloo(_worker, 1, ends, 0)
    assert _rows(every) == _rows(ends)
    assert len(_rows(every)) == ITERATIONS * 2
    with open(os.path.join(every, "by_iteration.json")) as f:
        by_it = json.load(f)
    with open(os.path.join(ends, "by_iteration.json")) as f:
        by_it_ends = json.load(f)
    assert list(by_it) == [str(i) for i in range(ITERATIONS + 1)]
    assert list(by_it_ends) == ["0", str(ITERATIONS)]
    assert by_it["0"] == by_it_ends["0"] and by_it[str(ITERATIONS)] == by_it_ends[str(ITERATIONS)]
    assert all(0.0 <= a <= 1.0 for a in by_it.values())
    from megatron_pdm.train import evaluation as ev

    recs = ev.read_records(every)
    assert list(recs) == ["before_rl"] + [f"rl_iter{i}" for i in range(1, ITERATIONS)] + [
        "after_rl"]
    assert [r.iteration for r in recs.values()] == list(range(ITERATIONS + 1))
    for name, r in recs.items():
        assert len(r.problems) == 8 and r.problems == recs["before_rl"].problems
        assert r.greedy_acc == by_it[str(r.iteration)]
        assert r.samples_per_problem == 2 and all(x in (0.0, 0.5, 1.0) for x in r.sampled)
        assert r.crosscheck["responses"] == 4 and r.crosscheck["reproduced_frac"] == 1.0, name
    assert list(ev.read_records(ends)) == ["before_rl", "after_rl"]
    assert ev.read_records(ends)["after_rl"].sampled is None
    h = ev.summarize_heldout(recs)
    assert h["gain"]["greedy"]["gain"] == pytest.approx(by_it[str(ITERATIONS)] - by_it["0"])
    assert "sampled" in h["gain"]
