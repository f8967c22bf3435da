"""The arithmetic word-problem task (train/word_task.py): problems, prompts, the final-number
reward, its config, and the real-model example config."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pdm.configtree import ConfigError
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.word_task import (
    EVAL_BASE,
    SUFFIX,
    WordProblemTask,
    final_answer_reward,
    word_problem,
)

ROOT = Path(__file__).resolve().parents[2]
REAL_CONFIG = ROOT / "examples" / "real_cpu" / "config.yaml"


def test_problems_are_deterministic_and_correct():
    seen_ops = set()
    for i in range(300):
        text, answer = word_problem(i, 20)
        assert (text, answer) == word_problem(i, 20)
        nums = [int(w) for w in text.replace("?", " ").replace(".", " ").split() if w.isdigit()]
        a, b = nums
        assert 2 <= a <= 20 and 2 <= b <= 20, text
        if "more" in text:
            assert answer == a + b
            seen_ops.add("add")
        elif "away" in text:
            assert a >= b and answer == a - b
            seen_ops.add("subtract")
        else:
            assert "each bag" in text and answer == a * b
            seen_ops.add("multiply")
    assert seen_ops == {"add", "subtract", "multiply"}
    assert len({word_problem(i, 20) for i in range(100)}) > 90
    with pytest.raises(ValueError, match="max_operand"):
        word_problem(0, 1)


@pytest.mark.parametrize("text, answer, finished, want", [
    ("7 + 5 = 12", 12, True, 1.0),
    ("The answer is 12.", 12, True, 1.0),            # trailing period
    ("Tom has 7 + 5 = 12 apples now.", 12, True, 1.0),
    ("12.0", 12, True, 1.0),
    ("so 1,200 in total", 1200, True, 1.0),           # thousands separator
    ("\\boxed{12} because 7 + 5 = 12 and 3", 12, True, 1.0),   # boxed wins over the last number
    ("12 apples, then 3 more", 12, True, 0.0),        # the final number decides, not the first
    ("7 + 5 = 12", 12, False, 0.0),                   # cut at max_new_tokens: no final answer
    ("twelve", 12, True, 0.0),                        # no number at all
    ("", 12, True, 0.0),
    ("11 - 6 = -5", 5, True, 0.0),                    # sign kept
    ("1.5", 1, True, 0.0),
])
def test_final_answer_reward(text, answer, finished, want):
    assert final_answer_reward(text, answer, finished) == want


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tests.train.test_driver_config import _tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    _tiny_tokenizer(path)
    return str(path)


def test_task_prompts_streams_and_score(tokenizer_dir):
    task = WordProblemTask(tokenizer_dir, max_operand=9, max_new_tokens=16)
    tok = task.tokenizer
    assert task.eos_id == tok.convert_tokens_to_ids("<|im_end|>") and task.max_new_tokens == 16
    assert task.vocab_size == len(tok) and not task.supports_sft
    text, answer = task.problem(3)
    prompt = tok.decode(task.prompt_ids(3))
    assert prompt == f"<|im_start|>user\n{text}{SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    train = task.problems(1, 0, 32)
    assert train == task.problems(1, 0, 32) != task.problems(1, 1, 32)
    assert all(0 <= i < EVAL_BASE for i in train)
    # held-out facts (train/heldout.py; tests/train/test_heldout.py)
    evals = task.eval_problems(1, 3)
    assert evals == sorted(evals) and all(i >= EVAL_BASE and task.is_heldout(i) for i in evals)
    right = tok(f"so {answer}.")["input_ids"]
    wrong = tok(f"so {answer + 1}.")["input_ids"]
    assert task.score(3, right + [task.eos_id]) == 1.0
    assert task.score(3, right) == 0.0            # no eos: truncated
    assert task.score(3, wrong + [task.eos_id]) == 0.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        WordProblemTask(tokenizer_dir, max_new_tokens=0)


def test_config_builds_the_task(tokenizer_dir):
    from megatron_pdm.train.task import build_task

    cfg = RunConfig.load(None, ["task.name=arithmetic", f"task.tokenizer_dir={tokenizer_dir}",
                                "task.max_operand=5", "rollout.max_new_tokens=24"])
    task = build_task(cfg)
    assert isinstance(task, WordProblemTask) and task.max_operand == 5
    assert task.max_new_tokens == 24
    with pytest.raises(ConfigError, match="task.name=arithmetic needs task.tokenizer_dir"):
        RunConfig.load(None, ["task.name=arithmetic"])
    with pytest.raises(ConfigError, match="task.max_operand"):
        RunConfig.load(None, ["task.name=arithmetic", "task.tokenizer_dir=x",
                              "task.max_operand=1"])


def test_real_cpu_config():
    """examples/real_cpu/config.yaml: the real-model RL run's settings hold together."""
    cfg = RunConfig.load(str(REAL_CONFIG), ["rollout.vllm.url=http://127.0.0.1:8000"])
    assert cfg.task.name == "arithmetic" and cfg.rollout.engine == "vllm"
    assert cfg.loss.name == "pdm-agg" and cfg.warmup.steps == 0
    assert cfg.parallel.tp == 1 and cfg.checkpoint.arch_from_load_dir
    assert cfg.rollout.sync_at_start  # the served HF weights never produce a rollout
    make = (ROOT / "Makefile").read_text()
    assert "demo-real:" in make and "examples/real_cpu/config.yaml" in make
    with pytest.raises(ConfigError, match="rollout.engine=vllm needs rollout.vllm.url"):
        RunConfig.load(str(REAL_CONFIG))
    if (ROOT / cfg.task.tokenizer_dir / "tokenizer.json").exists():
        from megatron_pdm.train.task import build_task

        task = build_task(cfg)
        assert task.vocab_size == 49152 and task.max_new_tokens == cfg.rollout.max_new_tokens
        assert "<|im_start|>assistant\n" in task.tokenizer.decode(task.prompt_ids(0))


@pytest.mark.parametrize("args,threads,reserved", [
    ([], "2", "0"),                                    # both cores to each phase (the default)
    (["THREADS=1", "VLLM_RESERVED=1"], "1", "1"),      # the old split: one core each
    (["VLLM_CPU_NUM_OF_RESERVED_CPU=1"], "2", "1"),    # vLLM's own variable is honoured
])
def test_demo_real_gives_each_phase_the_cores_asked_for(args, threads, reserved):
    import os
    import re
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items()
           if k not in ("THREADS", "VLLM_RESERVED", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
    out = subprocess.run(["make", "-n", "demo-real", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    server = out[max(0, out.index("megatron_pdm.train.rollout.vllm_server") - 400):]
    assert re.search(rf"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}\b", server)
    assert re.search(rf"env OMP_NUM_THREADS={threads}\b", server)
