"""`megatron-pdm-stability --model real` (megatron_pdm/stability/profiles.py): the real-model
profile's sizes are valid driver keys, every cell gets its own vLLM server launcher, the runs start
from the converted checkpoint without a warm-up (compare.shared_warmup with warmup.steps=0), and
bad input names the option or key. Nothing here starts a run, a server or loads the model."""

from __future__ import annotations

import json
import os

import pytest

from megatron_pdm.configtree import ConfigError
from megatron_pdm.stability import grid as G
from megatron_pdm.stability import profiles
from megatron_pdm.tools import stability as tool
from megatron_pdm.train import compare
from megatron_pdm.train.config import RunConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REAL_CONFIG = os.path.join(ROOT, "examples", "real_cpu", "config.yaml")


def _dirs(tmp_path):
    hf, mcore = tmp_path / "hf", tmp_path / "mcore"
    hf.mkdir()
    mcore.mkdir()
    (hf / "config.json").write_text("{}")
    (mcore / "pdm_model.json").write_text("{}")
    return str(hf), str(mcore)


def test_unknown_profile_names_the_option():
    with pytest.raises(ValueError, match=r"--model 'huge'"):
        profiles.get("huge")


def test_real_profile_missing_dirs_name_the_option(tmp_path):
    hf, mcore = _dirs(tmp_path)
    with pytest.raises(ValueError, match=r"--real-hf-dir .*no config\.json"):
        profiles.real(str(tmp_path / "none"), mcore)
    with pytest.raises(ValueError, match=r"--real-mcore-dir .*no pdm_model\.json"):
        profiles.real(hf, str(tmp_path / "none"))
    profiles.real(str(tmp_path / "a"), str(tmp_path / "b"), check=False)  # --report-only


def test_real_sizes_are_driver_keys(tmp_path):
    hf, mcore = _dirs(tmp_path)
    prof = profiles.real(hf, mcore)
    assert prof.config == os.path.join("examples", "real_cpu", "config.yaml") and not prof.warmup
    for sizes in (prof.sizes, prof.smoke_sizes):
        cfg = RunConfig.load(REAL_CONFIG, [*sizes, f"output_dir={tmp_path / 'run'}", "seed=3"])
        assert cfg.warmup.steps == 0 and cfg.parallel.tp == 1
        assert cfg.checkpoint.load_dir == mcore and cfg.task.tokenizer_dir == hf
        assert cfg.rollout.engine == "vllm" and cfg.rollout.rollout_precision == "fp32"
        assert cfg.rollout.vllm.url == "{vllm_url}"  # filled in by the per-run launcher
    cfg = RunConfig.load(REAL_CONFIG, [*prof.sizes, f"output_dir={tmp_path / 'run'}"])
    assert cfg.train.eval_prompts == 64 and cfg.train.minibatches_per_iteration == 1
    # a stress setting is plain keys on top (and --set after the sizes wins)
    cfg = RunConfig.load(REAL_CONFIG, [*prof.sizes, *G.SETTINGS["epochs4"], "train.lr=3e-5",
                                       f"output_dir={tmp_path / 'run'}"])
    assert cfg.train.epochs_per_batch == 4 and cfg.train.lr == 3e-5
    cfg = RunConfig.load(REAL_CONFIG, [*prof.sizes, *G.SETTINGS["real-mb4-lr2e-5"],
                                       f"output_dir={tmp_path / 'run'}"])
    assert cfg.train.minibatches_per_iteration == 4 and cfg.train.lr == 2e-5
    # the real model's settings are asked for by name, never in the tiny default grid
    assert not [s for s in G.DEFAULT_SETTINGS if s.startswith("real-")]
    assert {"real-mb4-lr2e-5", "real-mb4-lr5e-5"} <= set(G.SETTINGS)


