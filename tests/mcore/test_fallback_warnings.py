"""megatron-core's Apex/TE fallback warnings are summarised once instead of printed per module.

Without this, every rank prints six near-identical "... not installed. Falling back to ..."
warnings at import. Importing `megatron_pdm.mcore` routes exactly those into one summary line
(logged by the trainer on rank 0); other warnings still print.
"""

import subprocess
import sys

import pytest

CODE = """
import warnings
import megatron_pdm.mcore as mc
import megatron.core.optimizer
from megatron.core.models.gpt import gpt_layer_specs
warnings.warn("an unrelated warning")
print(mc.fallback_summary())
"""


@pytest.mark.megatron
def test_fallback_warnings_become_one_summary():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Falling back" not in proc.stderr
    assert "an unrelated warning" in proc.stderr
    assert proc.stdout.count("falls back to") == 1 and "Torch" in proc.stdout
