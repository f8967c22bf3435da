"""Driver settings without a process group: the cluster scripts' overrides, precision/recompute
mapping, refusals, checkpoint-arch checks and the jsonl task (fast, single process)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pdm.train import model_setup as ms
from megatron_pdm.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen3_30b_a3b"
TINY = ROOT / "examples" / "tiny_cpu" / "config.yaml"


def script_args(name: str, env: dict | None = None) -> list[str]:
    """The driver arguments a cluster script passes, as the script itself prints them
    (`--print-args`: it stops before any GPU, NCCL or MASTER_ADDR check), under `env` only."""
    return list(_script_args(name, tuple(sorted((env or {}).items()))))


@functools.lru_cache(maxsize=None)
def _script_args(name: str, env: tuple) -> tuple[str, ...]:
    run_env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
               **dict(env)}
    proc = subprocess.run(["bash", str(EXAMPLE / name), "--print-args"], cwd=str(ROOT),
                          env=run_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (name, env, proc.stderr[-3000:])
    return tuple(proc.stdout.splitlines())


def script_overrides(name: str, env: dict | None = None) -> list[str]:
    """Every `--set KEY=VALUE` a cluster script passes to the driver."""
    args = script_args(name, env)
    return [args[i + 1] for i, tok in enumerate(args[:-1]) if tok == "--set"]


def test_the_cluster_architecture_has_one_source():
    """pdm.yaml restates no shape of Qwen3-30B-A3B: the scripts pass megatron_pdm/arch.py's
    preset (model.sh), and the config they resolve is that preset (RL's aux-loss choice aside)."""
    import dataclasses
    import yaml

    from megatron_pdm.arch import ModelArch

    assert set(yaml.safe_load((EXAMPLE / "pdm.yaml").read_text())["model"]) == {
        "moe_aux_loss_coeff"}
    for script in ("train_pdm.sh", "train_pdm_fp8.sh"):
        cfg = RunConfig.load(str(EXAMPLE / "pdm.yaml"), script_overrides(script))
        want = dataclasses.replace(ModelArch.qwen3_30b_a3b(), moe_aux_loss_coeff=0.0)
        assert cfg.model == want, script


def test_print_args_is_the_driver_command_line_and_runs_no_check():
    """`--print-args` stops before the checks a real start makes: with PRECISION=fp8 on a machine
    without CUDA, NNODES=2 and no MASTER_ADDR, each of them would refuse (exit 2)."""
    args = script_args("train_pdm_fp8.sh", {"NNODES": "2"})
    assert args[:2] == ["--config", str(EXAMPLE / "pdm.yaml")]
    assert args == script_args("train_pdm.sh", {"NNODES": "2", "PRECISION": "fp8"})
    bf16 = script_overrides("train_pdm.sh")
    assert "precision.fp8=e4m3" not in bf16 and "rollout.rollout_precision=bf16" in bf16
    assert [o for o in script_overrides("train_pdm.sh", {"TP": "2", "SEQ_LENGTH": "4096"})
            if not o.startswith("model.")][:1] == ["parallel.tp=2"]
    assert "rollout.max_sequence_length=4096" in script_overrides(
        "train_pdm.sh", {"SEQ_LENGTH": "4096"})


def test_unknown_precision_is_refused():
    proc = subprocess.run(["bash", str(EXAMPLE / "train_pdm.sh"), "--print-args"], cwd=str(ROOT),
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT),
                               "PYTHON": sys.executable, "PRECISION": "fp16"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "PRECISION=fp16: give bf16 or fp8" in proc.stderr


@pytest.mark.parametrize("script", ["train_pdm.sh", "train_pdm_fp8.sh"])
@pytest.mark.parametrize("env,world", [({}, 16), ({"PP": "2"}, 32), ({"TP": "2", "EP": "4"}, 8)])
def test_cluster_scripts_dry_run(script, env, world, monkeypatch, capsys):
    from megatron_pdm.train.dry_run import dry_run

    overrides = script_overrides(script, env)
    keys = {o.split("=", 1)[0] for o in overrides}
    for key in ("parallel.pp", "precision.params_dtype", "checkpoint.load_dir", "rollout.engine",
                "rollout.sglang.url", "rollout.sglang.hf_checkpoint",
                "rollout.sglang.weight_sync.mode", "rollout.max_sequence_length",
                "train.recompute", "task.path", "task.tokenizer_dir"):
        assert key in keys, key
    cfg = RunConfig.load(str(EXAMPLE / "pdm.yaml"), overrides)
    assert cfg.rollout.engine == "sglang" and cfg.task.name == "jsonl"
    assert cfg.parallel.pp == int(env.get("PP", 1))
    if script == "train_pdm_fp8.sh":
        assert (cfg.precision.fp8, cfg.precision.fp8_recipe) == ("e4m3", "blockwise")
        assert cfg.rollout.rollout_precision == "fp8"
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert dry_run(cfg) == 0
    out = capsys.readouterr().out
    assert "rollout engine sglang" in out and "recompute full" in out


def test_precision_and_recompute_mapping():
    import torch

    from megatron_pdm.mcore.model import transformer_config

    cfg = RunConfig.load(str(TINY), ["precision.params_dtype=bf16", "precision.fp8=e4m3",
                                     "precision.fp8_recipe=blockwise", "train.recompute=full"])
    kw = ms.megatron_kwargs(cfg)
    assert kw == {"params_dtype": torch.bfloat16, "bf16": True, "fp8": "e4m3",
                  "fp8_recipe": "blockwise", "recompute_granularity": "full",
                  "recompute_method": "uniform", "recompute_num_layers": 1}
    assert ms.use_te(cfg) and ms.key_style(cfg) == "te"
    arch = ms.resolve_arch(cfg, 18)
    for recompute in ("none", "full", "selective"):
        c = RunConfig.load(str(TINY), [f"train.recompute={recompute}"])
        tc = transformer_config(arch, tp=2, **ms.megatron_kwargs(c))
        assert tc.recompute_granularity == (None if recompute == "none" else recompute)
        assert tc.params_dtype == torch.float32 and not tc.bf16
    tc = transformer_config(arch, tp=2, **{k: v for k, v in kw.items() if "fp8" not in k})
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.recompute_method == "uniform"


def test_runtime_refusals_on_cpu():
    fp8 = RunConfig.load(str(TINY), ["precision.fp8=hybrid", "precision.fp8_recipe=delayed"])
    with pytest.raises(RuntimeError, match="needs a CUDA GPU and transformer-engine"):
        ms.check_runtime(fp8, cuda=False, te=False)
    ms.check_runtime(fp8, cuda=True, te=True)
    bf16 = RunConfig.load(str(TINY), ["precision.params_dtype=bf16"])
    with pytest.raises(RuntimeError, match="params_dtype=bf16 needs a CUDA GPU"):
        ms.check_runtime(bf16, cuda=False)
    full = RunConfig.load(str(TINY), ["train.recompute=full"])
    with pytest.raises(RuntimeError, match="train.recompute=full needs a CUDA GPU"):
        ms.check_runtime(full, cuda=False)
    ms.check_runtime(full, cuda=True)
    with pytest.raises(ValueError, match="fp8_recipe='e5m2'"):
        RunConfig.load(str(TINY), ["precision.fp8_recipe=e5m2"])
    with pytest.raises(ValueError, match="rollout.engine=sglang needs rollout.sglang.url"):
        RunConfig.load(str(TINY), ["rollout.engine=sglang", "rollout.sglang.hf_checkpoint=/x"])


def test_checkpoint_arch_must_agree():
    cfg = RunConfig.load(str(TINY), ["checkpoint.load_dir=/ckpt"])
    arch = ms.resolve_arch(cfg, 18).to_dict()
    meta = {"arch": dict(arch, hidden_size=128, num_experts=8)}
    with pytest.raises(ms.ArchMismatchError) as err:
        ms.resolve_arch(cfg, 18, meta=meta)
    assert "hidden_size=64, checkpoint has 128" in str(err.value)
    assert "num_experts=4, checkpoint has 8" in str(err.value)
    taken = RunConfig.load(str(TINY), ["checkpoint.load_dir=/ckpt",
                                       "checkpoint.arch_from_load_dir=true"])
    assert ms.resolve_arch(taken, 18, meta=meta).hidden_size == 128
    assert ms.resolve_arch(cfg, 18, meta={"arch": arch}).vocab_size == 18
    with pytest.raises(ValueError, match="task vocabulary"):
        ms.resolve_arch(taken, 2000, meta=meta)


def _tiny_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} plus {b}? The answer is \\boxed{{{a + b}}}." for a in range(20)
              for b in range(5)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                          "<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(path))
    return fast


