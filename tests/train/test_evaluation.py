"""train/evaluation.py: per-problem records, the held-out summary, the trainer-forward check."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_pdm.train import evaluation as ev
from rollout_bridge.core.types import RolloutBatch, RolloutSample

V = 11


def _sample(prompt: list[int], response: list[int], group: int) -> RolloutSample:
    t = len(response)
    return RolloutSample(prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
                         behavior_logprob=torch.zeros(t), support_ids=torch.zeros(t, 2).int(),
                         support_logprobs=torch.full((t, 2), float("-inf")),
                         support_valid=torch.zeros(t, 2, dtype=torch.bool),
                         finish_reason="stop", prompt_index=group, group_index=group)


class NextPlusOne(torch.nn.Module):
    """A 'model' whose greedy next token is always (current token + 1) mod V, with a runner-up
    `margin` nats below; [b, s, V] logits like the trainer's forward at TP 1."""

    def __init__(self, margin: float = 5.0):
        super().__init__()
        self.margin = margin

    def forward(self, tokens_bs, position_ids, attention_mask=None):
        logits_bsv = torch.zeros(*tokens_bs.shape, V)
        logits_bsv.scatter_(-1, ((tokens_bs + 1) % V)[..., None], self.margin)
        return logits_bsv


def _batch(samples):
    return RolloutBatch(samples=samples, temperature=0.0, weight_version="0", top_logprobs=1,
                        n=1, num_prompts=len(samples), vocab_size=V)


def test_crosscheck_counts_reproduced_responses_and_positions():
    follows = _sample([1, 2], [3, 4, 5], 0)  # every token is the model's argmax
    deviates = _sample([6], [7, 9, 10], 1)   # position 2 (9 after 7) is not (8 is)
    rep = ev.crosscheck(NextPlusOne(), _batch([follows, deviates]), pad_id=0,
                        pad_to_multiple_of=4, tp=1)
    assert rep["responses"] == 2 and rep["positions"] == 6
    assert rep["reproduced_frac"] == 0.5
    assert rep["argmax_agree_frac"] == pytest.approx(5 / 6)
    assert rep["within_tol_frac"] == pytest.approx(5 / 6)
    # log-softmax gap of the runner-up: exactly the margin (all other logits equal)
    assert rep["max_gap_nats"] == pytest.approx(5.0, abs=1e-9)


def test_crosscheck_tie_within_tolerance_agrees():
    # margin below the tolerance: the deviating token counts as a tie, not as an error
    rep = ev.crosscheck(NextPlusOne(margin=ev.TIE_TOL_NATS / 2),
                        _batch([_sample([6], [7, 9], 0)]), pad_id=0, pad_to_multiple_of=1, tp=1)
    assert rep["reproduced_frac"] == 1.0 and rep["within_tol_frac"] == 1.0
    assert rep["argmax_agree_frac"] == 0.5


def test_crosscheck_chunks_give_the_same_answer(monkeypatch):
    samples = [_sample([g % 5 + 1], [(g % 5 + 2) % V, (g % 5 + 3 + g % 2) % V], g)
               for g in range(19)]
    whole = ev.crosscheck(NextPlusOne(), _batch(samples), pad_id=0, pad_to_multiple_of=1, tp=1)
    monkeypatch.setattr(ev, "CROSSCHECK_CHUNK", 3)
    chunked = ev.crosscheck(NextPlusOne(), _batch(samples), pad_id=0, pad_to_multiple_of=1, tp=1)
    assert whole == chunked
    assert whole["reproduced_frac"] == pytest.approx(10 / 19)  # the even g follow the rule


class _Task:
    def score(self, problem, response_ids):
        return 1.0 if response_ids[-1] == problem else 0.0


