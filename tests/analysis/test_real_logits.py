"""analysis/real_logits.py: the recipe's pure parts, the cache, and a smoke on the real model
(skipped when the prepared model is absent, a failure under `make test`: tests/conftest.py)."""

import pytest
import torch

from megatron_pdm.analysis import real_logits as rl


def test_prompts_seeded_and_interleaved():
    cfg = rl.RealLogitsConfig(arithmetic_prompts=4, general_prompts=2)
    ps = rl.prompts(cfg)
    assert ps == rl.prompts(cfg)
    assert [a is None for _, a in ps] == [False, False, True, False, False, True]
    text, answer = ps[0]
    a, op, b = text.split()[2:5]
    b = int(b.rstrip("?"))
    assert answer == {"plus": int(a) + b, "minus": int(a) - b, "times": int(a) * b}[op]
    assert rl.prompts(rl.RealLogitsConfig(arithmetic_prompts=4, general_prompts=2,
                                          seed=1)) != ps


@pytest.mark.parametrize("text,answer,want", [
    ("7 + 5 = 12", 12, 1.0), ("The answer is 12.", 12, 1.0), ("12, no, 13", 12, 0.0),
    ("no digits", 3, 0.0), ("6 minus 9 is -3", -3, 1.0), ("1,000", 1000, 1.0),
    ("12", None, 0.0)])
def test_reward(text, answer, want):
    assert rl.reward(text, answer) == want


def test_cache_builds_once(tmp_path, monkeypatch):
    calls = []
    fake = rl.RealLogits({"base": torch.zeros(3, 4), "bf16": torch.ones(3, 4, dtype=torch.bfloat16),
                          "step": torch.ones(3, 4)}, torch.tensor([1, 2, 3]),
                         torch.tensor([0, 0, 1]), torch.tensor([True, True, False]), {"m": 1})
    monkeypatch.setattr(rl, "build", lambda cfg: calls.append(cfg) or fake)
    cfg = rl.RealLogitsConfig(model_dir=str(tmp_path / "none"), tokens=3)
    first = rl.load_or_build(cfg, tmp_path)
    second = rl.load_or_build(cfg, tmp_path)
    assert len(calls) == 1
    assert torch.equal(second.sampled_ids, first.sampled_ids)
    pi, mu = second.pair("step")
    assert pi.dtype == mu.dtype == torch.float32 and torch.equal(mu, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="unknown pair"):
        second.pair("fp8")
    # another recipe is another cache entry
    rl.load_or_build(rl.RealLogitsConfig(model_dir=str(tmp_path / "none"), tokens=3,
                                         step_lr=2e-5), tmp_path)
    assert len(calls) == 2


def test_engine_support_folds_the_sampled_token():
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(6, 50, generator=g) * 3
    sampled = torch.tensor([int(mu[0].argmax()), int(mu[1].argmin()), 0, 1, 2, 3])
    ids, lp, valid, beh = rl.engine_support(mu, sampled, top_k=5)
    assert ids.shape == (6, 6) and valid[0, -1].item() is False and valid[1, -1].item() is True
    logmu = torch.log_softmax(mu, -1)
    assert torch.equal(ids[1, -1].long(), sampled[1])
    assert beh.tolist() == pytest.approx(logmu.gather(1, sampled[:, None])[:, 0].tolist())
    assert lp[0, :5].tolist() == pytest.approx(logmu[0].topk(5).values.tolist())


def test_real_model_smoke(real_model_dir):  # skips (or fails under make test) unprepared
    """The recipe's parts on the real model: sampling through the chat template, the three
    models' logits on the same tokens, one step with given advantages, the op on the pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_pdm.parallel.vocab_parallel import token_stats

    torch.set_num_threads(1)
    d = str(real_model_dir)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    eos = int(tok.eos_token_id)
    text, _ = rl.prompts(rl.RealLogitsConfig())[0]
    p_ids = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"])
    with torch.no_grad():
        resps = rl._sample(model, p_ids, 2, 6, eos, torch.Generator().manual_seed(0))
        groups = [(p_ids, resps)]
        base = rl._response_logits(model, groups, eos)
    n = sum(len(r) for r in resps)
    assert base.shape == (n, 49152) and 2 <= n <= 12
    # teacher forcing reproduces the sampling loop's next-token logits (KV cache == full pass)
    with torch.no_grad():
        first = model(input_ids=torch.tensor([p_ids])).logits[0, -1]
    torch.testing.assert_close(base[0], first, rtol=1e-4, atol=1e-4)
    norm = rl._grpo_step(model.train(), groups, [[1.0, -1.0]], 1e-5, eos)
    assert norm > 0
    with torch.no_grad():
        step = rl._response_logits(model.eval(), groups, eos)
    assert not torch.equal(step, base)
    sampled = torch.tensor([t for r in resps for t in r])
    ids, lp, valid, _ = rl.engine_support(base, sampled, 20)
    stats = token_stats(step, sampled, ids, lp, valid, tp_group=None, vocab_size=49152)
    assert torch.isfinite(stats.topk_kl).all() and (stats.topk_kl >= 0).all()