def test_jsonl_task(tmp_path):
    from megatron_pdm.train.jsonl_task import JsonlTask, answers_match, extract_answer

    _tiny_tokenizer(tmp_path / "tok")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} plus 3?", "answer": a + 3}) + "\n"
                            for a in range(10)))
    task = JsonlTask(str(data), str(tmp_path / "tok"), eval_fraction=0.2,
                     max_sequence_length=64)
    tok = task.tokenizer
    assert task.eos_id == tok.convert_tokens_to_ids("<|im_end|>") and task.vocab_size == len(tok)
    assert len(task.train_records) == 8 and task.eval_problems(0, 5) == [8, 9]
    ids = task.prompt_ids(0)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 0 plus 3?") and text.endswith("assistant\n")
    assert task.max_new_tokens == 64 - task.max_prompt_len
    assert task.problems(1, 3, 4) == task.problems(1, 3, 4) != task.problems(1, 4, 4)
    good = tok("So the answer is \\boxed{3}.")["input_ids"] + [task.eos_id]
    assert task.score(0, good) == 1.0
    assert task.score(1, good) == 0.0  # problem 1 expects 4
    assert task.score(0, tok("I think it is 3")["input_ids"]) == 1.0
    assert extract_answer("a 1, then \\boxed{\\frac{1}{2}} b 7") == "\\frac{1}{2}"
    assert answers_match("total: 1,000.0", "1000") and not answers_match("no number", 5)