def test_score_samples_by_group_and_failures_count_wrong():
    problems = [4, 5]
    batch = _batch([_sample([1], [4], 0), _sample([1], [3], 0), _sample([1], [5], 1)])
    # problem 1's second sample failed (absent): 1 of 2 requested
    assert ev.score_samples(_Task(), problems, batch, 2) == [0.5, 0.5]
    bad = _batch([_sample([1], [4], 2)])
    with pytest.raises(ValueError, match="group_index 2"):
        ev.score_samples(_Task(), problems, bad, 1)


def _rec(name, greedy, sampled=None, problems=None):
    return ev.EvalRecord(name, 0, problems or list(range(len(greedy))), greedy, sampled,
                         2 if sampled else 0)


def test_summary_gain_is_paired_by_problem(tmp_path):
    before = _rec("before_rl", [0, 0, 1, 1, 0, 0, 0, 0], [0, .5, 1, .5, 0, 0, 0, 0])
    after = _rec("after_rl", [1, 1, 1, 0, 1, 1, 1, 0], [1, .5, 1, .5, .5, 1, .5, 0])
    for r in (before, after):
        ev.append_record(str(tmp_path), r)
    recs = ev.read_records(str(tmp_path))
    h = ev.summarize_heldout(recs)
    g = h["gain"]["greedy"]
    assert g["gain"] == pytest.approx(6 / 8 - 2 / 8)
    assert (g["gained"], g["lost"]) == (5, 1)
    lo, hi = g["paired_bootstrap_ci95"]
    assert lo <= g["gain"] <= hi
    assert h["evaluations"]["after_rl"]["greedy"]["correct"] == 6
    wl, wh = h["evaluations"]["after_rl"]["greedy"]["wilson_ci95"]
    assert wl < 0.75 < wh
    assert h["gain"]["sampled"]["gain"] == pytest.approx((5.0 - 2.0) / 8)
    assert 0 < h["gain"]["sampled"]["sign_flip_p"] <= 1


def test_partial_credit_scores_get_no_binary_statistics():
    h = ev.summarize_heldout({"before_rl": _rec("before_rl", [0.5, 0.0, 1.0]),
                              "after_rl": _rec("after_rl", [1.0, 0.5, 1.0])})
    assert "wilson_ci95" not in h["evaluations"]["before_rl"]["greedy"]
    assert "mcnemar_p" not in h["gain"]["greedy"] and "sign_flip_p" in h["gain"]["greedy"]


def test_different_problems_cannot_be_paired():
    with pytest.raises(ValueError, match="different problems"):
        ev.summarize_heldout({"before_rl": _rec("before_rl", [0, 1], problems=[1, 2]),
                              "after_rl": _rec("after_rl", [0, 1], problems=[1, 3])})


def test_read_records_last_line_wins_and_bad_lines_are_named(tmp_path):
    ev.append_record(str(tmp_path), _rec("before_rl", [0, 0]))
    ev.append_record(str(tmp_path), _rec("before_rl", [1, 1]))
    assert ev.read_records(str(tmp_path))["before_rl"].greedy == [1, 1]
    assert ev.read_records(str(tmp_path / "none")) == {}
    with open(tmp_path / ev.EVAL_FILE, "a") as f:
        f.write(json.dumps({"name": "x", "iteration": 0, "problems": [1], "greedy": []}) + "\n")
    with pytest.raises(ValueError, match=r"eval.jsonl:3: 0 greedy values for 1 problems"):
        ev.read_records(str(tmp_path))
    with open(tmp_path / ev.EVAL_FILE, "w") as f:
        f.write('{"name": "x"}\n')
    with pytest.raises(ValueError, match=r"eval.jsonl:1: not an evaluation record"):
        ev.read_records(str(tmp_path))


class _EosTask(_Task):
    eos_id = 9


