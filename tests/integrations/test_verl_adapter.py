"""megatron_pdm.integrations.verl against the installed verl 0.9.1 (CPU, function level).

One subprocess in the verl env (conftest.py) runs every check of verl_checks.py and writes a
report; each test below asserts its entry. What each check compares is in its docstring there:
the losses found through verl's own registry equal the project's `policy_loss` (value and
logits gradient, fp64, every registered preset, token-mean and seq-mean-token-sum), verl's own
`ppo_loss` path through `pdm_ppo_loss` on a nested no-padding batch, registration only on
import, and bad input named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

pytestmark = pytest.mark.verl
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = Path(HERE).parents[1]


def verl_pythonpath() -> str:
    """The verl env's PYTHONPATH (conftest.py skips these tests when it is missing)."""
    base = Path(os.environ.get("VERL_ENV") or ROOT / ".cache" / "verl-env")
    return (base / "pythonpath").read_text().strip()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("verl") / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([verl_pythonpath(), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "verl_checks.py"),
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", [
    "registry_after_import_only",
    "loss_equals_project_token_mean",
    "loss_equals_project_seq_mean_token_sum",
    "masking_is_live",
    "ppo_loss_path_equals_project",
    "bad_input_is_named",
])
def test_verl_check(report, name):
    assert report.get(name) == "ok", report.get(name, f"check {name} did not run")
