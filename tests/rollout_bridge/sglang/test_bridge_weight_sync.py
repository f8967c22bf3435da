"""Weight sync without disk: `DistributedWeightSender` -> two fake SGLang servers over gloo.

Each server is its own process (a weight-update group has one process per rank) and receives
with `sglang_receiver` (sglang's own WeightUpdater when the sglang API env is on its path, here
the plain-torch restatement; the sglang_api tests runs the same pushes into the real WeightUpdater).
One push reaches both servers inside one pause -> begin -> buckets -> end -> continue session,
through several single-dtype buckets, in both load formats; every server then reports the
version, and what each received equals what was sent, bit for bit (digests of the tensors as
received, dtype and shape included). The API key is required by the servers.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from tiny_lm import VOCAB, TinyLM, prompts
from fake_proc import FakeServerProcess

from megatron_pdm.netutil import free_port
from rollout_bridge import SGLangEngine, WeightSyncError
from rollout_bridge.sglang.broadcast import DistributedWeightSender, buckets
from rollout_bridge.core.weights import state_digest

pytestmark = pytest.mark.slow
KEY_ENV = "PDM_TEST_SGLANG_KEY"


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    key = secrets.token_hex(16)
    os.environ[KEY_ENV] = key
    root = tmp_path_factory.mktemp("ws")
    servers = [FakeServerProcess(str(root / f"s{i}"),
                                 ["--tiny-lm", "--seed", str(i), "--api-key-env", KEY_ENV,
                                  "--receiver", "mirror"], env={KEY_ENV: key})
               for i in range(2)]
    yield servers, key
    for s in servers:
        s.stop()


def _served(server) -> list[dict]:
    return [c["body"] for c in server.calls() if c["call"] == "served"]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    named = list(TinyLM(seed=seed).state_dict().items())
    # one tensor in bf16: its own bucket (one dtype per bucket keeps offsets aligned)
    return [(n, t.to(torch.bfloat16) if n == "mix.bias" else t) for n, t in named]


def test_buckets_one_dtype_and_bounded():
    named = _weights(0)
    out = list(buckets(named, bucket_bytes=4096))
    assert [n for b in out for n in b.names] == [n for n, _ in named]
    for b in out:
        assert len({t.dtype for t in b.tensors}) == 1
        assert b.nbytes <= 4096 or len(b.tensors) == 1
        assert b.flat().numel() == b.nbytes


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_one_push_reaches_both_servers_bit_exactly(two_servers, load_format):
    servers, key = two_servers
    client = SGLangEngine([s.url for s in servers], top_logprobs=5, vocab_size=VOCAB,
                          api_key=key, timeout_s=30)
    client.check_server()
    sender = DistributedWeightSender(client, master_address="127.0.0.1", master_port=free_port(),
                                     backend="gloo", bucket_bytes=4096, load_format=load_format,
                                     timeout_s=120)
    try:
        for version, seed in (("v1", 7), ("v2", 8)):
            named = _weights(seed)
            stats = sender.push(iter(named), version)
            assert stats["buckets"] >= 3 and stats["tensors"] == len(named)
            assert client.weight_versions() == [version, version]
            want = state_digest(named)
            for s in servers:
                last = _served(s)[-1]
                assert (last["version"], last["digest"]) == (version, want)
            batch = client.generate(prompts(4), {"max_new_tokens": 4}, n=1)
            assert batch.weight_version == version and not batch.failures
        assert sender.world_size == 3  # trainer + one TP rank per server
    finally:
        sender.close()


def test_failed_bucket_resumes_generation_and_next_push_works(two_servers):
    servers, key = two_servers
    client = SGLangEngine([s.url for s in servers], top_logprobs=5, vocab_size=VOCAB,
                          api_key=key, timeout_s=30)
    sender = DistributedWeightSender(client, master_address="127.0.0.1", master_port=free_port(),
                                     backend="gloo", bucket_bytes=1 << 20, timeout_s=120)
    try:
        bad = _weights(3) + [("no.such.weight", torch.zeros(3))]
        before = client.weight_versions()
        with pytest.raises(WeightSyncError, match="no.such.weight"):
            sender.push(iter(bad), "bad")
        assert client.weight_versions() == before
        assert not client.generate(prompts(2), {"max_new_tokens": 3}).failures  # resumed
        good = _weights(4)
        sender.push(iter(good), "v3")
        assert client.weight_versions() == ["v3", "v3"]
        assert all(_served(s)[-1]["digest"] == state_digest(good) for s in servers)
    finally:
        sender.close()


def test_without_the_api_key_nothing_is_accepted(two_servers):
    servers, _ = two_servers
    client = SGLangEngine([s.url for s in servers], top_logprobs=5, timeout_s=30)
    sender = DistributedWeightSender(client, master_address="127.0.0.1", master_port=free_port(),
                                     backend="gloo", server_tp_sizes=[1, 1], timeout_s=20)
    with pytest.raises(WeightSyncError, match="401"):
        sender.push(iter(_weights(5)), "evil")


def test_two_senders_in_one_process_get_their_own_groups(two_servers):
    """torch refuses a second process group of one name: a new sender (e.g. a restarted driver
    component) must not reuse the name of one that was never closed."""
    servers, key = two_servers
    client = SGLangEngine([s.url for s in servers], top_logprobs=5, api_key=key, timeout_s=30)
    first, second = (DistributedWeightSender(client, master_address="127.0.0.1",
                                             master_port=free_port(), backend="gloo", timeout_s=120)
                     for _ in range(2))
    first.push(iter(_weights(9)), "w1")
    second.push(iter(_weights(10)), "w2")  # `first` still holds its group
    assert first.group_name != second.group_name
    assert client.weight_versions() == ["w2", "w2"]
    second.close()
    first.close()
