"""On-policy invariant inside the real megatron model, 2 gloo processes, TP=2 and EP=2.

With the rollout copy holding exactly the trainer's weights (rollout_precision None) and before
any RL update, the behavior policy mu is the training policy pi. So, for every loss token of a
real rollout batch pushed through the megatron model and our loss_func: top-K KL/TV, |pi_k - mu_k|
and |log pi_k - log mu_k| are ~0 (fp32 noise from different batch shapes: < 1e-5), and every
preset's mask keeps every token (masked fraction exactly 0 over a non-empty count).

The model first takes 10 supervised warm-up steps with init std 0.3, so the distribution is
peaked and the replicated weights have been through megatron's optimizer and gradient reduction
(this is what exposed expert replicas diverging across TP ranks; see megatron/optimizer.py).
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm import metrics as M
from tests.support._dist import run_gloo

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml")

PRESETS = ("pdm-agg", "pdm-exact", "dppo-topk-kl", "dppo-binary-tv", "grpo", "pdm-tv")


def _worker(rank, world, tp, ep):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_pdm.mcore.loss_adapter import policy_loss_func, reduce_metrics
    from megatron_pdm.mcore.parallel import destroy_parallel
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.trainer import Trainer
    from rollout_bridge.core.packing import pack_padded

    cfg = RunConfig.load(TINY)
    cfg.parallel.tp, cfg.parallel.ep = tp, ep
    cfg.rollout.rollout_precision = None
    cfg.model.init_method_std = 0.3
    cfg.warmup.steps, cfg.warmup.batch_size = 10, 16
    try:
        tr = Trainer(cfg)
        tr.warmup()
        tr.sync_weights()
        ops = tr.task.operands_for(5, 0, 6)
        rb = tr.rollout.engine.generate([tr.task.prompt(a, b) for a, b in ops],
                                {"max_new_tokens": tr.task.answer_len}, n=4)
        adv_b = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(rb.samples))])
        packed = pack_padded(rb, adv_b, pad_id=tr.task.pad_id, pad_to_multiple_of=tp)
        with torch.no_grad():
            logits = tr.model(packed.tokens, packed.position_ids, attention_mask=None)
            full = gather_from_tensor_model_parallel_region(logits)[..., :tr.arch.vocab_size]
        # the distribution is far from uniform, so ~0 divergences are not trivial
        assert torch.softmax(full[packed.loss_mask], -1).max(-1).values.mean() > 0.3
        for preset in PRESETS:
            # a fresh copy per preset: the loss func consumes fp32 logits in place (like CE)
            _, ntok, metrics = policy_loss_func(
                logits.clone(), batch=packed, cfg=pdm.PolicyLossConfig.preset(preset))
            assert int(ntok) == int(packed.loss_mask.sum()) > 0
            masked = metrics[M.MASKED_FRAC]
            assert masked[1] > 0 and masked[0] == 0, (preset, masked)
            means = reduce_metrics([metrics])
            for key in (M.TOPK_KL_MEAN, M.TOPK_TV_MEAN, M.ABS_PROB_DIFF, M.ABS_LOGPROB_DIFF):
                assert abs(means[key]) < 1e-5, (preset, key, means[key])
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    del destroy_parallel


@pytest.mark.gloo
@pytest.mark.megatron
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_step0_no_mismatch_keeps_every_token(tp, ep):
    run_gloo(_worker, 2, tp, ep)
