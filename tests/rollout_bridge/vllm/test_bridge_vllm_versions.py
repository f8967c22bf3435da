"""The supported vLLM range (rollout_bridge/vllm/versions.py), as the client sees it: the release
a server reports on `GET /version` is checked at start-up, and one outside the range is refused
with the server, the version found and the range in the message."""

from __future__ import annotations

import pytest
from tiny_lm import VOCAB, TinyLM, prompts
from fake_vllm import FakeVLLMServer

from rollout_bridge import EngineMismatchError, LocalEngine
from rollout_bridge.vllm.client import VLLMEngine
from rollout_bridge.vllm.versions import (
    SUPPORTED,
    UnsupportedVLLMVersion,
    check_vllm_version,
    supported_text,
)

KEY = "k3y"


@pytest.mark.parametrize("found,release", [
    ("0.32.0", (0, 32)), ("0.32.0+cpu", (0, 32)), ("0.32.4", (0, 32)), ("0.33.0", (0, 33)),
    ("0.33.1rc2", (0, 33)), ("v0.33.0", (0, 33)), ("0.33", (0, 33))])
def test_releases_inside_the_range_are_accepted(found, release):
    assert check_vllm_version(found, "here") == release


@pytest.mark.parametrize("found", ["0.31.9", "0.34.0", "0.34.0rc1", "1.0.0", "0.3.2"])
def test_releases_outside_the_range_are_refused_naming_version_and_range(found):
    with pytest.raises(UnsupportedVLLMVersion) as err:
        check_vllm_version(found, "somewhere")
    assert str(err.value).startswith(f"somewhere: vLLM {found} is not supported")
    assert "0.32.x to 0.33.x" in str(err.value)


@pytest.mark.parametrize("found", ["dev", "", None, "latest"])
def test_a_version_that_names_no_release_is_refused(found):
    with pytest.raises(UnsupportedVLLMVersion, match=rf"somewhere: vLLM version {found!r} names "
                                                     "no release"):
        check_vllm_version(found, "somewhere")


def test_the_range_text_follows_the_one_definition():
    (a, b), (c, d) = SUPPORTED
    assert supported_text() == f"{a}.{b}.x to {c}.{d}.x"


def _server(version: str | None) -> FakeVLLMServer:
    engine = LocalEngine(TinyLM(seed=1), vocab_size=VOCAB, top_logprobs=5, seed=1,
                         eos_token_id=3)
    srv = FakeVLLMServer(engine, api_key=KEY, vllm_version=version)
    srv.start()
    return srv


def _client(srv) -> VLLMEngine:
    return VLLMEngine(srv.url, top_logprobs=5, api_key=KEY, timeout_s=10.0, max_retries=0,
                      vocab_size=VOCAB, seed=3)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_the_client_accepts_a_supported_server_and_reports_its_version(version):
    srv = _server(version)
    try:
        client = _client(srv)
        assert client.check_server()["vllm_version"] == version
        assert client.control.vllm_version == version
    finally:
        srv.stop()


@pytest.mark.parametrize("version", ["0.31.0", "0.34.0"])
def test_the_client_refuses_an_unsupported_server(version):
    srv = _server(version)
    try:
        with pytest.raises(UnsupportedVLLMVersion) as err:
            _client(srv).check_server()
        msg = str(err.value)
        assert f"{srv.url} (GET /version): vLLM {version} is not supported" in msg
        assert "0.32.x to 0.33.x" in msg
        assert isinstance(err.value, EngineMismatchError)  # callers' existing handling holds
        # generate() without an explicit check runs the same start-up check first
        with pytest.raises(UnsupportedVLLMVersion, match=version):
            _client(srv).generate(prompts(1), {"temperature": 1.0, "max_new_tokens": 2})
        assert not [name for name, _ in srv.calls if name == "completions"]
    finally:
        srv.stop()


def test_a_server_without_a_version_route_is_refused():
    srv = _server(None)  # GET /version answers 404
    try:
        with pytest.raises(UnsupportedVLLMVersion) as err:
            _client(srv).check_server()
        assert f"{srv.url}: the vLLM version cannot be read" in str(err.value)
        assert "HTTP 404" in str(err.value) and "0.32.x to 0.33.x" in str(err.value)
    finally:
        srv.stop()
