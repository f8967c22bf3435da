"""Check 2: the RL driver end to end against the real vLLM server (`rollout.engine=vllm`).

TP=2 trainer, fp32 pushes to the fp32 server every iteration (in memory, digest-checked by the
client, version read back). Every iteration's first minibatch is on-policy, so its
`mismatch/abs_logprob_diff` is the engine's numerical error (~1e-6): the served weights equal
the trainer's after every push. No sample is lost (every row counts prompts x group samples;
a failed sample would have stopped the run), and the reward rises.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_common import first_rows, rows, run_trainer, vllm_overrides

pytestmark = [pytest.mark.vllm_server, pytest.mark.megatron, pytest.mark.slow]

ITERATIONS = 8
PROMPTS, GROUP = 8, 8
ONPOLICY_TOL = 1e-5
"""Bound on the first minibatch's mean |log pi - log mu| (fp32 engine = trainer weights)."""


@pytest.mark.gloo
def test_rl_run_against_vllm(vllm_server, tmp_path):
    out = str(tmp_path / "run")
    run_trainer(vllm_server, out, vllm_overrides(vllm_server) + [
        "parallel.tp=2", "parallel.ep=1", f"train.iterations={ITERATIONS}",
        "train.minibatches_per_iteration=2", f"rollout.prompts_per_iteration={PROMPTS}",
        f"rollout.group_size={GROUP}", "task.partial_credit=true", "warmup.steps=0",
        "train.lr=0.01", "loss.preset=pdm-agg", "checkpoint.save_interval=0",
        "train.eval_prompts=16"])
    metrics = rows(out)
    firsts = first_rows(metrics)
    assert [r["iteration"] for r in firsts] == list(range(ITERATIONS))
    # one push per iteration: iteration i trains on rollouts of version i (on-policy)
    assert [r["rollout/weight_version"] for r in firsts] == list(range(ITERATIONS))
    assert all(r["rollout/staleness"] == 0 for r in metrics)
    assert all(r["rollout/num_samples"] == PROMPTS * GROUP for r in metrics)
    worst = max(r["mismatch/abs_logprob_diff"] for r in firsts)
    diffs = [f"{r['mismatch/abs_logprob_diff']:.2e}" for r in firsts]
    print(f"\nfirst-minibatch mismatch/abs_logprob_diff per iteration: {diffs}")
    print(f"reward per iteration: {[round(r['reward/mean'], 3) for r in firsts]}")
    assert worst < ONPOLICY_TOL, worst
    assert all(r["pdm/masked_frac"] == 0.0 for r in firsts)
    rewards = [r["reward/mean"] for r in firsts]
    # rising: the last iterations beat the first ones, and the least-squares slope is positive
    # (measured: 0.070, 0.090, 0.051, 0.062, 0.086, 0.109, 0.121, 0.141)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.02, rewards
    xm, ym = (ITERATIONS - 1) / 2, sum(rewards) / ITERATIONS
    assert sum((i - xm) * (r - ym) for i, r in enumerate(rewards)) > 0, rewards
    # the server holds the last pushed version (after the final iteration's sync)
    assert vllm_server.engine().weight_version() == str(ITERATIONS)