# ---------------------------------------------------------------- cluster scripts' --dry-run

_MEM_KEYS = ("weights", "grads", "optimizer", "activations", "logits", "total")


def _dry_run_figures(script: str, world: int, monkeypatch, capsys, *, te: bool = True) -> dict:
    """GiB per GPU as printed by the driver's --dry-run for the script's overrides at `world`,
    on a machine where transformer-engine is importable (`te`, the cluster's: the TE layer spec)
    or not (the local spec, whose s x s attention scores the estimate adds)."""
    from megatron_pdm.train.dry_run import dry_run

    monkeypatch.setattr(ms, "have_transformer_engine", lambda: te)
    cfg = RunConfig.load(str(EXAMPLE / "pdm.yaml"), script_overrides(script))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    assert dry_run(cfg) == 0
    out = capsys.readouterr().out
    figures = {k: float(re.search(rf"^\s+{k}\s+([\d.]+) GiB", out, re.M).group(1))
               for k in _MEM_KEYS}
    figures["micro"] = int(re.search(r"micro-batch: (\d+) x", out).group(1))
    scores = re.search(r"^\s+attn scores\s+([\d.]+) GiB", out, re.M)
    figures["scores"] = float(scores.group(1)) if scores else 0.0
    return figures


@pytest.mark.parametrize("script", ["train_pdm.sh", "train_pdm_fp8.sh"])
@pytest.mark.parametrize("nnodes", [None, "1"], ids=["default", "nnodes1"])
def test_script_dry_run_runs_on_this_machine_and_prints_here(script, nnodes):
    """`bash train_pdm.sh --dry-run` as its header says: no rendezvous (it hung waiting for a
    second node), the report on this console (it went to a per-rank log file)."""
    import signal

    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "WORLD_SIZE", "RANK")}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=str(ROOT), PYTHON=sys.executable, MASTER_PORT="29391")
    if nnodes:
        env["NNODES"] = nnodes
    proc = subprocess.Popen(["bash", str(EXAMPLE / script), "--dry-run"], cwd=str(ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{script} --dry-run (NNODES={nnodes or 'default'}) did not finish in 120 s")
    assert proc.returncode == 0, err[-3000:]
    world = 8 * int(nnodes or 2)
    assert f"layout: world={world} TP=4" in out, out + err
    assert re.search(r"^\s+total\s+[\d.]+ GiB", out, re.M), out


@pytest.mark.parametrize("script", ["train_pdm.sh", "train_pdm_fp8.sh"])
def test_script_header_memory_is_the_dry_run(script, monkeypatch, capsys):
    """The header's memory lines are what the script's own --dry-run prints."""
    text = (EXAMPLE / script).read_text()
    lines = re.findall(r"^#\s+world (\d+) \(NNODES=\d+, DP\d+, micro-batch (\d+)\): weights "
                       r"([\d.]+), grads ([\d.]+), optimizer ([\d.]+), activations ([\d.]+), "
                       r"logits ([\d.]+) = ([\d.]+) GiB", text, re.M)
    assert sorted(int(x[0]) for x in lines) == [8, 16], "header lacks the world 8/16 lines"
    for world, micro, *gib in lines:
        got = _dry_run_figures(script, int(world), monkeypatch, capsys)
        assert int(micro) == got["micro"], (script, world)
        assert [float(x) for x in gib] == [round(got[k], 1) for k in _MEM_KEYS], (script, world)


def test_script_header_local_spec_line_is_the_dry_run(monkeypatch, capsys):
    """Without transformer-engine the bf16 script's dry run adds the local spec's attention
    scores; the header states them."""
    text = (EXAMPLE / "train_pdm.sh").read_text()
    m = re.search(r"^#\s+without transformer-engine .*: \+([\d.]+) GiB \(world 16\), "
                  r"\+([\d.]+) GiB \(world 8\)", text, re.M)
    assert m, "train_pdm.sh header lacks the local-spec line"
    for world, stated in ((16, m.group(1)), (8, m.group(2))):
        local = _dry_run_figures("train_pdm.sh", world, monkeypatch, capsys, te=False)
        fused = _dry_run_figures("train_pdm.sh", world, monkeypatch, capsys, te=True)
        assert fused["scores"] == 0 and local["scores"] == float(stated), world
        assert round(local["total"] - fused["total"], 1) == float(stated), world


def test_readme_memory_table_is_the_dry_run(monkeypatch, capsys):
    """The cluster README's per-GPU memory table: every row equals the scripts' --dry-run output."""
    readme = (ROOT / "examples" / "qwen3_30b_a3b" / "README.md").read_text()
    rows = re.findall(r"^\| `(train_pdm(?:_fp8)?\.sh)` \| (\d+) \(\d+×8\) \| \d+ \| (\d+) × 8192 \| "
                      + r" \| ".join([r"([\d.]+) GiB"] * 6) + r" \|$", readme, re.M)
    assert len(rows) >= 4, "README has no memory table generated from --dry-run"
    for script, world, micro, *gib in rows:
        got = _dry_run_figures(script, int(world), monkeypatch, capsys)
        assert int(micro) == got["micro"], (script, world)
        assert [float(x) for x in gib] == [round(got[k], 1) for k in _MEM_KEYS], (script, world)
