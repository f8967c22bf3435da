"""Held-out evaluation: per-problem records, sampled accuracy, the trainer-forward cross-check.

An evaluation NAME ("before_warmup", "before_rl", "rl_iter<k>", "after_rl") runs the rollout
engine on the task's held-out problems (`train.eval_prompts` of them, `task.eval_problems`: the
same problems for every seed) and measures, per problem p:

    greedy_p    the task's score of the temperature-0 response (1 iff correct; a task with
                partial credit scores in between, and its intervals are bootstrap only)
    sampled_p   the fraction of `train.eval_samples` responses at `rollout.temperature` that are
                correct (only with train.eval_samples > 0; a failed request counts as wrong)

Beside the greedy score, each problem's greedy response length in tokens (`greedy_len`) and, for
a task with an end-of-sequence token (`task.eos_id`), whether the response ended with it within
`rollout.max_new_tokens` (`greedy_finished`; a cut response has no final answer): so a gain can
be split into answers that now end in time and answers that were wrong before and right now.

And, for the first `train.eval_crosscheck` problems, the **trainer-forward cross-check**: the
engine's greedy responses teacher-forced through the trainer's own model (no grad). At each
response position it compares the engine's chosen token with the trainer's log-softmax: the
position agrees when log pi(chosen) >= max log pi - `TIE_TOL_NATS`; a response is *reproduced*
when every position agrees. A reproduced response is the one the trainer's own greedy decoding
writes (same prefix, same argmax, token by token), so on the reproduced share the engine's
accuracy is the trainer's. It says whether the evaluation measures the trained weights (a bf16
push evaluates their bf16 rounding, docs/real-model.md).

Rank 0 appends one line per evaluation to OUTPUT_DIR/eval.jsonl (per-problem values; never
rewritten, so a resumed run keeps the earlier ones; a name evaluated twice, e.g. after a resume
from before it, is read as its last line). `summarize_heldout` turns the lines into
summary.json's "heldout": accuracies with Wilson and bootstrap intervals and the paired gain
after - before (bootstrap over problems, exact McNemar test for greedy).
"""

from __future__ import annotations

import dataclasses
import json
import os
from statistics import fmean

import torch

from megatron_pdm import significance as sig
from megatron_pdm.train.jsonl_task import ended_with_eos

__all__ = ["EVAL_FILE", "TIE_TOL_NATS", "EvalRecord", "append_record", "crosscheck", "describe",
           "greedy_facts", "read_records", "run_heldout", "score_samples", "summarize_heldout"]

EVAL_FILE = "eval.jsonl"
TIE_TOL_NATS = 1e-3
"""A position agrees when the engine's token is within this many nats of the trainer's argmax
(two kernels may order near-ties differently; a real disagreement is orders larger)."""
CROSSCHECK_CHUNK = 8
"""Rows per cross-check forward: [rows, s, V] float64 of a 49k vocabulary is ~40 MB a row."""


@dataclasses.dataclass
class EvalRecord:
    name: str
    iteration: int
    problems: list
    greedy: list[float]
    sampled: list[float] | None = None
    samples_per_problem: int = 0
    crosscheck: dict | None = None
    greedy_len: list[int] | None = None
    """Per problem: tokens of its greedy response (None in records written before it existed)."""
    greedy_finished: list[bool] | None = None
    """Per problem: the greedy response ended with the task's eos (None: no eos_id, or older)."""

    @property
    def greedy_acc(self) -> float:
        return fmean(self.greedy) if self.greedy else float("nan")


def _problem_index(sample, problems: list) -> int:
    """The problem a sample answers (its `group_index`), checked against the problem list."""
    if not 0 <= sample.group_index < len(problems):
        raise ValueError(f"evaluation sample with group_index {sample.group_index} outside the "
                         f"{len(problems)} problems")
    return sample.group_index


def score_samples(task, problems: list, batch, n: int) -> list[float]:
    """Per problem, the fraction of its `n` requested samples that are correct (samples are
    matched to problems by `group_index`; a failed request scores 0)."""
    right = [0.0] * len(problems)
    for s in batch.samples:
        i = _problem_index(s, problems)
        right[i] += task.score(problems[i], s.response_ids.tolist())
    return [r / n for r in right]


