"""The triton stand-in is in place after `import megatron_pdm`, whatever the process imports next.

A fake megatron-core whose paged-stash module does `import triton` (as megatron-core 0.19's does,
moe/ops/paged_stash.py:4) sits first on the path of a fresh interpreter in which triton cannot be
imported; importing it right after `import megatron_pdm`, with no `megatron_pdm.mcore` import in
between (what a spawned test worker does), must give the stub, not ModuleNotFoundError.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCKER = """
import importlib.abc, importlib.machinery, sys
class Block(importlib.abc.MetaPathFinder):  # triton absent, even where it is installed
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: (None if name == "triton" else _find_spec(name, *a))
"""


def _run(tmp_path, code: str) -> subprocess.CompletedProcess:
    ops = tmp_path / "megatron" / "core" / "transformer" / "moe" / "ops"
    ops.mkdir(parents=True)
    (ops / "paged_stash.py").write_text("import triton\n")
    for d in [ops, *ops.parents][:5]:  # regular packages: they win over an installed megatron
        (d / "__init__.py").write_text("")
    (tmp_path / "triton_blocker.py").write_text("import importlib.util\n" + BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    return subprocess.run([sys.executable, "-c", "import triton_blocker\n" + code], env=env,
                          capture_output=True, text=True, timeout=120)


def test_stub_present_without_importing_mcore_first(tmp_path):
    proc = _run(tmp_path, textwrap.dedent("""
        import megatron_pdm
        import sys
        assert "megatron_pdm.mcore" not in sys.modules
        from megatron.core.transformer.moe.ops import paged_stash
        assert paged_stash.GLOBAL_BLOCK_SIZE == 1024
        try:
            paged_stash.paged_stash_copy_kernel()
        except RuntimeError as exc:
            assert "needs triton" in str(exc)
        else:
            raise AssertionError("the stub kernel did not raise")
    """))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_without_the_package_the_fake_really_needs_triton(tmp_path):
    """The set-up is real: without megatron_pdm the same import fails."""
    proc = _run(tmp_path, "from megatron.core.transformer.moe.ops import paged_stash\n")
    assert proc.returncode != 0 and "No module named 'triton'" in proc.stderr, proc.stderr


@pytest.mark.gloo
def test_stub_present_in_a_gloo_worker_whose_module_imports_megatron_first(tmp_path):
    """tests.support._dist.run_gloo's spawned workers start bare: a worker function whose own module
    imports nothing of megatron_pdm and whose body imports megatron-core first still gets the stub
    (run_gloo's worker imports the package before calling it). The blocker goes in as
    sitecustomize, so the spawned interpreter cannot import triton either."""
    (tmp_path / "sitecustomize.py").write_text("import importlib.util\n" + BLOCKER)
    (tmp_path / "gloo_worker.py").write_text(textwrap.dedent("""
        from tests.support._dist import run_gloo


        def work(rank, world_size):
            from megatron.core.transformer.moe.ops import paged_stash
            assert paged_stash.GLOBAL_BLOCK_SIZE == 1024
    """))
    proc = _run(tmp_path, textwrap.dedent("""
        import sys
        import gloo_worker
        assert "megatron_pdm" not in sys.modules  # only the spawned worker imports it
        gloo_worker.run_gloo(gloo_worker.work, 1)
    """))
    assert proc.returncode == 0, proc.stderr[-3000:]
