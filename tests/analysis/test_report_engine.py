"""The study's report says who generated the behaviour policy: the in-process engine's copy at
its precision, or a server with its version and serving dtype (megatron_pdm/analysis/report.py,
study.py's setup)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_pdm.analysis.report import _engine_words
from megatron_pdm.analysis.study_setup import server_summary as _server_summary


def test_local_engine_is_the_engine_copy():
    assert _engine_words({"rollout_precision": "bf16", "engine_server": None}) == \
        "engine copy bf16"
    assert _server_summary(SimpleNamespace()) is None  # the local engine has no server_info


def test_server_engine_names_version_dtype_and_push_precision():
    rollout = SimpleNamespace(server_info={
        "engine": "vllm", "model": "m", "weight_version": "7", "vllm_version": "0.32.0",
        "dtype": "torch.bfloat16", "other": object()})
    server = _server_summary(rollout)
    assert server == {"engine": "vllm", "model": "m", "vllm_version": "0.32.0",
                      "dtype": "torch.bfloat16"}  # strings only: results.json stays plain
    words = _engine_words({"rollout_precision": "fp32", "engine": "vllm",
                           "engine_server": server})
    assert words == ("engine vllm server 0.32.0 serving in torch.bfloat16, weights pushed in "
                     "fp32")


def test_server_without_facts_says_what_is_unknown():
    server = _server_summary(SimpleNamespace(server_info={"model": "m"}))
    assert server["dtype"] is None
    assert _engine_words({"rollout_precision": "bf16", "engine": "sglang",
                          "engine_server": server}) == \
        "engine sglang server serving in ?, weights pushed in bf16"
