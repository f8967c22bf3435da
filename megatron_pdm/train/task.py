"""The toy task: multi-digit addition with an exact-match reward, and its tokenizer.

Prompt:  <bos> a_1 .. a_d + b_1 .. b_d =        (operands zero-padded to d digits, fixed length)
Answer:  s_0 s_1 .. s_d <eos>                   (d+1 digits of a+b, least significant first)
With `operand_order="lsb_first"` the operands are written least significant digit first too, so
the token that predicts answer digit i is always at the same distance from a_i and b_i (an
attention pattern the tiny model finds in far fewer supervised steps).

Why this task: it is verifiable (exact match), has a dense enough signal for GRPO groups, and a
two-layer MoE with a 64-wide residual learns it in minutes on 2 CPU cores. Writing the answer
least-significant-digit first lets the model carry left to right. Fixed-length prompts keep the
rollout batch rectangular, so every tensor/expert-parallel rank runs identical forward shapes.

Vocabulary: pad, bos, eos, the ten digits, '+', '=' and `num_filler_tokens` unused ids (never in
the data). With the default 3 fillers V = 18, which Megatron pads to 32 at TP=2 (divisible_by 8):
the padded ids must get zero probability in the loss, and K=8 top-K covers less than half of V.

Prompts are drawn from a generator seeded by (seed, iteration), so the data stream needs no state
of its own to resume exactly. The evaluation is held out (train/heldout.py): a fixed fraction of
the arithmetic facts {a, b} (`task.heldout_fraction`) is evaluation only; every training stream
(RL prompts, the supervised warm-up, its stopping probe) skips them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.train import heldout


@dataclass(frozen=True)
class Tokenizer:
    """Character tokenizer of the addition task."""

    num_filler_tokens: int = 3
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    @property
    def specials(self) -> tuple[str, ...]:
        return ("<pad>", "<bos>", "<eos>")

    @property
    def symbols(self) -> tuple[str, ...]:
        fillers = tuple(f"<unused{i}>" for i in range(self.num_filler_tokens))
        return self.specials + tuple("0123456789") + ("+", "=") + fillers

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        table = {s: i for i, s in enumerate(self.symbols)}
        return [table[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.symbols[i] if 0 <= i < self.vocab_size else "?" for i in ids)


def build_task(cfg):
    """The task of `cfg.task` ("addition", "jsonl" or "arithmetic")."""
    t = cfg.task
    if t.name == "arithmetic":
        from megatron_pdm.train.word_task import WordProblemTask

        return WordProblemTask(t.tokenizer_dir, max_operand=t.max_operand,
                               max_new_tokens=cfg.rollout.max_new_tokens or 48,
                               heldout_fraction=t.heldout_fraction)
    if t.name == "jsonl":
        from megatron_pdm.train.jsonl_task import JsonlTask

        return JsonlTask(t.path, t.tokenizer_dir, eval_fraction=t.eval_fraction,
                         max_sequence_length=cfg.rollout.max_sequence_length,
                         max_new_tokens=cfg.rollout.max_new_tokens)
    return AdditionTask(t.num_digits, Tokenizer(num_filler_tokens=t.num_filler_tokens),
                        partial_credit=t.partial_credit, operand_order=t.operand_order,
                        heldout_fraction=t.heldout_fraction)


class AdditionTask:
    """Prompts, reference answers and the exact-match reward of d-digit addition."""

    def __init__(self, num_digits: int, tokenizer: Tokenizer, *, partial_credit: bool = False,
                 operand_order: str = "msb_first",
                 heldout_fraction: float = heldout.DEFAULT_FRACTION):
        if num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {num_digits}")
        if operand_order not in ("msb_first", "lsb_first"):
            raise ValueError(f"operand_order must be msb_first or lsb_first, got {operand_order!r}")
        self.d = num_digits
        self.tok = tokenizer
        self.partial_credit = partial_credit
        self.lsb_first = operand_order == "lsb_first"
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        self.heldout_fraction = float(heldout_fraction)

    @property
    def prompt_len(self) -> int:
        return 2 * self.d + 3

    @property
    def answer_len(self) -> int:
        """Answer digits plus eos."""
        return self.d + 2

    def prompt(self, a: int, b: int) -> list[int]:
        x, y = f"{a:0{self.d}d}", f"{b:0{self.d}d}"
        if self.lsb_first:
            x, y = x[::-1], y[::-1]
        text = f"{x}+{y}="
        return [self.tok.bos_id] + self.tok.encode(text)

    def answer(self, a: int, b: int) -> list[int]:
        digits = f"{a + b:0{self.d + 1}d}"[::-1]
        return self.tok.encode(digits) + [self.tok.eos_id]

    def sample_operands(self, n: int, generator: torch.Generator) -> list[tuple[int, int]]:
        ab = torch.randint(0, 10 ** self.d, (n, 2), generator=generator)
        return [(int(a), int(b)) for a, b in ab]

    @staticmethod
    def problem_key(problem: tuple[int, int]) -> str:
        """The content key of the held-out split (train/heldout.py): one key per fact {a, b}."""
        a, b = problem
        return f"add:{min(a, b)}+{max(a, b)}"

    def is_heldout(self, problem: tuple[int, int]) -> bool:
        return heldout.heldout(self.problem_key(problem), self.heldout_fraction)

    def _candidates(self, seed: int, index: int):
        """The endless operand stream of (seed, index), drawn in chunks from one generator."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + index * 7919 + 17)
        while True:
            yield from self.sample_operands(256, g)

    def operands_for(self, seed: int, index: int, n: int, *, want_heldout: bool = False,
                     distinct: bool = False, what: str = "addition problems"
                     ) -> list[tuple[int, int]]:
        """Deterministic operands for (seed, index) on one side of the held-out split: the data
        stream of iteration `index` (training side unless `want_heldout`)."""
        return heldout.draw(self._candidates(seed, index), self.problem_key, n,
                            fraction=self.heldout_fraction, want_heldout=want_heldout,
                            distinct=distinct, what=what)

    # ---- the task interface used by the trainer (shared with jsonl_task.JsonlTask)

    supports_sft = True

    @property
    def vocab_size(self) -> int:
        return self.tok.vocab_size

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id

    @property
    def eos_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_new_tokens(self) -> int:
        return self.answer_len

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_len

    def problems(self, seed: int, index: int, n: int) -> list[tuple[int, int]]:
        return self.operands_for(seed, index, n)

    def eval_problems(self, seed: int, n: int) -> list[tuple[int, int]]:
        """`n` distinct held-out facts (never in a training stream)."""
        return self.operands_for(seed, -1, n, want_heldout=True, distinct=True,
                                 what="evaluation problems (train.eval_prompts)")

    def probe_problems(self, seed: int, n: int) -> list[tuple[int, int]]:
        """The warm-up's stopping probe (warmup.stop_at_accuracy): a stream of its own, so the
        evaluation prompts never decide when RL starts; training side of the split)."""
        return self.operands_for(seed, -2, n, what="probe problems (warmup.probe_prompts)")

    def prompt_ids(self, problem: tuple[int, int]) -> list[int]:
        return self.prompt(*problem)

    def score(self, problem: tuple[int, int], response_ids: list[int]) -> float:
        if self.partial_credit:
            want = self.answer(*problem)
            got = list(response_ids)
            return sum(1.0 for i, w in enumerate(want) if i < len(got) and got[i] == w) / len(want)
        return self.reward(*problem, response_ids)

    def reward(self, a: int, b: int, response_ids: list[int]) -> float:
        """1.0 iff the response is exactly the answer followed by eos, else 0.0."""
        return 1.0 if list(response_ids) == self.answer(a, b) else 0.0

    def sft_batch(self, operands: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Row-aligned supervised batch: tokens [b, L], labels [b, L], loss_mask [b, L] (answer
        rows only; row p scores token p+1)."""
        seqs = [self.prompt(a, b) + self.answer(a, b) for a, b in operands]
        length = len(seqs[0])
        tokens_bl = torch.tensor(seqs, dtype=torch.int64)
        labels_bl = torch.full_like(tokens_bl, self.tok.pad_id)
        labels_bl[:, :-1] = tokens_bl[:, 1:]
        loss_mask_bl = torch.zeros_like(tokens_bl, dtype=torch.bool)
        loss_mask_bl[:, self.prompt_len - 1:length - 1] = True
        return {"tokens": tokens_bl, "labels": labels_bl, "loss_mask": loss_mask_bl}
