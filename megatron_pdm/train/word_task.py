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
(seed, k), the evaluation uses indices from a disjoint range (>= EVAL_BASE). With few templates
and small operands the two sets share many texts: the evaluation measures the policy on the
task's distribution, not generalisation to unseen problems.
"""

from __future__ import annotations

import torch

from megatron_pdm.train.jsonl_task import answers_match, encode_prompt, eos_and_pad, load_tokenizer

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Emma")
OBJECTS = ("apples", "pencils", "marbles", "books", "stickers", "coins", "cookies", "cards")
OPERATIONS = ("add", "subtract", "multiply")
SUFFIX = " Answer with a number."
EVAL_BASE = 1 << 40
"""Evaluation problems are indices EVAL_BASE, EVAL_BASE + 1, ...; training indices are below."""


def word_problem(index: int, max_operand: int) -> tuple[str, int]:
    """(question text, integer answer) of problem `index`."""
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}")
    g = torch.Generator().manual_seed(int(index) * 2_654_435_761 % (1 << 63) + 11)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    name, obj, op = NAMES[pick(len(NAMES))], OBJECTS[pick(len(OBJECTS))], OPERATIONS[pick(3)]
    a, b = 2 + pick(max_operand - 1), 2 + pick(max_operand - 1)
    if op == "add":
        return (f"{name} has {a} {obj}. {name} gets {b} more. "
                f"How many {obj} does {name} have now?"), a + b
    if op == "subtract":
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {obj} and gives {b} away. How many {obj} are left?", a - b
    return (f"{name} has {a} bags with {b} {obj} in each bag. "
            f"How many {obj} are there in total?"), a * b


def final_answer_reward(text: str, answer: int, finished: bool) -> float:
    """1.0 iff the response finished (eos) and its final number equals `answer`."""
    return 1.0 if finished and answers_match(text, answer) else 0.0


class WordProblemTask:
    """Task interface of the trainer (see task.AdditionTask) over generated word problems."""

    supports_sft = False

    def __init__(self, tokenizer_dir: str, *, max_operand: int = 20, max_new_tokens: int = 48):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        word_problem(0, max_operand)  # checks max_operand
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.eos_id, self.pad_id = eos_and_pad(self.tokenizer, tokenizer_dir)
        self.vocab_size = len(self.tokenizer)
        self.max_operand = int(max_operand)
        self.max_new_tokens = int(max_new_tokens)

    def problem(self, index: int) -> tuple[str, int]:
        return word_problem(index, self.max_operand)

    def problems(self, seed: int, index: int, n: int) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + index * 7919 + 17)
        return torch.randint(0, EVAL_BASE, (n,), generator=g).tolist()

    def eval_problems(self, seed: int, n: int) -> list[int]:
        return [EVAL_BASE + i for i in range(n)]

    def prompt_ids(self, problem: int) -> list[int]:
        return encode_prompt(self.tokenizer, self.problem(problem)[0] + SUFFIX)

    def score(self, problem: int, response_ids: list[int]) -> float:
        ids = [int(i) for i in response_ids]
        finished = bool(ids) and ids[-1] == self.eos_id
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return final_answer_reward(text, self.problem(problem)[1], finished)
