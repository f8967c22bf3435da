"""megatron-core's jit_fuser after `import megatron_pdm` (megatron_pdm/cpu_jit.py): megatron's own
no-op decorator where torch sees no CUDA device, so importing megatron-core loads neither
torch._dynamo nor torch._inductor and the MoE router's `_apply_expert_bias` runs eagerly; and
the set-up is real: a process that imports megatron-core first gets torch.compile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRITON_STUB = os.path.join(ROOT, "megatron_pdm", "triton_stub.py")


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_no_torch_compile_without_cuda_after_the_package():
    proc = _run("""
        import sys
        import megatron_pdm
        assert "torch" not in sys.modules  # the finder itself needs no torch
        import megatron.core.models.gpt
        import megatron.core.jit as jit
        import torch
        from megatron.core.transformer.moe.router import TopKRouter
        compiled = hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")
        if torch.cuda.is_available():
            assert jit.jit_fuser is torch.compile and compiled
        else:
            assert jit.jit_fuser is jit.noop_decorator and not compiled
            assert "torch._inductor" not in sys.modules, "inductor was imported"
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_megatron_imported_first_keeps_torch_compile():
    """Without the package's finder megatron decorates with torch.compile (here the triton
    stand-in is loaded from its file alone, for megatron-core 0.19 without triton)."""
    proc = _run(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("_triton_stub", {TRITON_STUB!r})
        stub = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(stub)
        stub.stub_triton_paged_stash()
        import megatron.core.jit as jit
        import torch
        assert jit.jit_fuser is torch.compile, jit.jit_fuser
        assert "megatron_pdm" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
