"""The sglang box's report (tests/support/sglang_box.py --report): facts about the installed
sglang - its routes, the fields of its sampling params, what its /generate handler's own checks
say of our client's request bodies, the control requests' parse, authentication with a wrong
key and the weight-update session - which tests/rollout_bridge/sglang/test_sglang_api.py judges
against our client. Runs inside the sglang API env (every sglang import is local to its function).
"""

from __future__ import annotations

import json


def _routes(app) -> list[dict]:
    out = []

    def walk(routes, prefix=""):
        for r in routes:
            if hasattr(r, "original_router"):  # fastapi >= 0.140 _IncludedRouter
                walk(r.original_router.routes, prefix + (r.include_context.prefix or ""))
                continue
            path = getattr(r, "path", None)
            if path is None:
                continue
            level = getattr(getattr(r, "endpoint", None), "_auth_level", None)
            out.append({"path": prefix + path, "methods": sorted(getattr(r, "methods", None)
                                                                 or ["WS"]),
                        "auth": getattr(level, "value", None if level is None else str(level))})

    walk(app.routes)
    return out


def validate_generate_body(body: dict, vocab_size: int) -> dict:
    """The checks the /generate handler runs before the scheduler, in order, with sglang's own
    code (http_server.py:928-990 (0.5.23)): FastAPI's parse into GenerateReqInput, the JSON
    contract gate, normalize_batch_and_arguments, SamplingParams normalize + verify."""
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
    except pydantic.ValidationError as e:
        return {"ok": False, "stage": "pydantic", "message": str(e)[:400]}
    err = generate_contract_error(body)
    if err is not None:
        return {"ok": False, "stage": "contract", "message": err[:400]}
    try:
        obj.normalize_batch_and_arguments()
        sps = obj.sampling_params if isinstance(obj.sampling_params, list) else \
            [obj.sampling_params]
        for sp in sps:
            p = SamplingParams(**(sp or {}))
            p.normalize(None)
            p.verify(vocab_size)
    except (ValueError, TypeError) as e:
        return {"ok": False, "stage": "value", "message": str(e)[:400]}
    return {"ok": True}


async def make_report(hs, tm, sched, api_key, *, vocab_size: int) -> dict:
    """The report: facts about the installed sglang (routes, sampling fields, verdicts on our
    client's bodies, auth and session behaviour), judged by the tests against our client."""
    import sglang_cases as cases
    import httpx
    import msgspec
    import pydantic
    import sglang
    from sglang.api.v1 import api_types
    from sglang.srt.managers import io_struct as io
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    rep: dict = {"version": sglang.__version__, "sglang_file": sglang.__file__}
    rep["routes"] = _routes(hs.app)
    rep["sampling_params_fields"] = [f.name for f in msgspec.structs.fields(SamplingParams)]
    rep["contract_sampling_fields"] = [
        f.name for f in msgspec.structs.fields(api_types.SamplingParams)]
    rep["client_bodies"] = {n: {"body": b, "verdict": validate_generate_body(b, vocab_size)}
                            for n, b in cases.client_bodies().items()}
    rep["sampling_cases"] = {
        n: validate_generate_body({"input_ids": [1, 2, 3],
                                   "sampling_params": dict({"max_new_tokens": 2}, **sp)},
                                  vocab_size)
        for n, sp in cases.SAMPLING_CASES}
    controls = {}
    for name, (cls_name, body) in cases.control_bodies().items():
        cls = getattr(io, cls_name)
        try:
            obj = pydantic.TypeAdapter(cls).validate_python(body)
            fields = {f.name: getattr(obj, f.name) for f in msgspec.structs.fields(cls)
                      if f.name in body}
            controls[name] = {"ok": True, "class": cls_name,
                              "fields": json.loads(json.dumps(fields, default=str))}
        except Exception as e:  # noqa: BLE001
            controls[name] = {"ok": False, "class": cls_name, "message": str(e)[:400]}
    rep["control_bodies"] = controls
    sa = ServerArgs(model_path=tm.model_path, skip_tokenizer_init=True, device="cpu",
                    api_key="SECRET-KEY-PROBE")
    rep["server_args_leak"] = {"resolved_dict_has_api_key":
                               sa.resolved_dict().get("api_key") == "SECRET-KEY-PROBE",
                               "repr_has_api_key": "SECRET-KEY-PROBE" in repr(sa)}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # A refused /generate leaves a background abort task that fails on the un-normalised
    # request (tokenizer_manager.abort_request: no `is_single`); uvicorn logs it after the
    # 400 was sent, so only the response matters here as on a real server.
    transport = httpx.ASGITransport(app=hs.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://box", timeout=120,
                                 headers=headers) as c:
        table = {}
        for name, body in cases.VALIDATION_CASES:
            r = await c.post("/generate", json=body)
            try:
                payload = r.json()
            except ValueError:
                payload = r.text[:400]
            table[name] = {"status": r.status_code, "body": payload}
        rep["validation_table"] = table
        scen = {}
        for name, body in cases.scenario_bodies().items():
            r = await c.post("/generate", json=body)
            rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
            scen[name] = {"request": body, "status": r.status_code, "raw": r.text,
                          "scheduler": {rid: sched.captured.get(rid) for rid in rids}}
        rep["scenarios"] = scen
        info = await c.get("/model_info")
        rep["model_info"] = info.json()
        sinfo = (await c.get("/server_info")).json()
        rep["server_info_keys"] = sorted(sinfo)
        rep["server_info_layout"] = {k: sinfo.get(k) for k in ("tp_size", "dp_size", "pp_size")}
        rep["server_info_has_api_key"] = bool(api_key) and sinfo.get("api_key") == api_key
        auth = {}
        for method, path, body in (("GET", "/model_info", None), ("GET", "/health", None),
                                   ("POST", "/generate", {"input_ids": [1]}),
                                   ("POST", "/pause_generation", {"mode": "abort"}),
                                   ("POST", "/update_weights_from_distributed",
                                    {"names": [], "dtypes": [], "shapes": []}),
                                   ("GET", "/get_weight_version", None)):
            r = await c.request(method, path, json=body,
                                headers={"Authorization": "Bearer wrong-key"})
            auth[f"{method} {path}"] = {"status": r.status_code, "body": r.text[:200]}
        rep["wrong_key"] = auth
        missing = await c.get("/get_weight_version")
        rep["get_weight_version"] = {"status": missing.status_code, "body": missing.text[:200]}
        out_of_session = await c.post("/update_weights_from_distributed", json={
            "names": ["emb.weight"], "dtypes": ["float32"], "shapes": [[64, 16]],
            "group_name": "nope"})
        rep["distributed_outside_session"] = {"status": out_of_session.status_code,
                                              "body": out_of_session.json()}
    return rep
