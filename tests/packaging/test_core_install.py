"""The light core install: torch + numpy + pyyaml run the op at TP 2; megatron-core is an extra.

1. The wheel's metadata requires exactly torch, numpy and pyyaml without an extra; megatron-core
   (and transformers, aiohttp, matplotlib, ...) only under an extra.
2. A fresh venv whose only pre-installed packages are torch, numpy, pyyaml and torch's own
   dependencies (linked from this environment) installs the wheel with `--no-index` (a
   requirement outside those three would fail: there is no index) and runs `token_stats` +
   `policy_loss` at TP 2 over gloo from a directory outside the checkout, equal to TP 1; torch
   is not replaced; megatron is not importable there at all.
3. From the source tree, with imports of megatron, transformer_engine and every other non-core
   package blocked (a folder of stand-in packages that raise ImportError, first on PYTHONPATH,
   inherited by the spawned workers), the own-loop example (examples/own_loop/forward_step.py)
   runs at TP 2 and equals TP 1, and none of the blocked modules was loaded.

~1-2 min on 2 cores (the wheel build, the venv and three gloo runs).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from tests.packaging.test_wheel_install import _build_wheel, _run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
CORE = {"torch", "numpy", "pyyaml"}
BLOCKED = ("megatron", "transformer_engine", "transformers", "aiohttp", "orjson", "pybase64",
           "matplotlib", "safetensors", "tqdm", "tensorboard", "psutil", "wandb")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_wheel_metadata_requires_only_the_core(wheel):
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    requires = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Requires-Dist:")]
    core = {_norm(re.split(r"[<>=!~;\[ ]", r)[0]) for r in requires if "extra ==" not in r}
    assert core == CORE, requires
    mcore = [r for r in requires if _norm(r).startswith("megatron-core")]
    assert mcore and all("extra ==" in r for r in mcore), mcore
    assert any('extra == "megatron"' in r for r in mcore), mcore


def _closure(names: set[str]) -> set[str]:
    """Distributions needed by `names` in this environment (their non-extra requirements)."""
    seen, todo = set(), list(names)
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[<>=!~;\[ (]", req)[0])
    return seen


def _stack_of(names: set[str], stack: Path) -> None:
    """Links the top-level files of these distributions (and their dist-info) into `stack`."""
    stack.mkdir()
    for name in names:
        dist = md.distribution(name)
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in tops:
            src = base / top
            if top not in ("..", "__pycache__") and src.exists() and not (stack / top).exists():
                (stack / top).symlink_to(src)


PROBE = textwrap.dedent('''
    import importlib.util, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import megatron_pdm as pdm

    def case():
        g = torch.Generator().manual_seed(3)
        n, v, k = 12, 40, 4
        logits = torch.randn(n, v, generator=g, dtype=torch.float64)
        logmu = torch.log_softmax(logits + 0.3 * torch.randn(n, v, generator=g,
                                                            dtype=torch.float64), -1)
        sampled = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1)
        top = logmu.topk(k)
        ids, lp, valid, _ = pdm.fold_support_torch(top.indices, top.values,
            torch.ones(n, k, dtype=torch.bool), sampled, logmu.gather(1, sampled[:, None])[:, 0])
        return logits, sampled, ids, lp, valid, logmu.gather(1, sampled[:, None])[:, 0].float()

    def loss(logits, group, rank, world):
        full, sampled, ids, lp, valid, blp = case()
        vl = full.shape[1] // world
        shard = full[:, rank * vl:(rank + 1) * vl].clone().requires_grad_()
        st = pdm.token_stats(shard, sampled, ids, lp, valid, tp_group=group,
                             vocab_size=full.shape[1])
        out = pdm.policy_loss(st, torch.linspace(-1, 1, 12), blp, torch.ones(12, dtype=torch.bool),
                              pdm.PolicyLossConfig.preset("pdm-agg", is_mask="sequence",
                                                          is_mask_high=3.0),
                              seq_ids=torch.arange(12) // 4)
        out.loss_sum.backward()
        return float(out.loss_sum), shard.grad

    def worker(rank, world, path):
        dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world)
        value, grad = loss(None, dist.group.WORLD, rank, world)
        ref_value, ref_grad = loss(None, None, 0, 1)
        vl = ref_grad.shape[1] // world
        assert abs(value - ref_value) < 1e-10, (value, ref_value)
        assert torch.allclose(grad, ref_grad[:, rank * vl:(rank + 1) * vl], atol=1e-10)
        dist.destroy_process_group()

    if __name__ == "__main__":
        assert importlib.util.find_spec("megatron") is None, "megatron is importable here"
        mp.start_processes(worker, args=(2, sys.argv[1]), nprocs=2, join=True,
                           start_method="spawn")
        print("TP2 == TP1 OK", pdm.__file__)
''')


def test_torch_numpy_pyyaml_and_the_wheel_run_the_op_at_tp2(wheel, tmp_path):
    try:
        import venv  # noqa: F401
    except ImportError as err:
        pytest.skip(f"cannot make a venv here: {err}")
    env_dir = tmp_path / "venv"
    _run([sys._base_executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp_path)
    py = env_dir / "bin" / "python"
    names = _closure(CORE)
    assert not any(n.startswith("megatron") for n in names), names
    _stack_of(names, tmp_path / "stack")
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=tmp_path).stdout.strip())
    (purelib / "core_stack.pth").write_text(f"{tmp_path / 'stack'}\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    before = _run([py, "-c", "import torch; print(torch.__version__, torch.__file__)"],
                  cwd=work, env=env).stdout
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "-q", wheel],
         cwd=work, env=env)
    after = _run([py, "-c", "import torch; print(torch.__version__, torch.__file__)"],
                 cwd=work, env=env).stdout
    assert before == after and not list(purelib.glob("torch*"))
    (work / "probe.py").write_text(PROBE)
    out = _run([py, "probe.py", str(tmp_path / "rendezvous")], cwd=work, env=env,
               timeout=300).stdout
    assert "TP2 == TP1 OK" in out and str(purelib) in out, out


EXAMPLE_PROBE = textwrap.dedent('''
    import importlib.util, math, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    def example():
        spec = importlib.util.spec_from_file_location("ex", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def loaded():
        return sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[3].split(","))

    def worker(rank, world, path, out):
        dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world)
        rows = example().run(steps=2, tp_group=dist.group.WORLD)
        assert not loaded(), loaded()
        if rank == 0:
            torch.save(rows, out)
        dist.destroy_process_group()

    if __name__ == "__main__":
        tp1 = example().run(steps=2)
        mp.start_processes(worker, args=(2, sys.argv[2], sys.argv[2] + ".pt"), nprocs=2,
                           join=True, start_method="spawn")
        tp2 = torch.load(sys.argv[2] + ".pt")
        for a, b in zip(tp1, tp2):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-6), (a, b)
        assert not loaded(), loaded()
        print("example TP2 == TP1 without", sys.argv[3])
''')


def test_the_own_loop_example_runs_at_tp2_with_megatron_blocked(tmp_path):
    block = tmp_path / "block"
    for name in BLOCKED:
        (block / name).mkdir(parents=True)
        (block / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: not part of the core install')\n")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{block}{os.pathsep}{ROOT}")
    (tmp_path / "probe.py").write_text(EXAMPLE_PROBE)
    out = _run([sys.executable, "probe.py", ROOT / "examples" / "own_loop" / "forward_step.py",
                tmp_path / "rendezvous", ",".join(BLOCKED)], cwd=tmp_path, env=env,
               timeout=300).stdout
    assert "example TP2 == TP1" in out, out
    # the blocker works: megatron really is unimportable under it
    proc = subprocess.run([sys.executable, "-c", "import megatron.core"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "blocked" in proc.stderr
    assert torch.__version__  # this process' torch is untouched
