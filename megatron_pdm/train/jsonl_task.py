"""Prompt-dataset task for real runs: `task.name: jsonl`.

Data: `task.path`, one JSON object per line with "prompt" (str) and "answer" (str or number).
Tokenizer: the HF tokenizer in `task.tokenizer_dir` (`AutoTokenizer.from_pretrained(...,
local_files_only=True)`; use the model's own tokenizer directory, e.g. the HF checkpoint). If it
has a chat template, the prompt is sent as one user turn with the generation prompt appended;
otherwise it is tokenized as plain text (with the tokenizer's BOS if it adds one).
Reward: 1.0 iff the response's final answer equals the reference: the content of the last
`\\boxed{...}` if there is one, else the last number in the text; numbers compare numerically
("1,000" == "1000.0"), anything else after whitespace stripping.

Prompts of iteration i are drawn with replacement from the training lines by a generator seeded by
(seed, i), so the data stream needs no state of its own to resume exactly. `eval_fraction` holds
out the last lines of the file for the greedy evaluation; a training line whose prompt tokens equal
a held-out prompt's is dropped from training, so no evaluation prompt is ever trained on.
"""

from __future__ import annotations

import json
import logging
import re

import torch

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: last \\boxed{...}, else the last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(ans: str) -> str:
    ans = str(ans).strip().strip("$").strip()
    try:
        value = float(ans.replace(",", ""))
    except ValueError:
        return ans
    return repr(int(value)) if value.is_integer() else repr(value)


def answers_match(response_text: str, reference) -> bool:
    got = extract_answer(response_text)
    if got is None:
        return False
    ref = extract_answer(str(reference)) or str(reference)
    return _normalize(got) == _normalize(ref)


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def eos_and_pad(tokenizer, where: str) -> tuple[int, int]:
    """(eos id, pad id) of an HF tokenizer; pad falls back to eos. No eos is an error."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer in {where} has no eos token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(tokenizer.eos_token_id), int(pad)


def ended_with_eos(ids: list[int], eos_id: int) -> bool:
    """Whether a response finished: its last token is the eos (a response cut at
    max_new_tokens did not, and has no final answer)."""
    return bool(ids) and int(ids[-1]) == eos_id


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Prompt ids of `text`: one user turn + the generation prompt through the tokenizer's chat
    template if it has one, else the plain text (with the tokenizer's BOS if it adds one)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding (5.x)
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text)["input_ids"]]


class JsonlTask:
    """Task interface of the trainer (see task.AdditionTask) over a JSONL prompt file."""

    supports_sft = False

    def __init__(self, path: str, tokenizer_dir: str, *, eval_fraction: float = 0.0,
                 max_sequence_length: int | None = None, max_new_tokens: int | None = None):
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.eos_id, self.pad_id = eos_and_pad(self.tokenizer, tokenizer_dir)
        self.vocab_size = len(self.tokenizer)
        records = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "prompt" not in obj or "answer" not in obj:
                    raise ValueError(f"{path}:{n}: needs 'prompt' and 'answer', got {sorted(obj)}")
                records.append((self.encode_prompt(str(obj["prompt"])), obj["answer"]))
        limit = None
        if max_sequence_length is not None:
            limit = max_sequence_length - (max_new_tokens or 1)
            kept = [r for r in records if len(r[0]) <= limit]
            if len(kept) < len(records):
                logger.warning("%s: dropped %d prompts longer than %d tokens", path,
                               len(records) - len(kept), limit)
            records = kept
        if not records:
            raise ValueError(f"{path}: no usable prompts")
        n_eval = int(len(records) * eval_fraction)
        self.eval_records = records[len(records) - n_eval:] if n_eval else []
        held = {tuple(r[0]) for r in self.eval_records}
        train = [r for r in records[:len(records) - n_eval] if tuple(r[0]) not in held]
        if n_eval and len(train) < len(records) - n_eval:
            logger.warning("%s: dropped %d training prompts identical to a held-out one", path,
                           len(records) - n_eval - len(train))
        if n_eval and not train:
            raise ValueError(f"{path}: every training prompt is also a held-out prompt "
                             f"(task.eval_fraction={eval_fraction})")
        self.train_records = train or records
        self.max_prompt_len = max(len(r[0]) for r in records)
        if max_new_tokens is not None:
            self.max_new_tokens = int(max_new_tokens)
        elif max_sequence_length is not None:
            self.max_new_tokens = max_sequence_length - self.max_prompt_len
        else:
            raise ValueError("task.name=jsonl needs rollout.max_sequence_length or "
                             "rollout.max_new_tokens")
        if self.max_new_tokens < 1:
            raise ValueError(f"no room for a response: max_new_tokens={self.max_new_tokens}")

    def encode_prompt(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def problems(self, seed: int, index: int, n: int) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + index * 7919 + 17)
        return torch.randint(0, len(self.train_records), (n,), generator=g).tolist()

    def eval_problems(self, seed: int, n: int) -> list[int]:
        base = len(self.train_records)
        return [base + i for i in range(min(n, len(self.eval_records)))]

    def _record(self, problem: int):
        if problem < len(self.train_records):
            return self.train_records[problem]
        return self.eval_records[problem - len(self.train_records)]

    def prompt_ids(self, problem: int) -> list[int]:
        return list(self._record(problem)[0])

    def score(self, problem: int, response_ids: list[int]) -> float:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        return 1.0 if answers_match(text, self._record(problem)[1]) else 0.0
