"""LocalEngine: exact top-K round trip, padding mask, determinism, stop rules, precision.

The round trip recomputes logits with the same module outside the engine and compares
torch.topk(log_softmax(logits[:, :V] / T)) with the returned support (fp32, atol 1e-5 because
batched and single-sequence forwards round differently).
"""

from __future__ import annotations

import pytest
import torch
from tiny_lm import VOCAB, TinyLM, prompts

from rollout_bridge import LocalEngine, RolloutEngine, SamplingParamsError


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_round_trip(tiny_model, temperature):
    k = 6
    eng = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=k, seed=3)
    batch = eng.generate(prompts(3), {"temperature": temperature, "max_new_tokens": 6}, n=2)
    assert batch.temperature == temperature and len(batch) == 6
    for s in batch.samples:
        full = torch.cat([s.prompt_ids, s.response_ids])[None]
        with torch.no_grad():
            logits_lv = tiny_model(full)[0, :, :VOCAB].float()
        lp_lv = torch.log_softmax(logits_lv / temperature, -1)
        p = s.prompt_ids.shape[0]
        rows = lp_lv[p - 1:p - 1 + s.num_tokens]          # row P+t-1 scores response token t
        vals, ids = torch.topk(rows, k)
        torch.testing.assert_close(s.support_logprobs[:, :k], vals, atol=1e-5, rtol=1e-6)
        assert torch.equal(s.support_ids[:, :k].long(), ids)
        sampled_lp = rows.gather(1, s.response_ids[:, None].long())[:, 0]
        torch.testing.assert_close(s.behavior_logprob, sampled_lp, atol=1e-5, rtol=1e-6)
        assert (s.support_ids < VOCAB).all()               # padded logits (bias 5) masked
        assert (s.response_ids < VOCAB).all()


def test_protocol_and_determinism(tiny_model):
    a = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=4, seed=11)
    b = LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=4, seed=11)
    assert isinstance(a, RolloutEngine)
    params = {"temperature": 1.0, "max_new_tokens": 10}
    for _ in range(2):  # lockstep calls (what TP ranks do) sample identically
        ra, rb = a.generate(prompts(4), params, n=3), b.generate(prompts(4), params, n=3)
        assert [s.response_ids.tolist() for s in ra] == [s.response_ids.tolist() for s in rb]
    c = LocalEngine(TinyLM(), vocab_size=VOCAB, top_logprobs=4, seed=12)
    rc = c.generate(prompts(4), params, n=3)
    assert [s.response_ids.tolist() for s in rc] != [s.response_ids.tolist() for s in ra]
    groups = [(s.prompt_index, s.sample_index, s.group_index) for s in ra]
    assert groups == [(p, j, p) for p in range(4) for j in range(3)]


def test_stop_and_length(tiny_model):
    eng = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=3, seed=0)
    greedy = eng.generate(prompts(2), {"temperature": 0.0, "max_new_tokens": 5})
    first = greedy.samples[0].response_ids[0].item()
    eng_eos = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=3, seed=0, eos_token_id=first)
    out = eng_eos.generate(prompts(2), {"temperature": 0.0, "max_new_tokens": 5})
    assert out.samples[0].finish_reason == "stop" and out.samples[0].num_tokens == 1
    assert greedy.samples[0].finish_reason == "length" and greedy.samples[0].num_tokens == 5
    ignored = eng_eos.generate(prompts(1), {"temperature": 0.0, "max_new_tokens": 5,
                                            "ignore_eos": True})
    assert ignored.samples[0].num_tokens == 5


def test_truncated_sampling_refused(tiny_model):
    eng = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=3)
    for bad in ({"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1}):
        with pytest.raises(SamplingParamsError):
            eng.generate(prompts(1), {"max_new_tokens": 2, **bad})
    ok = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=3, allow_truncated_sampling=True)
    out = ok.generate(prompts(2), {"max_new_tokens": 6, "top_k": 2}, n=2)
    for s in out.samples:  # sampled only among the 2 most likely tokens
        assert (s.support_ids[:, :2].long() == s.response_ids[:, None]).any(1).all()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_rollout_precision_differs_but_close(tiny_model, precision):
    trainer = TinyLM()
    eng = LocalEngine.from_policy(trainer, vocab_size=VOCAB, top_logprobs=4,
                                  rollout_precision=precision)
    w_t, w_e = trainer.out.weight, eng.model.out.weight
    assert not torch.equal(w_t, w_e)
    tol = 8e-3 if precision == "bf16" else 7e-2
    assert ((w_t - w_e).abs() <= tol * w_t.abs().max()).all()
    if precision == "bf16":
        assert torch.equal(w_e, w_e.to(torch.bfloat16).float())
    # Update from trainer weights: version recorded, transform re-applied, trainer untouched.
    with torch.no_grad():
        trainer.out.weight.add_(0.01)
    before = trainer.out.weight.clone()
    version = eng.update_weights(trainer.state_dict(), version="step-1")
    assert version == "step-1" == eng.weight_version()
    assert torch.equal(trainer.out.weight, before)
    assert not torch.equal(eng.model.out.weight, before)
    out = eng.generate(prompts(1), {"max_new_tokens": 3})
    assert out.weight_version == "step-1"
    assert out.samples[0].meta_info["weight_version"] == "step-1"


def test_update_weights_strict_and_auto_version(tiny_model):
    eng = LocalEngine(tiny_model, vocab_size=VOCAB, top_logprobs=2)
    with pytest.raises(KeyError):
        eng.update_weights({"nope": torch.zeros(1)})
    assert eng.update_weights(list(TinyLM(seed=5).named_parameters())) == "1"
    assert torch.equal(eng.model.out.weight, TinyLM(seed=5).out.weight)