def test_every_real_cell_gets_its_own_server(tmp_path):
    hf, mcore = _dirs(tmp_path)
    prof = profiles.real(hf, mcore)
    grid = G.Grid(["pdm-agg"], ["base", "engine-vllm-bf16"], [7], sizes=prof.sizes,
                  server=prof.server)
    base, bf16 = grid.cells()
    cmd = grid.launcher(base, "cfg.yaml")
    assert cmd[1:3] == ["-m", "megatron_pdm.train.rollout.vllm_server"] and cmd[-1] == "--"
    assert cmd[3:7] == ["--config", "cfg.yaml", "--set", "seed=7"]
    assert cmd[cmd.index("--model-dir") + 1] == hf
    assert "--dtype" not in cmd  # fp32 server (the launcher's default), as make demo-real
    assert grid.launcher(bf16, "cfg.yaml")[-3:] == ["--dtype", "bfloat16", "--"]
    # the tiny profile: a server only for the setting that asks for one
    tiny = G.Grid(["pdm-agg"], ["base", "engine-vllm-bf16"], [7])
    assert tiny.launcher(tiny.cells()[0], "cfg.yaml") == []
    assert "--model-dir" not in tiny.launcher(tiny.cells()[1], "cfg.yaml")


def test_no_warmup_starts_from_load_dir(tmp_path, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("no warm-up run without warm-up steps")

    monkeypatch.setattr(compare, "_torchrun", no_run)
    hf, mcore = _dirs(tmp_path)
    sizes = profiles.real(hf, mcore).sizes
    rec = compare.shared_warmup(REAL_CONFIG, str(tmp_path / "warm"), sizes, 1, 1)
    assert rec["start_dir"] == mcore and rec["evals"] == {}
    with pytest.raises(ConfigError, match=r"warmup\.steps=0 and no checkpoint\.load_dir"):
        compare.shared_warmup(REAL_CONFIG, str(tmp_path / "warm"),
                              [*sizes, "checkpoint.load_dir=null",
                               "checkpoint.arch_from_load_dir=false"], 1, 1)

    seen = []
    monkeypatch.setattr(compare, "_torchrun", lambda args, *a: seen.append(args))
    compare.run_one(REAL_CONFIG, "pdm-agg", 2, str(tmp_path / "r"), rec["start_dir"], sizes, 1, 1)
    sets = [seen[0][i + 1] for i, a in enumerate(seen[0]) if a == "--set"]
    assert sets[-3:-1] == [f"checkpoint.load_dir={mcore}", "warmup.steps=0"]


def test_cli_real_profile(tmp_path, monkeypatch):
    hf, mcore = _dirs(tmp_path)
    seen = {}

    def fake_grid(grid, *, config, out, warmup_overrides, nproc, threads, jobs):
        seen.update(grid=grid, config=config, warmup=warmup_overrides, jobs=jobs)
        return []

    def fake_write(out, records, **kw):
        seen["report"] = kw["grid"]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write("ok\n")

    monkeypatch.setattr(tool.run, "run_grid", fake_grid)
    monkeypatch.setattr(tool.report, "write", fake_write)
    out = str(tmp_path / "out")
    assert tool.main(["--model", "real", "--real-hf-dir", hf, "--real-mcore-dir", mcore,
                      "--output-dir", out, "--methods", "pdm-agg", "--settings", "epochs4",
                      "--seeds", "1", "--set", "train.lr=3e-5"]) == 0
    assert seen["config"] == os.path.join("examples", "real_cpu", "config.yaml")
    assert seen["warmup"] == [] and seen["grid"].server[-4:] == ["--max-model-len", "512",
                                                                 "--kv-cache-mb", "512"]
    assert seen["grid"].sizes[-1] == "train.lr=3e-5"  # --set after the profile's sizes
    assert seen["report"]["model"] == "real"
    # each real-model cell starts a vLLM server: one core more per cell in the default
    assert seen["jobs"] == tool.run.default_jobs(1, 1, server=True)
    json.dumps(seen["report"])  # results.json stays serialisable
    with pytest.raises(SystemExit):  # argparse error naming the option, before any run
        tool.main(["--model", "real", "--real-mcore-dir", str(tmp_path / "none"),
                   "--real-hf-dir", hf, "--output-dir", out])
