"""Arithmetic word problems through a real model's chat template: `task.name: arithmetic`.

Problem: one sentence pair about a person and objects, with one operation on two operands in
[2, task.max_operand]:
  add       "Tom has 7 apples. Tom gets 5 more. How many apples does Tom have now?"      12
  subtract  "Tom has 7 apples and gives 5 away. How many apples are left?"               2
  multiply  "Tom has 3 bags with 5 apples in each bag. How many apples are there in total?"  15
followed by " Answer with a number." and sent as one user turn through the tokenizer's chat
template with the generation prompt (`jsonl_task.encode_prompt`; `task.tokenizer_dir` is the
model's own HF directory).

Reward (exact match of the final number): 1.0 iff the response ended with the tokenizer's eos
(a response cut at `max_new_tokens` has no final answer) and its final answer - the content of
the last `\\boxed{...}`, else the last number in the decoded text - equals the problem's answer
numerically (`jsonl_task.answers_match`: "12", "12.", "12.0" and "1,2" all read as 12); else 0.0.

Data stream: problem `i` is a deterministic function of the integer i (a generator seeded by i),
so a problem is just its index; iteration k draws its indices from a generator seeded by
(seed, k). Held-out split (train/heldout.py): a fixed fraction (`task.heldout_fraction`) of the
arithmetic facts (operation, a, b) is evaluation only, whatever name and object tell them;
training streams skip those indices, the evaluation takes distinct question texts from indices
EVAL_BASE, EVAL_BASE + 1, ... whose fact is held out. So the evaluation measures unseen facts.
"""

from __future__ import annotations

import itertools

import torch

from megatron_pdm.train import heldout
from megatron_pdm.train.jsonl_task import (answers_match, encode_prompt, ended_with_eos,
                                           eos_and_pad, load_tokenizer)

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Emma")
OBJECTS = ("apples", "pencils", "marbles", "books", "stickers", "coins", "cookies", "cards")
OPERATIONS = ("add", "subtract", "multiply")
SUFFIX = " Answer with a number."
EVAL_BASE = 1 << 40
"""Evaluation problems are indices EVAL_BASE, EVAL_BASE + 1, ...; training indices are below."""


def word_fact(index: int, max_operand: int) -> tuple[str, str, str, int, int]:
    """(name, object, operation, a, b) of problem `index`, operands as the question states them."""
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}")
    g = torch.Generator().manual_seed(int(index) * 2_654_435_761 % (1 << 63) + 11)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    name, obj, op = NAMES[pick(len(NAMES))], OBJECTS[pick(len(OBJECTS))], OPERATIONS[pick(3)]
    a, b = 2 + pick(max_operand - 1), 2 + pick(max_operand - 1)
    if op == "subtract":
        a, b = max(a, b), min(a, b)
    return name, obj, op, a, b


def fact_key(index: int, max_operand: int) -> str:
    """The held-out split's content key of problem `index`: "{op}:{a},{b}" (sorted for the
    commutative add and multiply)."""
    _, _, op, a, b = word_fact(index, max_operand)
    if op != "subtract":
        a, b = min(a, b), max(a, b)
    return f"{op}:{a},{b}"


def word_problem(index: int, max_operand: int) -> tuple[str, int]:
    """(question text, integer answer) of problem `index`."""
    name, obj, op, a, b = word_fact(index, max_operand)
    if op == "add":
        return (f"{name} has {a} {obj}. {name} gets {b} more. "
                f"How many {obj} does {name} have now?"), a + b
    if op == "subtract":
        return f"{name} has {a} {obj} and gives {b} away. How many {obj} are left?", a - b
    return (f"{name} has {a} bags with {b} {obj} in each bag. "
            f"How many {obj} are there in total?"), a * b


def final_answer_reward(text: str, answer: int, finished: bool) -> float:
    """1.0 iff the response finished (eos) and its final number equals `answer`."""
    return 1.0 if finished and answers_match(text, answer) else 0.0


class WordProblemTask:
    """Task interface of the trainer (see task.AdditionTask) over generated word problems."""

    supports_sft = False

    def __init__(self, tokenizer_dir: str, *, max_operand: int = 20, max_new_tokens: int = 48,
                 heldout_fraction: float = heldout.DEFAULT_FRACTION):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        word_problem(0, max_operand)  # checks max_operand
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        self.heldout_fraction = float(heldout_fraction)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.eos_id, self.pad_id = eos_and_pad(self.tokenizer, tokenizer_dir)
        self.vocab_size = len(self.tokenizer)
        self.max_operand = int(max_operand)
        self.max_new_tokens = int(max_new_tokens)

    def problem(self, index: int) -> tuple[str, int]:
        return word_problem(index, self.max_operand)

    def problem_key(self, index: int) -> str:
        return fact_key(index, self.max_operand)

    def is_heldout(self, index: int) -> bool:
        return heldout.heldout(self.problem_key(index), self.heldout_fraction)

    def problems(self, seed: int, index: int, n: int) -> list[int]:
        """Training indices of iteration `index` (training side of the held-out split)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + index * 7919 + 17)

        def candidates():
            while True:
                yield from torch.randint(0, EVAL_BASE, (256,), generator=g).tolist()

        return heldout.draw(candidates(), self.problem_key, n, fraction=self.heldout_fraction,
                            want_heldout=False, what="word problems")

    def eval_problems(self, seed: int, n: int) -> list[int]:
        """`n` held-out indices with distinct question texts, the same for every seed."""
        return heldout.draw(itertools.count(EVAL_BASE), self.problem_key, n,
                            fraction=self.heldout_fraction, want_heldout=True,
                            distinct=lambda i: self.problem(i)[0],
                            what="evaluation problems (train.eval_prompts)")

    def prompt_ids(self, problem: int) -> list[int]:
        return encode_prompt(self.tokenizer, self.problem(problem)[0] + SUFFIX)

    def score(self, problem: int, response_ids: list[int]) -> float:
        ids = [int(i) for i in response_ids]
        finished = ended_with_eos(ids, self.eos_id)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return final_answer_reward(text, self.problem(problem)[1], finished)
