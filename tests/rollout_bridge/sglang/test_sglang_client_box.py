"""`SGLangEngine` over HTTP against sglang's real HTTP app, TokenizerManager, API-key middleware,
weight-update session and WeightUpdater (the box, tests/support/sglang_box.py), both versions.

What the box cannot answer (no CUDA): real sampling (its CPU scheduler answers from a tiny
LocalEngine) and /update_weights_from_disk (no model loader); everything else below is sglang's
own code path.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from fake_proc import FakeServerProcess
from tiny_lm import TinyLM

from megatron_pdm.netutil import free_port
from rollout_bridge import EngineMismatchError, SGLangEngine
from rollout_bridge.sglang.broadcast import DistributedWeightSender
from rollout_bridge.core.weights import state_digest

pytestmark = pytest.mark.sglang_api
VOCAB = 50
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _client(box, **kw) -> SGLangEngine:
    return SGLangEngine(box.url, top_logprobs=4, vocab_size=VOCAB, api_key=box.key,
                        timeout_s=120, **kw)


def test_check_server_and_version(box):
    info = _client(box).check_server()
    assert info["weight_version"] == "0" or info["weight_version"]
    assert info["num_servers"] == 1


@pytest.mark.parametrize("transport", ["json", "flat_b64", "scoring_b64"])
def test_generate_every_transport(box, transport):
    client = _client(box, topk_transport=transport)
    batch = client.generate(PROMPTS, {"temperature": 1.0, "max_new_tokens": 4,
                                      "stop_token_ids": [3]}, n=2)
    assert not batch.failures
    assert len(batch.samples) == 4
    for s in batch.samples:
        assert s.num_tokens > 0 and s.support_ids.shape[1] == 5


def test_without_the_key_refused_with_it_accepted(box):
    with pytest.raises(EngineMismatchError, match="401"):
        SGLangEngine(box.url, top_logprobs=4, timeout_s=30).check_server()
    for path, body in (("/model_info", None), ("/pause_generation", {"mode": "abort"}),
                       ("/update_weights_from_distributed", {"names": [], "dtypes": [],
                                                              "shapes": []})):
        req = urllib.request.Request(box.url + path, method="GET" if body is None else "POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401, path
    assert _client(box).weight_versions()  # the same routes with our header pass


def test_push_into_sglangs_weight_updater_and_the_mirror_bit_exactly(box, tmp_path):
    """One sync into sglang's own receiving code (the box) and into the fake's plain-torch
    mirror of it, in one group: both reconstruct exactly what was sent."""
    mirror = FakeServerProcess(str(tmp_path / "mirror"),
                               ["--tiny-lm", "--api-key-env", "PDM_TEST_MIRROR_KEY",
                                "--receiver", "mirror"], env={"PDM_TEST_MIRROR_KEY": box.key})
    try:
        client = SGLangEngine([box.url, mirror.url], top_logprobs=4, vocab_size=VOCAB,
                              api_key=box.key, timeout_s=300)
        sender = DistributedWeightSender(client, master_address="127.0.0.1",
                                         master_port=free_port(), backend="gloo",
                                         bucket_bytes=8192, timeout_s=300)
        for version, seed, fmt in (("7", 11, "flattened_bucket"), ("8", 12, None)):
            sender.load_format = fmt
            named = list(TinyLM(seed=seed).state_dict().items())
            stats = sender.push(iter(named), version)
            assert stats["buckets"] >= 2
            assert client.weight_versions() == [version, version]
            want = state_digest(named)
            served_box = [e["body"] for e in box.log() if e.get("call") == "served"]
            assert served_box[-1] == {"version": version, "digest": want, "receiver": "sglang"}
            served_mirror = [c["body"] for c in mirror.calls() if c["call"] == "served"]
            assert (served_mirror[-1]["version"], served_mirror[-1]["digest"]) == (version, want)
        batch = client.generate(PROMPTS, {"temperature": 1.0, "max_new_tokens": 3}, n=2)
        assert not batch.failures and batch.weight_version == "8"
        assert {s.meta_info["server"] for s in batch.samples} == {box.url, mirror.url}
        sender.close()  # SGLang's destroy_weights_update_group on both
    finally:
        mirror.stop()
