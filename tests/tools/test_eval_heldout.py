"""megatron-pdm-eval-heldout against the fake vLLM server (real sockets): the record is the
driver's evaluation of the served model, problem by problem."""

from __future__ import annotations

import json

import pytest
from fake_vllm import FakeVLLMServer
from tiny_lm import TinyLM

from megatron_pdm.cli import run_cli
from megatron_pdm.configtree import ConfigError
from megatron_pdm.tools import eval_heldout
from megatron_pdm.train import evaluation as ev
from megatron_pdm.train.config import RunConfig
from megatron_pdm.train.task import build_task
from rollout_bridge import LocalEngine

CONFIG = "examples/tiny_cpu/config.yaml"
# partial credit: a random model's answers score between 0 and 1, so a record whose scores were
# assigned to the wrong problem would differ from the direct computation below
SETS = ["rollout.engine=vllm", "task.partial_credit=true", "train.eval_prompts=12",
        "train.eval_samples=2", "rollout.vllm.api_key_env=PDM_TEST_EVAL_NO_KEY"]


def _engine(task, seed: int) -> LocalEngine:
    return LocalEngine(TinyLM(vocab=task.vocab_size, seed=seed), vocab_size=task.vocab_size,
                       top_logprobs=8, seed=seed, eos_token_id=task.eos_id)


@pytest.fixture
def served():
    task = build_task(RunConfig.load(CONFIG, SETS + ["rollout.vllm.url=http://127.0.0.1:1"]))
    srv = FakeVLLMServer(_engine(task, seed=5))
    srv.start()
    yield srv, task
    srv.stop()


def test_record_is_the_served_models_greedy_scores_by_problem(served, tmp_path):
    srv, task = served
    cfg = RunConfig.load(CONFIG, SETS + [f"rollout.vllm.url={srv.url}"])
    out = eval_heldout.evaluate(cfg, str(tmp_path), name="before_rl", iteration=0)
    rec = out["record"]
    problems = task.eval_problems(cfg.seed, 12)
    assert rec.problems == problems and rec.name == "before_rl"
    # the same model answered directly, without HTTP: greedy responses scored by the task
    direct = _engine(task, seed=5).generate(
        [task.prompt_ids(q) for q in problems],
        {"temperature": 0.0, "max_new_tokens": task.max_new_tokens,
         "stop_token_ids": [task.eos_id]}, 1)
    by_prompt = {s.prompt_index: s.response_ids.tolist() for s in direct.samples}
    want = [float(task.score(q, by_prompt[i])) for i, q in enumerate(problems)]
    assert rec.greedy == pytest.approx(want)
    assert len(set(want)) > 1, "the check needs scores that differ between problems"
    assert rec.samples_per_problem == 2 and len(rec.sampled) == 12
    assert all(0.0 <= x <= 1.0 for x in rec.sampled)
    assert rec.crosscheck is None
    assert out["server"]["model"] == srv.model

    # a second record (another model after training, here the same one) pairs with the first
    eval_heldout.evaluate(cfg, str(tmp_path), name="after_rl", iteration=3)
    recs = ev.read_records(str(tmp_path))
    assert set(recs) == {"before_rl", "after_rl"} and recs["after_rl"].iteration == 3
    summary = json.loads((tmp_path / "heldout.json").read_text())["heldout"]
    assert summary["gain"]["problems"] == 12
    assert summary["gain"]["greedy"]["gain"] == pytest.approx(0.0)  # greedy is deterministic


def test_refuses_what_it_cannot_evaluate(tmp_path):
    with pytest.raises(ConfigError, match="rollout.engine='local'"):
        eval_heldout.evaluate(RunConfig.load(CONFIG, ["train.eval_prompts=4"]), str(tmp_path),
                              name="x", iteration=0)
    cfg = RunConfig.load(CONFIG, SETS + ["rollout.vllm.url=http://127.0.0.1:1",
                                         "train.eval_prompts=0"])
    with pytest.raises(ConfigError, match="train.eval_prompts=0"):
        eval_heldout.evaluate(cfg, str(tmp_path), name="x", iteration=0)
    assert not (tmp_path / ev.EVAL_FILE).exists()


def test_cli_prints_one_line_for_a_config_error(tmp_path, capsys):
    rc = run_cli(eval_heldout.main, ["--config", CONFIG, "--set", "train.eval_prompts=4",
                                     "--output-dir", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rollout.engine='local'") and "Traceback" not in err