def greedy_facts(task, problems: list, batch) -> tuple[list[int], list[bool] | None]:
    """Per problem, its greedy response's length and whether it ended with `task.eos_id`
    (None when the task has none). One sample per problem (matched by `group_index`); a problem
    whose request failed has length 0 and did not finish."""
    lens, finished = [0] * len(problems), [False] * len(problems)
    eos = getattr(task, "eos_id", None)
    for s in batch.samples:
        i = _problem_index(s, problems)
        ids = s.response_ids.tolist()
        lens[i] = len(ids)
        finished[i] = eos is not None and ended_with_eos(ids, eos)
    return lens, (finished if eos is not None else None)


def run_heldout(name: str, iteration: int, task, problems: list, generate, *, aside,
                eval_samples: int, temperature: float):
    """One evaluation's record from the engine: greedy scores and facts, and with
    `eval_samples` > 0 the sampled accuracy at `temperature`. `generate(problems, temperature, n)`
    is the run's collective engine call; `aside()` a context that leaves the run's sampling state
    as it was (an evaluation changes no later rollout). Returns the record (no cross-check yet)
    and the greedy batch, which the cross-check scores."""
    greedy = generate(problems, 0.0, 1)
    rec = EvalRecord(name, iteration, list(problems), score_samples(task, problems, greedy, 1))
    rec.greedy_len, rec.greedy_finished = greedy_facts(task, problems, greedy)
    if eval_samples:
        with aside():
            sampled = generate(problems, temperature, eval_samples)
        rec.sampled = score_samples(task, problems, sampled, eval_samples)
        rec.samples_per_problem = eval_samples
    return rec, greedy


def describe(rec: EvalRecord) -> str:
    """The evaluation's log line: greedy accuracy, sampled accuracy and cross-check if measured."""
    out = f"greedy exact-match accuracy {rec.greedy_acc:.3f}"
    if rec.sampled:
        out += f", sampled {fmean(rec.sampled):.3f}"
    if rec.crosscheck:
        out += (f", trainer reproduces {rec.crosscheck['reproduced_frac']:.3f} of "
                f"{rec.crosscheck['responses']} greedy responses")
    return out


