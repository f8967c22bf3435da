"""Our client against the installed sglang's own code (both supported versions, marker sglang_api).

The facts come from the box's report (tests/support/sglang_box.py, run inside the sglang env):
the route table of sglang's real FastAPI app, every request body our client builds validated by
sglang's own request classes and checks, the sampling-parameter table judged by sglang, and the
/generate validation table answered by sglang's real HTTP handler. The fake server's rules
(tests/support/sglang_rules.py) must answer that table exactly like the real handler.
"""

from __future__ import annotations

import pytest
import sglang_rules as rules
from sglang_cases import PROMPT, SAMPLING_CASES, VALIDATION_CASES, client_bodies, control_bodies

from rollout_bridge.sglang.client import SAMPLING_KEYS, check_sglang_sampling_params
from rollout_bridge.sglang.http import ROUTES, SUPPORTED_SGLANG
from rollout_bridge.core.types import SamplingParamsError

pytestmark = pytest.mark.sglang_api

WEIGHT_ROUTES = ("pause_generation", "continue_generation", "begin_weight_update",
                 "end_weight_update", "update_weights_from_disk", "init_weights_update_group",
                 "update_weights_from_distributed", "destroy_weights_update_group",
                 "update_weights_from_tensor")


def _table(report) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in report["routes"]:
        for m in r["methods"]:
            out[f"{m} {r['path']}"] = r
    return out


def test_installed_version_is_the_supported_one(report, version):
    assert report["version"] == version
    assert version in SUPPORTED_SGLANG


def test_every_route_the_client_calls_exists(report):
    table = _table(report)
    missing = [f"{m} {p}" for m, p in ROUTES.values() if f"{m} {p}" not in table]
    assert not missing, missing
    # the fake serves exactly ROUTES plus SGLang's deprecated alias, which must exist too
    assert "GET /get_model_info" in table
    # gone since 0.5.21: the old client's version check
    assert not any(r["path"] == "/get_weight_version" for r in report["routes"])
    assert report["get_weight_version"]["status"] == 404


def test_weight_and_pause_routes_are_admin_routes(report):
    table = _table(report)
    for name in WEIGHT_ROUTES:
        method, path = ROUTES[name]
        assert table[f"{method} {path}"]["auth"] is not None, name


def test_every_generate_body_validates(report):
    ours = client_bodies()
    got = report["client_bodies"]
    assert sorted(got) == sorted(ours)
    for name, entry in got.items():
        assert entry["body"] == ours[name], name  # the report judged today's builders
        assert entry["verdict"] == {"ok": True}, (name, entry["verdict"])


def test_scoring_request_starts_one_before_the_response(report):
    body = report["client_bodies"]["scoring_T1.0"]["body"]
    assert body["logprob_start_len"] == len(PROMPT) - 1  # SGLang's null row, then the response


def test_every_control_body_validates(report):
    got = report["control_bodies"]
    ours = control_bodies()
    assert sorted(got) == sorted(ours)
    for name, entry in got.items():
        assert entry["ok"], (name, entry)
        cls, body = ours[name]
        assert entry["class"] == cls
        # every field we send is a field of the class, parsed to the value we meant
        assert sorted(entry["fields"]) == sorted(body), (name, entry["fields"])


def test_sampling_keys_are_sglang_fields(report):
    fields = set(report["sampling_params_fields"])
    contract = set(report["contract_sampling_fields"])
    assert SAMPLING_KEYS <= fields, sorted(SAMPLING_KEYS - fields)
    assert SAMPLING_KEYS <= contract, sorted(SAMPLING_KEYS - contract)
    # the fake refuses exactly what SGLang's JSON contract refuses
    assert rules.SAMPLING_FIELDS - {"choice"} == contract - {"choice"}


@pytest.mark.parametrize("name,params", SAMPLING_CASES, ids=[c[0] for c in SAMPLING_CASES])
def test_client_guard_never_lets_through_what_sglang_refuses(report, name, params):
    verdict = report["sampling_cases"][name]
    try:
        check_sglang_sampling_params(dict(params, max_new_tokens=2))
        accepted = True
    except SamplingParamsError:
        accepted = False
    if accepted:
        assert verdict == {"ok": True}, (name, verdict)
    # and the fake server judges the same request like SGLang
    body = {"input_ids": [1, 2, 3], "sampling_params": dict({"max_new_tokens": 2}, **params)}
    try:
        rules.check_generate(body, vocab_size=50)
        fake_ok = True
    except rules.Rejected:
        fake_ok = False
    assert fake_ok == verdict["ok"], (name, verdict)


@pytest.mark.parametrize("name,body", VALIDATION_CASES, ids=[c[0] for c in VALIDATION_CASES])
def test_fake_rules_answer_like_the_real_handler(report, name, body):
    real = report["validation_table"][name]
    try:
        rules.check_generate(body, vocab_size=50)
        fake_status, fake_shape = 200, "ok"
    except rules.Rejected as rej:
        fake_status, fake_shape = rej.status, rules.error_shape(rej.status, rej.body)
    real_shape = rules.error_shape(real["status"], real["body"])
    if real["status"] == 200 and real_shape == "other":
        real_shape = "ok"
    assert (fake_status, fake_shape) == (real["status"], real_shape), (name, real)


def test_distributed_update_outside_a_session_is_refused(report):
    got = report["distributed_outside_session"]
    assert got["status"] == 400 and got["body"]["success"] is False
    assert "begin_weight_update" in got["body"]["message"]
    ok, message = rules.Session().require("update_weights_from_distributed")
    assert ok is False and "begin_weight_update" in message


def test_model_info_carries_the_weight_version(report):
    info = report["model_info"]
    assert info["weight_version"] == "0"
    assert "vocab_size" not in info  # the client checks the vocabulary from config.json
    fake_keys = {"model_path", "served_model_name", "tokenizer_path", "is_generation",
                 "preferred_sampling_params", "weight_version", "load_format",
                 "reasoning_parser", "tool_call_parser", "disaggregation_mode",
                 "has_image_understanding", "has_audio_understanding", "model_type",
                 "architectures"}
    assert fake_keys <= set(info), sorted(fake_keys - set(info))


def test_server_info_layout_and_key_exposure(report):
    layout = report["server_info_layout"]
    assert {k: int(v) for k, v in layout.items()} == {"tp_size": 1, "dp_size": 1, "pp_size": 1}
    # /server_info returns the server's own API key: the client keeps only the three sizes
    assert report["server_info_has_api_key"] is True
    assert report["server_args_leak"]["resolved_dict_has_api_key"] is True


def test_wrong_key_is_refused_everywhere_but_health(report):
    for route, answer in report["wrong_key"].items():
        if route == "GET /health":
            assert answer["status"] != 401, answer
        else:
            assert answer["status"] == 401, (route, answer)
            assert rules.error_shape(401, None) == "unauthorized"
            assert '"Unauthorized"' in answer["body"]
