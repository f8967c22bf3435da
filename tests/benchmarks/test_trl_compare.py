"""benchmarks/trl_compare.py: the shared settings of the TRL comparison, their mapping onto TRL's
GRPOConfig, and the ratio table (pure logic; the TRL check skips cleanly without TRL)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("trl_compare", ROOT / "benchmarks" / "trl_compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_compare"] = module
    spec.loader.exec_module(module)
    return module


tc = _load()


def _cfg(**train):
    t = {"iterations": 3, "lr": 5e-6, "clip_grad": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.99,
         "weight_decay": 0.0, "microbatches_per_minibatch": 4, "minibatches_per_iteration": 1,
         "epochs_per_batch": 1, "eval_prompts": 64, "lr_warmup_steps": 0, **train}
    return {"seed": 1234, "train": t, "task": {"max_operand": 20, "heldout_fraction": 0.2},
            "rollout": {"prompts_per_iteration": 4, "group_size": 8, "max_new_tokens": 48,
                        "temperature": 0.7}}


def test_shared_settings_and_the_grpo_mapping():
    shared = tc.shared_settings(_cfg())
    assert set(shared) == set(tc.SHARED_KEYS)
    kw = tc.grpo_config_kwargs(shared, output_dir="/x")
    # one optimizer step per generation batch of prompts x group samples, in the same micro-batches
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 32
    assert kw["gradient_accumulation_steps"] == kw["steps_per_generation"] == 4
    assert kw["num_generations"] == 8 and kw["num_iterations"] == 1 and kw["max_steps"] == 3
    assert kw["max_completion_length"] == 48 and kw["temperature"] == 0.7
    assert kw["learning_rate"] == 5e-6 and kw["adam_beta2"] == 0.99 and kw["max_grad_norm"] == 1.0
    assert kw["scale_rewards"] == "none" and kw["loss_type"] == "dapo" and kw["beta"] == 0.0
    assert kw["shuffle_dataset"] is False and kw["gradient_checkpointing"] is False


@pytest.mark.parametrize("bad", [{"minibatches_per_iteration": 2}, {"epochs_per_batch": 2},
                                 {"lr_warmup_steps": 3}])
def test_settings_the_comparison_cannot_map_are_refused(bad):
    with pytest.raises(ValueError):
        tc.shared_settings(_cfg(**bad))


def test_uneven_micro_batches_are_refused():
    with pytest.raises(ValueError, match="divide"):
        tc.grpo_config_kwargs(tc.shared_settings(_cfg(microbatches_per_minibatch=3)), output_dir="/x")


def test_ratio_rows_and_table():
    trl = tc.run_summary("trl", [10.0, 30.0, 20.0], [100, 100, 100], (8, 64), (10, 64))
    ours = tc.run_summary("ours", [5.0, 5.0, 10.0], [100, 100, 100], (9, 64), (12, 64))
    assert trl["s_per_iter_median"] == 20.0 and trl["tokens_per_s"] == pytest.approx(5.0)
    rows = {r["name"]: r for r in tc.ratio_rows([trl, ours], "trl")}
    assert rows["trl"]["speedup_vs_trl"] == 1.0
    assert rows["ours"]["speedup_vs_trl"] == pytest.approx(4.0)
    assert rows["ours"]["tokens_per_s_ratio"] == pytest.approx(3.0)  # 15 against 5 tokens / s
    assert rows["ours"]["acc_after_diff"] == pytest.approx(2 / 64)
    md = tc.markdown_table(list(rows.values()), "trl")
    assert "| ours | 5.0 | 4.00x |" in md and md.count("\n") == 3
    with pytest.raises(ValueError, match="baseline"):
        tc.ratio_rows([ours], "trl")
    with pytest.raises(ValueError, match="one response-token count"):
        tc.run_summary("x", [1.0], [], (0, 1), (0, 1))
    assert math.isnan(tc.ratio_rows([tc.run_summary("z", [1.0], [0], (0, 0), (0, 0))], "z")[0]
                      ["acc_after"])


def test_the_mapping_is_a_valid_grpo_config():
    """Against the installed TRL (benchmark extra `bench-trl`): skipped without it."""
    trl = pytest.importorskip("trl")
    cfg = trl.GRPOConfig(**tc.grpo_config_kwargs(tc.shared_settings(_cfg()), output_dir="/tmp/x"))
    assert cfg.generation_batch_size == 32 and cfg.top_k == 0 and cfg.scale_rewards == "none"


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_trl_grpo",
                                                  ROOT / "benchmarks" / "bench_trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_serves_the_given_directory_and_evaluates_with_the_same_overrides():
    b = _bench()
    cmd = b.eval_command("runs/m", "out/e", "after_rl", ["seed=2", "train.eval_prompts=200"])
    sep = cmd.index("--")
    server, client = cmd[:sep], cmd[sep + 1:]
    assert server[server.index("--model-dir") + 1] == "runs/m"
    assert server[1:3] == ["-m", "megatron_pdm.train.rollout.vllm_server"]
    assert client[1:3] == ["-m", "megatron_pdm.tools.eval_heldout"]
    for side in (server, client):  # the server's sampling seed and the problems: one config
        sets = [side[i + 1] for i, x in enumerate(side) if x == "--set"]
        assert "seed=2" in sets and "train.eval_prompts=200" in sets
    assert "rollout.vllm.url={vllm_url}" in client
    assert client[client.index("--output-dir") + 1] == "out/e"
    assert client[client.index("--name") + 1] == "after_rl"


def _record(name, greedy, sampled):
    from megatron_pdm.train import evaluation as ev

    rec = ev.EvalRecord(name, 0, list(range(len(greedy))), list(greedy))
    rec.sampled, rec.samples_per_problem = list(sampled), 1
    return rec


def test_eval_into_takes_the_sides_accuracies_from_the_vllm_records(tmp_path):
    from megatron_pdm.train import evaluation as ev

    b = _bench()
    eval_dir = tmp_path / "trl-eval"
    ev.append_record(str(eval_dir), _record("before_rl", [0, 1, 0, 0], [0, 0, 1, 0]))
    ev.append_record(str(eval_dir), _record("after_rl", [1, 1, 0, 1], [1, 0, 1, 1]))
    (tmp_path / "trl.json").write_text('{"name": "trl", "acc_before": [0, 0], '
                                       '"acc_after": [0, 0]}')
    a = SimpleNamespace(summarize_only=True, into="trl", eval_dir=str(eval_dir),
                        out_dir=str(tmp_path), model_dir="-", name="after_rl", set=[])
    b.cmd_eval(a)
    res = json.loads((tmp_path / "trl.json").read_text())
    assert res["acc_before"] == [1, 4] and res["acc_after"] == [3, 4]
    assert res["eval"]["heldout"]["gain"]["greedy"]["gain"] == pytest.approx(0.5)


def test_paired_compares_runs_problem_by_problem_per_seed_and_pooled(tmp_path):
    from megatron_pdm.train import evaluation as ev

    b = _bench()
    for name, greedy in (("a1", [1, 1, 0, 0, 1]), ("b1", [1, 0, 1, 1, 1]),
                         ("a2", [0, 0, 0, 0, 1]), ("b2", [0, 0, 0, 1, 1])):
        ev.append_record(str(tmp_path / name), _record("after_rl", greedy, greedy))
    out = tmp_path / "p.json"
    b.cmd_paired(SimpleNamespace(a=[str(tmp_path / "a1"), str(tmp_path / "a2")],
                                 b=[str(tmp_path / "b1"), str(tmp_path / "b2")],
                                 record="after_rl", out=str(out)))
    res = json.loads(out.read_text())
    g1 = res["pairs"][0]["gain"]["greedy"]
    assert g1["gain"] == pytest.approx(0.2) and (g1["gained"], g1["lost"]) == (2, 1)  # B - A
    assert res["pairs"][1]["gain"]["greedy"]["gain"] == pytest.approx(0.2)
    assert res["pooled"]["greedy"]["gain"] == pytest.approx(0.2)  # mean over the two seeds
    assert res["pooled"]["problems"] == 5
    ev.append_record(str(tmp_path / "c"), _record("after_rl", [1, 0, 1], [0, 0, 1]))
    with pytest.raises(ValueError, match="different problems"):
        b.cmd_paired(SimpleNamespace(a=[str(tmp_path / "a1")], b=[str(tmp_path / "c")],
                                     record="after_rl", out=None))
    with pytest.raises(ValueError, match="one pair per seed"):
        b.cmd_paired(SimpleNamespace(a=[str(tmp_path / "a1")], b=[], record="after_rl",
                                     out=None))


def test_a_driver_run_without_evaluation_has_no_accuracy():
    b = _bench()
    assert b._correct(float("nan"), 0) == (0, 0)  # train.eval_prompts=0: summary's NaN
    assert b._correct(None, 64) == (0, 0)
    assert b._correct(0.165, 200) == (33, 200)


@pytest.mark.parametrize("argv,threads,reserved", [([], "2", "0"),
                                                   (["--threads", "1", "--vllm-reserved", "1"],
                                                    "1", "1")])
def test_the_driver_side_gets_the_cores_asked_for(monkeypatch, argv, threads, reserved):
    b = _bench()
    seen = {}

    class Launched(Exception):
        pass

    def fake_run(cmd, cwd, env, check):
        seen["cmd"], seen["env"] = cmd, env
        raise Launched

    monkeypatch.setattr(b.subprocess, "run", fake_run)
    with pytest.raises(Launched):
        b.main(["driver", "--preset", "grpo", *argv])
    assert seen["env"]["OMP_NUM_THREADS"] == threads
    assert seen["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == reserved
    assert f"OMP_NUM_THREADS={threads}" in seen["cmd"]  # the trainer's own env in the command