def crosscheck(module: torch.nn.Module, batch, *, pad_id: int, pad_to_multiple_of: int,
               tp: int) -> dict:
    """The engine's greedy samples of `batch` scored by the trainer's forward (module docstring).
    Collective over the TP group (the vocab-sharded logits are gathered for these few rows)."""
    from megatron_pdm.mcore.loss_adapter import to_bsv
    from rollout_bridge.core.packing import pack_padded

    positions = agree_argmax = agree_tol = reproduced = 0
    max_gap = 0.0
    for lo in range(0, len(batch.samples), CROSSCHECK_CHUNK):
        part = dataclasses.replace(batch, samples=batch.samples[lo:lo + CROSSCHECK_CHUNK])
        packed = pack_padded(part, None, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
        b, s = packed.tokens.shape
        with torch.no_grad():
            out = module(packed.tokens, packed.position_ids, attention_mask=None)
            # megatron-core's GPTModel without labels returns [b, s, V/tp] (it transposes)
            logits_bsv = to_bsv(out, b, s, layout="bsv").contiguous()
            if tp > 1:
                from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

                # all-gather over TP of [b, s, V/tp] -> [b, s, V] (a few evaluation rows only)
                logits_bsv = gather_from_tensor_model_parallel_region(logits_bsv)
        vocab = part.vocab_size or logits_bsv.shape[-1]
        lp_bsv = torch.log_softmax(logits_bsv[..., :vocab].double(), dim=-1)
        chosen_bs = lp_bsv.gather(-1, packed.labels.clamp(max=vocab - 1)[..., None])[..., 0]
        best_bs, argmax_bs = lp_bsv.max(-1)
        gap_bs = best_bs - chosen_bs
        mask_bs = packed.loss_mask
        positions += int(mask_bs.sum())
        agree_argmax += int(((argmax_bs == packed.labels) & mask_bs).sum())
        ok_bs = (gap_bs <= TIE_TOL_NATS) | ~mask_bs
        agree_tol += int((ok_bs & mask_bs).sum())
        reproduced += int(ok_bs.all(-1).sum())
        if mask_bs.any():
            max_gap = max(max_gap, float(gap_bs[mask_bs].max()))
    n = len(batch.samples)
    return {"responses": n, "positions": positions,
            "argmax_agree_frac": agree_argmax / positions if positions else None,
            "within_tol_frac": agree_tol / positions if positions else None,
            "reproduced_frac": reproduced / n if n else None,
            "max_gap_nats": max_gap, "tie_tol_nats": TIE_TOL_NATS}


def append_record(output_dir: str, record: EvalRecord) -> None:
    """Rank 0: one line of eval.jsonl (appended, flushed)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, EVAL_FILE), "a") as f:
        f.write(json.dumps(dataclasses.asdict(record)) + "\n")
        f.flush()


def read_records(output_dir: str) -> dict[str, EvalRecord]:
    """name -> the last record of that name in OUTPUT_DIR/eval.jsonl ({} without the file)."""
    path = os.path.join(output_dir, EVAL_FILE)
    out: dict[str, EvalRecord] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = EvalRecord(**json.loads(line))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not an evaluation record ({e})") from None
            for field in ("greedy", "sampled", "greedy_len", "greedy_finished"):
                values = getattr(rec, field)
                if values is not None and len(values) != len(rec.problems):
                    raise ValueError(f"{path}:{lineno}: {len(values)} {field} values for "
                                     f"{len(rec.problems)} problems")
            out[rec.name] = rec
    return out


def _binary(values: list[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def _accuracy(values: list[float], *, binary: bool, seed: int) -> dict:
    acc = fmean(values)
    out = {"acc": acc, "bootstrap_ci95_descriptive": sig.bootstrap_ci(values, seed=seed)}
    if binary:
        out["correct"] = int(sum(values))
        out["wilson_ci95"] = list(sig.wilson_interval(int(sum(values)), len(values)))
    return out


def _gain(before: list[float], after: list[float], *, binary: bool, seed: int) -> dict:
    out = {"gain": fmean(after) - fmean(before),
           "paired_bootstrap_ci95": sig.paired_bootstrap_ci(after, before, seed=seed)}
    if binary:
        m = sig.mcnemar_exact([bool(x) for x in after], [bool(x) for x in before])
        out.update(gained=m["a_only"], lost=m["b_only"], mcnemar_p=m["p"])
    else:
        out["sign_flip_p"] = sig.sign_flip_test([a - b for a, b in zip(after, before)],
                                                seed=seed)["p"]
    return out


def _by_finish(a: EvalRecord, b: EvalRecord) -> dict:
    """The greedy gain split by why a problem changed (binary scores): a problem gained whose
    response before was cut (no eos) vs one that ended before with a wrong answer; lost
    likewise by the response after."""
    out = {"gained_was_cut": 0, "gained_was_wrong": 0, "lost_now_cut": 0, "lost_now_wrong": 0,
           "cut_before": sum(not f for f in a.greedy_finished),
           "cut_after": sum(not f for f in b.greedy_finished)}
    for before, after, fin_a, fin_b in zip(a.greedy, b.greedy, a.greedy_finished,
                                           b.greedy_finished):
        if after > before:
            out["gained_was_cut" if not fin_a else "gained_was_wrong"] += 1
        elif after < before:
            out["lost_now_cut" if not fin_b else "lost_now_wrong"] += 1
    return out


def summarize_heldout(records: dict[str, EvalRecord], *, start: str = "before_rl",
                      end: str = "after_rl", seed: int = 0) -> dict:
    """summary.json's "heldout": per evaluation its accuracies with intervals, and the gain
    `end` - `start` paired by problem (both must have evaluated the same problems)."""
    out: dict = {"evaluations": {}}
    for name, r in records.items():
        e = {"iteration": r.iteration, "problems": len(r.problems),
             "greedy": _accuracy(r.greedy, binary=_binary(r.greedy), seed=seed)}
        if r.sampled is not None:
            e["sampled"] = {**_accuracy(r.sampled, binary=False, seed=seed),
                            "samples_per_problem": r.samples_per_problem}
        if r.crosscheck is not None:
            e["crosscheck"] = r.crosscheck
        if r.greedy_len is not None:
            e["greedy_len_mean"] = fmean(r.greedy_len) if r.greedy_len else None
        if r.greedy_finished is not None:
            e["greedy_finished_frac"] = fmean(r.greedy_finished) if r.greedy_finished else None
        out["evaluations"][name] = e
    a, b = records.get(start), records.get(end)
    if a is not None and b is not None:
        if a.problems != b.problems:
            raise ValueError(f"evaluations {start!r} and {end!r} scored different problems: "
                             "the gain is paired by problem")
        gain = {"from": start, "to": end, "problems": len(a.problems),
                "greedy": _gain(a.greedy, b.greedy,
                                binary=_binary(a.greedy) and _binary(b.greedy), seed=seed)}
        if a.sampled is not None and b.sampled is not None:
            gain["sampled"] = _gain(a.sampled, b.sampled, binary=False, seed=seed)
        if a.greedy_finished is not None and b.greedy_finished is not None:
            gain["greedy_by_finish"] = _by_finish(a, b)
        out["gain"] = gain
    return out
