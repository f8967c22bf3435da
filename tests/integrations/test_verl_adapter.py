"""megatron_pdm.integrations.verl against the installed verl 0.9.1 (CPU, function level).

Subprocesses in the verl env (conftest.py) run the checks of verl_checks.py and write a report;
each test below asserts its entry (one subprocess for the function-level checks, one per TP size
for the logits processor). What each check compares is in its docstring there: the losses found
through verl's own registry equal the project's `policy_loss` (value and logits gradient, fp64,
every registered preset with token-mean, pdm-agg with seq-mean-token-sum), verl's own `ppo_loss`
path through `pdm_ppo_loss` on a nested no-padding batch, the logits-processor role at TP 1 and
TP 2 (gloo, megatron's parallel state, verl's own packing) against the op on the full logits,
registration only on import, and bad input named.
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


FUNCTION_CHECKS = [
    "registry_after_import_only",
    "loss_equals_project_token_mean",
    "loss_equals_project_seq_mean_token_sum",
    "masking_is_live",
    "ppo_loss_path_equals_project",
    "bad_input_is_named",
]


def _run(out: Path, names: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([verl_pythonpath(), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "verl_checks.py"),
                           str(out), *names], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("verl") / "report.json", FUNCTION_CHECKS)


@pytest.mark.parametrize("name", FUNCTION_CHECKS)
def test_verl_check(report, name):
    assert report.get(name) == "ok", report.get(name, f"check {name} did not run")


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", ["processor_role_tp1", "processor_role_tp2"])
def test_logits_processor_role(tmp_path, name):
    """pdm_ppo_loss as verl's logits processor, keys packed by verl's preprocess_thd_engine
    under megatron's parallel state (gloo), equals the op on the full logits."""
    report = _run(tmp_path / "report.json", [name])
    assert report.get(name) == "ok", report.get(name, f"check {name} did not run")
