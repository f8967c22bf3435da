"""The driver with `rollout.sglang.weight_sync.mode=distributed` (no disk) against two fake SGLang
servers.

Setup: an HF directory of the tiny run's architecture (random weights; the trainer pushes its own
before the first rollout), served by two fake SGLang processes (tests/support/fake_sglang_cli.py, HF
mode) that require an API key. Their receivers follow SGLang's receiving protocol
(tests/support/sglang_receiver.py): server 0 runs sglang's own model-runner `WeightUpdater` when the
sglang API env is installed (scripts/sglang_api_env.sh), else the plain-torch mirror; server 1
always runs the mirror. Both load what they received into their model and log the sha256 digest of
the tensors as received.

The trainer (TP=2, 2 processes, gloo) pushes before the first rollout and after every iteration:
one weight-update group (trainer rank 0 + one rank per server), buckets broadcast to both servers
at once, the version on the last bucket. Checks:
  * every push reached both servers: each logs the pushed version with the trainer's digest (the
    served weights equal the trainer's, bit for bit, dtype and shape included);
  * versions increase push after push, and every rollout batch was sampled with the latest one;
  * rollouts were spread over both servers; nothing went to disk;
  * the API key: the driver sent it (the servers refuse requests without it: checked after the
    run, with the same servers), and it appears in no file or log line of the run.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from tests.support._launch import CONFIG, ROOT, SHORT, command

sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from fake_proc import FakeServerProcess, sglang_pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

KEY_ENV = "PDM_SGLANG_API_KEY"  # rollout.sglang.api_key_env's default
SGLANG_VERSION = "0.5.23"
OVERRIDES = ["warmup.steps=0", "train.iterations=3", "train.eval_prompts=4",
             "checkpoint.save_interval=0", "rollout.max_sequence_length=16",
             "rollout.rollout_precision=null", "rollout.temperature=1.0",
             "rollout.engine=sglang", "rollout.sglang.weight_sync.mode=distributed",
             "rollout.sglang.weight_sync.backend=gloo", "rollout.sglang.weight_sync.bucket_mb=1",
             "rollout.sglang.weight_sync.digest=true", "rollout.timeout_s=600"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_pdm.train.config import RunConfig
    from megatron_pdm.train.rollout.vllm_server.model_dir import prepare_model_dir, run_arch

    root = tmp_path_factory.mktemp("sglang_dist")
    arch = run_arch(RunConfig.load(CONFIG, SHORT))  # the model only
    hf = prepare_model_dir(arch, root / "hf", seed=3)
    key = secrets.token_hex(16)
    sglang_env = SGLANG_VERSION if sglang_pythonpath(SGLANG_VERSION) else None
    receivers = ["sglang" if sglang_env else "mirror", "mirror"]
    servers = []
    try:
        for i, receiver in enumerate(receivers):
            servers.append(FakeServerProcess(
                str(root / f"s{i}"), ["--hf-dir", str(hf), "--seed", str(7 + i),
                                      "--api-key-env", "PDM_TEST_SERVER_KEY",
                                      "--receiver", receiver],
                env={"PDM_TEST_SERVER_KEY": key},
                sglang_version=sglang_env if receiver == "sglang" else None,
                start_timeout_s=900))
        out = str(root / "run")
        urls = json.dumps([s.url for s in servers])
        cmd, env = command(out, SHORT + OVERRIDES + [f"rollout.sglang.urls={urls}"])
        env[KEY_ENV] = key
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                              timeout=900)
        if proc.returncode != 0:
            raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-6000:]}")
        yield {"servers": servers, "out": out, "key": key, "proc": proc, "root": root,
               "receivers": receivers}
    finally:
        for s in servers:
            s.stop()


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.gloo
def test_every_push_reaches_both_servers_bit_exactly(run):
    pushes = _jsonl(os.path.join(run["out"], "weight_sync.jsonl"))
    assert len(pushes) >= 4  # before the first rollout + after each of 3 iterations
    assert all(p["mode"] == "distributed" and p["digest"] for p in pushes)
    versions = [int(p["version"]) for p in pushes]
    assert versions == sorted(set(versions)), versions  # strictly increasing
    for server, receiver in zip(run["servers"], run["receivers"]):
        calls = server.calls()
        served = {c["body"]["version"]: c["body"] for c in calls if c["call"] == "served"}
        for p in pushes:
            got = served.get(p["version"])
            assert got is not None, (server.url, p["version"], sorted(served))
            assert got["digest"] == p["digest"], (server.url, p["version"])
            assert got["receiver"] == receiver
        names = [c["call"] for c in calls]
        assert "update_weights_from_disk" not in names
        assert names.count("init_weights_update_group") == 1  # one group for the whole run
        assert names.count("begin_weight_update") == len(pushes)
        assert names.count("end_weight_update") == len(pushes)


@pytest.mark.gloo
def test_rollouts_use_the_latest_version_and_both_servers(run):
    rows = _jsonl(os.path.join(run["out"], "metrics.jsonl"))
    pushes = _jsonl(os.path.join(run["out"], "weight_sync.jsonl"))
    seen = [int(r["rollout/weight_version"]) for r in rows]
    assert seen == sorted(seen) and len(set(seen)) == 3, seen  # one new version per iteration
    assert set(seen) <= {int(p["version"]) for p in pushes}
    counts = [s.num_generate() for s in run["servers"]]
    assert all(c > 0 for c in counts), counts


@pytest.mark.gloo
def test_api_key_sent_never_written_and_required(run):
    from rollout_bridge import EngineMismatchError, SGLangEngine

    key = run["key"]
    for dirpath, _, files in os.walk(run["out"]):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert key.encode() not in f.read(), os.path.join(dirpath, name)
    assert key not in run["proc"].stdout and key not in run["proc"].stderr
    urls = [s.url for s in run["servers"]]
    # the servers (still up) refuse a client without the key, on every route the driver used
    with pytest.raises(EngineMismatchError, match="401"):
        SGLangEngine(urls, top_logprobs=4, timeout_s=30).check_server()
    import urllib.error
    import urllib.request

    for path, body in (("/pause_generation", {"mode": "abort"}), ("/model_info", None),
                       ("/init_weights_update_group", {})):
        req = urllib.request.Request(urls[1] + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401, path
    with_key = SGLangEngine(urls, top_logprobs=4, timeout_s=30, api_key=key)
    last = _jsonl(os.path.join(run["out"], "weight_sync.jsonl"))[-1]["version"]
    assert with_key.weight_versions() == [last, last]
