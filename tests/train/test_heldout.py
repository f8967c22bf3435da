"""The held-out split (train/heldout.py): no evaluation problem ever reaches a training stream.

Checked on every stream a run draws from (RL prompts of many iterations and seeds, the supervised
warm-up's batches, the warm-up's probe) for the addition and word tasks, by content (the
arithmetic fact), and on the jsonl task by prompt tokens.
"""

from __future__ import annotations

import json

import pytest

from megatron_pdm.train import heldout
from megatron_pdm.train.task import AdditionTask, Tokenizer


def _addition(fraction=0.2):
    return AdditionTask(2, Tokenizer(), operand_order="lsb_first", heldout_fraction=fraction)


def test_rule_is_a_stable_digest_and_respects_the_fraction():
    keys = [f"add:{a}+{b}" for a in range(100) for b in range(a, 100)]
    share = sum(heldout.heldout(k, 0.2) for k in keys) / len(keys)
    assert 0.17 < share < 0.23                      # 5050 keys, binomial SD 0.006
    # a digest, not Python's salted hash(): the same answer in every process and machine
    assert heldout.heldout("add:0+0", 0.2) == heldout.heldout("add:0+0", 0.2)
    assert [heldout.heldout(k, 0.2) for k in keys[:40]] == [
        heldout.heldout(k, 0.2) for k in keys[:40]]
    nested = [k for k in keys if heldout.heldout(k, 0.1)]
    assert all(heldout.heldout(k, 0.3) for k in nested)   # a larger fraction only adds keys
    with pytest.raises(ValueError, match="fraction"):
        heldout.heldout("x", 1.0)


def test_addition_eval_never_in_any_training_stream():
    task = _addition()
    evals = task.eval_problems(1234, 256)
    assert len({task.problem_key(p) for p in evals}) == 256   # distinct facts
    assert all(task.is_heldout(p) for p in evals)
    eval_keys = {task.problem_key(p) for p in evals}
    drawn = []
    for seed in (0, 1234):
        for it in range(60):
            drawn += task.problems(seed, it, 32)
        for step in range(20):
            drawn += task.operands_for(seed + 1, step, 64)    # the warm-up's batches
        drawn += task.probe_problems(seed, 128)
    assert len(drawn) > 5000
    assert not any(task.is_heldout(p) for p in drawn)
    assert not eval_keys & {task.problem_key(p) for p in drawn}
    # a commuted fact is the same fact: b+a of a held-out a+b is held out too
    a, b = next(p for p in evals if p[0] != p[1])
    assert task.is_heldout((b, a))


def test_streams_are_deterministic_and_distinct_per_iteration():
    task = _addition()
    assert task.problems(7, 3, 32) == task.problems(7, 3, 32) != task.problems(7, 4, 32)
    assert task.eval_problems(7, 50) == task.eval_problems(7, 50)


def test_too_few_heldout_problems_is_a_clear_error():
    task = AdditionTask(1, Tokenizer(), heldout_fraction=0.2)   # 55 facts in all
    with pytest.raises(heldout.HeldoutTooSmall, match="train.eval_prompts"):
        task.eval_problems(0, 256)
    with pytest.raises(ValueError, match="heldout_fraction"):
        AdditionTask(2, Tokenizer(), heldout_fraction=0.0)


def test_word_task_eval_facts_never_trained(monkeypatch):
    from megatron_pdm.train import word_task as wt

    class _Task(wt.WordProblemTask):          # the split needs no tokenizer
        def __init__(self, max_operand=20, fraction=0.2):
            self.max_operand, self.heldout_fraction = max_operand, fraction

    task = _Task()
    evals = task.eval_problems(0, 200)
    texts = [task.problem(i)[0] for i in evals]
    assert len(set(texts)) == 200 and all(task.is_heldout(i) for i in evals)
    eval_facts = {task.problem_key(i) for i in evals}
    train = [i for seed in (0, 5) for it in range(40) for i in task.problems(seed, it, 32)]
    assert not any(task.is_heldout(i) for i in train)
    assert not eval_facts & {task.problem_key(i) for i in train}
    assert not set(texts) & {task.problem(i)[0] for i in train}
    # the key is the fact: the answer follows from it for every operation
    for i in evals[:30] + train[:30]:
        op, ab = task.problem_key(i).split(":")
        a, b = map(int, ab.split(","))
        want = {"add": a + b, "subtract": a - b, "multiply": a * b}[op]
        assert task.problem(i)[1] == want


def test_jsonl_training_drops_prompts_identical_to_heldout(tmp_path):
    from tests.train.test_driver_config import _tiny_tokenizer
    from megatron_pdm.train.jsonl_task import JsonlTask

    tok = tmp_path / "tok"
    tok.mkdir()
    _tiny_tokenizer(tok)
    rows = [{"prompt": f"q{i % 6}", "answer": i} for i in range(10)]   # q0..q5, then q0..q3
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = JsonlTask(str(path), str(tok), eval_fraction=0.2, max_new_tokens=4)
    held = {tuple(task.prompt_ids(i)) for i in task.eval_problems(0, 10)}
    assert len(held) == 2
    train = {tuple(task.prompt_ids(i)) for it in range(30) for i in task.problems(0, it, 8)}
    assert train and not held & train
