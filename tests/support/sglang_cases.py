"""Request tables shared by the sglang_box report (run inside the sglang env) and the tests.

Everything here is data plus our own client's body builders, so the same requests are judged by
the installed sglang (tests/support/sglang_box.py --report) and by our side (the fake server's
rules, the client's sampling guard).
"""

from __future__ import annotations

PROMPT = [5, 6, 7, 8]
BASE = {"temperature": 1.0, "max_new_tokens": 4}


def client_bodies() -> dict[str, dict]:
    """Every /generate body shape our client sends (json, flat_b64, scoring; T 1 and 0)."""
    from rollout_bridge.sglang.client import SGLangEngine

    out = {}
    for transport in ("json", "flat_b64", "scoring_b64"):
        eng = SGLangEngine("http://unused", 4, topk_transport=transport)
        for t in (1.0, 0.0):
            sp = dict(BASE, temperature=t, stop_token_ids=[3], sampling_seed=11)
            k = 0 if transport == "scoring_b64" else None
            out[f"{transport}_T{t}"] = eng.build_generate_payload(
                PROMPT, 2, sp, [f"{transport}-{t}-a", f"{transport}-{t}-b"], top_logprobs=k)
        if transport == "scoring_b64":
            out["scoring_T1.0"] = eng.build_scoring_payload(PROMPT, [[9, 10, 11], [12]], 1.0,
                                                            ["score-a", "score-b"])
    return out


def control_bodies() -> dict[str, tuple[str, dict]]:
    """(io_struct class name, body) for every control request our client builds."""
    from rollout_bridge.sglang.client import SGLangEngine

    eng = SGLangEngine("http://unused", 4)
    dist = eng.distributed_update_body(["a.weight", "b.weight"], ["bfloat16", "bfloat16"],
                                       [[2, 3], [4]], "pdm_weight_sync_1",
                                       load_format="flattened_bucket", weight_version="7",
                                       flush_cache=True)
    dist_none = eng.distributed_update_body(["a.weight"], ["float32"], [[2, 3]], "g",
                                            load_format=None, weight_version=None,
                                            flush_cache=False)
    return {
        "pause": ("PauseGenerationReqInput", {"mode": eng.pause_mode}),
        "continue": ("ContinueGenerationReqInput", {}),
        "begin": ("BeginWeightUpdateReqInput", {"selector": "all"}),
        "end": ("EndWeightUpdateReqInput", {}),
        "disk": ("UpdateWeightFromDiskReqInput", {"model_path": "/m", "weight_version": "3",
                                                  "flush_cache": True,
                                                  "abort_all_requests": False}),
        "init_group": ("InitWeightsUpdateGroupReqInput", {
            "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 3, "group_name": "pdm_weight_sync_1", "backend": "gloo"}),
        "distributed": ("UpdateWeightsFromDistributedReqInput", dist),
        "distributed_per_tensor": ("UpdateWeightsFromDistributedReqInput", dist_none),
        "destroy": ("DestroyWeightsUpdateGroupReqInput", {"group_name": "pdm_weight_sync_1"}),
        "tensor": ("UpdateWeightsFromTensorReqInput", {
            "serialized_named_tensors": ["aGVsbG8="], "load_format": None, "flush_cache": True,
            "abort_all_requests": False, "weight_version": "4"}),
        "release": ("ReleaseMemoryOccupationReqInput", {"tags": None}),
        "resume": ("ResumeMemoryOccupationReqInput", {"tags": ["weights"]}),
    }


# (name, sampling params) judged by SGLang (accepted or 400) and by our client's guard
SAMPLING_CASES = [
    ("plain", {}), ("greedy", {"temperature": 0.0}), ("T0.7", {"temperature": 0.7}),
    ("top_k=-1", {"top_k": -1}), ("top_k=0", {"top_k": 0}), ("top_k=5", {"top_k": 5}),
    ("top_p=1", {"top_p": 1.0}), ("top_p=0.9", {"top_p": 0.9}), ("top_p=0", {"top_p": 0.0}),
    ("min_p=0.1", {"min_p": 0.1}), ("freq=0.5", {"frequency_penalty": 0.5}),
    ("pres=0.5", {"presence_penalty": 0.5}), ("rep=1.1", {"repetition_penalty": 1.1}),
    ("min_new=2", {"min_new_tokens": 2}), ("logit_bias", {"logit_bias": {"7": 1.0}}),
    ("logit_bias_oov", {"logit_bias": {"999": 1.0}}), ("regex", {"regex": "[0-9]"}),
    ("regex+ebnf", {"regex": "a", "ebnf": "root ::= \"a\""}), ("stop_str", {"stop": "x"}),
    ("stop_ids", {"stop_token_ids": [3]}), ("seed", {"sampling_seed": 3}),
    ("neutral_penalties", {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                           "repetition_penalty": 1.0, "min_new_tokens": 0}),
    ("bogus", {"bogus": 1}), ("T<0", {"temperature": -1.0}),
]

# (name, body) for the validation table the fake server must answer like the real handler
VALIDATION_CASES = [
    ("ok_list", {"input_ids": [[1, 2], [3, 4]], "rid": ["v1", "v2"],
                 "sampling_params": {"max_new_tokens": 2}}),
    ("ok_single", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
    ("unknown_sampling_key", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}}),
    ("unknown_top_key", {"input_ids": [1, 2], "bogus_top": 1,
                         "sampling_params": {"max_new_tokens": 1}}),
    ("top_k0", {"input_ids": [1, 2], "sampling_params": {"top_k": 0}}),
    ("top_p0", {"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}),
    ("temperature_neg", {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}}),
    ("min_new_tokens", {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 2}}),
    ("stop_string", {"input_ids": [1, 2], "sampling_params": {"stop": "x"}}),
    ("logit_bias_oov", {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"999": 1.0}}}),
    ("two_grammars", {"input_ids": [1, 2], "sampling_params": {"regex": "a",
                                                               "json_schema": "{}"}}),
    ("b64_without_flat", {"input_ids": [1, 2], "return_logprob": True,
                          "return_flat_raw_top_logprobs_b64": True}),
    ("flat_output_stream", {"input_ids": [1, 2], "return_logprob": True, "stream": True,
                            "return_flat_raw_output_top_logprobs": True}),
    ("dup_rids", {"input_ids": [[1], [2]], "rid": ["a", "a"]}),
    ("rid_count", {"input_ids": [[1], [2]], "rid": ["a"]}),
    ("input_ids_str", {"input_ids": "abc"}),
]

# /generate requests whose real responses are captured (fixtures of the formatting check)
def scenario_bodies() -> dict[str, dict]:
    bodies = client_bodies()
    out = {name: bodies[name] for name in ("json_T1.0", "flat_b64_T1.0", "scoring_b64_T1.0",
                                            "scoring_T1.0", "json_T0.0")}
    flat_json = dict(bodies["flat_b64_T1.0"], rid=["flatjson-a", "flatjson-b"])
    flat_json.pop("return_flat_raw_top_logprobs_b64")
    out["flat_json_T1.0"] = flat_json
    ragged = dict(bodies["flat_b64_T1.0"], rid=["ragged-a", "ragged-b"])
    out["flat_b64_ragged"] = ragged
    out["prompt_side_nested"] = {"input_ids": [PROMPT + [9, 10]], "rid": ["nested-a"],
                                 "sampling_params": {"max_new_tokens": 0},
                                 "return_logprob": True, "logprob_start_len": 1,
                                 "top_logprobs_num": 3, "return_text_in_logprobs": False,
                                 "stream": False}
    return out