def test_greedy_facts_length_and_finish_per_problem():
    problems = [4, 5, 6]
    batch = _batch([_sample([1], [3, 4, 9], 0), _sample([1], [5, 5], 2)])  # problem 1 failed
    assert ev.greedy_facts(_EosTask(), problems, batch) == ([3, 0, 2], [True, False, False])
    assert ev.greedy_facts(_Task(), problems, batch) == ([3, 0, 2], None)  # no eos_id
    with pytest.raises(ValueError, match="group_index 3"):
        ev.greedy_facts(_EosTask(), problems, _batch([_sample([1], [4], 3)]))


def test_gain_split_by_why_a_problem_changed(tmp_path):
    before = _rec("before_rl", [0, 0, 1, 1, 0])
    before.greedy_finished, before.greedy_len = [False, True, True, True, False], [48, 9, 8, 7, 48]
    after = _rec("after_rl", [1, 1, 0, 0, 0])
    after.greedy_finished, after.greedy_len = [True, True, False, True, True], [12, 9, 48, 7, 10]
    for r in (before, after):
        ev.append_record(str(tmp_path), r)
    h = ev.summarize_heldout(ev.read_records(str(tmp_path)))
    assert h["gain"]["greedy_by_finish"] == {
        "gained_was_cut": 1, "gained_was_wrong": 1, "lost_now_cut": 1, "lost_now_wrong": 1,
        "cut_before": 2, "cut_after": 1}
    assert h["evaluations"]["before_rl"]["greedy_finished_frac"] == pytest.approx(0.6)
    assert h["evaluations"]["after_rl"]["greedy_len_mean"] == pytest.approx(86 / 5)
    # an older record without the fields: no split, no error
    old = _rec("before_rl", [0, 0, 1, 1, 0])
    assert "greedy_by_finish" not in ev.summarize_heldout({"before_rl": old, "after_rl": after})[
        "gain"]


def test_read_records_checks_every_per_problem_field(tmp_path):
    rec = _rec("before_rl", [0, 1])
    rec.greedy_finished = [True]
    ev.append_record(str(tmp_path), rec)
    with pytest.raises(ValueError, match=r"eval.jsonl:1: 1 greedy_finished values for 2 problems"):
        ev.read_records(str(tmp_path))


def test_run_heldout_samples_aside_and_scores_both():
    problems = [4, 5]
    calls, aside_depth = [], []

    class Aside:
        def __enter__(self):
            aside_depth.append("in")

        def __exit__(self, *exc):
            aside_depth.append("out")

    def generate(probs, temperature, n):
        calls.append((temperature, n, list(aside_depth)))
        if temperature == 0.0:  # greedy: problem 0 right (ends with eos), problem 1 wrong
            return _batch([_sample([1], [4, 9, 4], 0), _sample([1], [3], 1)])
        return _batch([_sample([1], [4], 0), _sample([1], [5], 1), _sample([1], [5], 1)])

    rec, greedy = ev.run_heldout("after_rl", 7, _EosTask(), problems, generate, aside=Aside,
                                 eval_samples=2, temperature=0.8)
    assert calls == [(0.0, 1, []), (0.8, 2, ["in"])]  # sampled inside aside(), greedy outside
    assert aside_depth == ["in", "out"]
    assert (rec.name, rec.iteration, rec.greedy) == ("after_rl", 7, [1.0, 0.0])
    assert rec.sampled == [0.5, 1.0] and rec.samples_per_problem == 2
    assert rec.greedy_len == [3, 1] and rec.greedy_finished == [False, False]
    assert len(greedy.samples) == 2
    line = ev.describe(rec)
    assert line.startswith("greedy exact-match accuracy 0.500, sampled 0.750")
    assert "reproduces" not in line
    rec.crosscheck = {"reproduced_frac": 1.0, "responses": 2}
    assert ev.describe(rec).endswith("trainer reproduces 1.000 of 2 greedy responses")
    rec2, _ = ev.run_heldout("x", 0, _Task(), problems, generate, aside=Aside, eval_samples=0,
                             temperature=0.8)
    assert rec2.sampled is None and len(calls) == 3  # no sampled pass without eval_samples
