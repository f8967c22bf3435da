"""slime's generate and convert hooks (megatron_pdm/integrations/slime/hooks.py) into `pdm_loss`.

No slime is installed: `_Sample` below is the part of slime's `Sample` (slime/utils/types.py)
the hooks use, its `append_response_tokens` filling the same fields for model tokens; the
transport answers each request the hook builds with an SGLang-shaped body
(tests/support/sglang_format.py, checked against the real sglang in the sglang_api tests), so a
request without `top_logprobs_num` gets no top-K back. The batch is then built as slime's
train side does (tensors per sample, `unconcat_tokens`, `total_lengths`) and the loss compared
with the project's own path on the test's arrays (`fold_support_torch` + `token_stats` +
`policy_loss` per sample), at TP 1 and at TP 2 over gloo.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
import pathlib
import re
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import megatron_pdm as pdm
from megatron_pdm.integrations.slime import hooks, pdm_loss
from rollout_bridge.core.types import RolloutValidationError
from tests.support._dist import run_gloo
from tests.support import sglang_format as fmt

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, K, TEMP = 24, 4, 0.9
PROMPTS, RESP, PAD = [4, 3, 4], [3, 2, 5], 3


@dataclasses.dataclass
class _Sample:
    """slime's Sample, the fields and method the hooks touch (slime/utils/types.py)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    group_index: int | None = None
    index: int | None = None
    tokens: list = dataclasses.field(default_factory=list)
    multimodal_inputs: dict | None = None
    response: str = ""
    response_length: int = 0
    loss_mask: list | None = None
    rollout_log_probs: list | None = None
    status: Status = Status.PENDING
    session_id: str | None = None

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable=True,
                               meta_info=None, text=None):
        assert trainable and len(tokens) == len(log_probs)
        self.response += text or ""
        self.tokens += list(tokens)
        self.response_length += len(tokens)
        self.loss_mask = (self.loss_mask or []) + [1] * len(tokens)
        self.rollout_log_probs = (self.rollout_log_probs or []) + list(log_probs)
        kind = (meta_info.get("finish_reason") or {}).get("type")
        self.status = {"length": self.Status.TRUNCATED, "abort": self.Status.ABORTED,
                       "stop": self.Status.COMPLETED}.get(kind, self.status)


def _world():
    """Logits, and per sample: prompt, engine top-K (one short row), sampled ids and logprobs."""
    g = torch.Generator().manual_seed(11)
    totals = [p + r for p, r in zip(PROMPTS, RESP)]
    logits = torch.randn(1, sum(totals) + PAD, V, generator=g, dtype=torch.float64) * 2
    world, end = [], 0
    for b, (p, r) in enumerate(zip(PROMPTS, RESP)):
        end += p + r
        rows = logits[0, end - r - 1:end - 1]
        logmu = torch.log_softmax((rows + 0.3 * torch.randn(rows.shape, generator=g,
                                                             dtype=torch.float64)) / TEMP, -1)
        logmu = logmu.float()
        sampled = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1)
        top = logmu.topk(K)
        lp = top.values.clone()
        lp[1, -1] = -torch.inf    # SGLang sent only K-1 entries at position 1
        world.append({"prompt": torch.randint(0, V, (p,), generator=g).tolist(),
                      "ids": top.indices, "lp": lp, "sampled": sampled,
                      "sampled_lp": logmu.gather(1, sampled[:, None])[:, 0],
                      "adv": torch.full((r,), float(b) - 1.0)})
    return logits, world


class _Transport:
    """slime's side of a request: the prompt ids, and the SGLang answer to the payload."""

    def __init__(self, world, cut: int | None = None):
        self.world, self.cut, self.payloads = world, cut, []

    def prompt_ids(self, sample):
        self.current = sample.index
        return sample.tokens or self.world[sample.index]["prompt"]

    async def post(self, payload, headers):
        self.payloads.append(payload)
        sample_index = self.current
        w = self.world[sample_index]
        start = len(payload["input_ids"]) - len(w["prompt"])
        stop = len(w["sampled"]) if self.cut is None or start else self.cut
        sl = slice(start, stop)
        top_v = [[v for v in row if v != -math.inf] for row in w["lp"][sl].tolist()]
        top_i = [row[:len(v)] for row, v in zip(w["ids"][sl].tolist(), top_v)]
        finish = fmt.finish_abort() if stop < len(w["sampled"]) else \
            fmt.finish_length(stop)
        meta = fmt.meta_info(rid=f"r{sample_index}", finish_reason=finish,
                             prompt_tokens=len(payload["input_ids"]), weight_version="0",
                             request=payload, out_lp=w["sampled_lp"][sl].tolist(),
                             out_ids=w["sampled"][sl].tolist(), out_top_v=top_v, out_top_i=top_i,
                             completion_tokens=stop - start)
        return fmt.response_object(w["sampled"][sl].tolist(), meta)


def _args(**kw):
    return SimpleNamespace(**{"pdm_top_k": K, "pdm_vocab_size": V, "rollout_temperature": TEMP,
                              "pdm_loss": "pdm-agg", **kw})


def _slime_usual(args, samples):
    """The part of slime's own train data the loss reads (slime/ray/rollout.py)."""
    return {"tokens": [s.tokens for s in samples],
            "response_lengths": [s.response_length for s in samples],
            "loss_masks": [s.loss_mask for s in samples],
            "rollout_log_probs": [s.rollout_log_probs for s in samples]}


def _generate_all(world, args, transport):
    samples = [_Sample(group_index=b // 2, index=b) for b in range(len(world))]
    for s in samples:
        asyncio.run(hooks.generate(args, s, {"max_new_tokens": 8, "temperature": TEMP},
                                   transport=transport))
    return samples


def _batch(world, data):
    """The micro-batch slime's train side hands the custom loss (tensors per sample)."""
    batch = {"unconcat_tokens": [torch.tensor(t, dtype=torch.long) for t in data["tokens"]],
             "total_lengths": [len(t) for t in data["tokens"]],
             "response_lengths": data["response_lengths"],
             "loss_masks": [torch.tensor(m, dtype=torch.int) for m in data["loss_masks"]],
             "rollout_log_probs": [torch.tensor(x, dtype=torch.float32)
                                   for x in data["rollout_log_probs"]],
             "advantages": [w["adv"] for w in world],
             "pdm_topk_ids": data["pdm_topk_ids"], "pdm_topk_logprobs": data["pdm_topk_logprobs"]}
    batch["loss_masks"][2][1] = 0
    return batch


def _sum_of_sample_mean(batch):
    def fn(x):
        return sum((xs * m).sum() / m.sum().clamp_min(1)
                   for xs, m in zip(x.split(batch["response_lengths"]), batch["loss_masks"]))
    return fn


def _hooked(world, args):
    samples = _generate_all(world, args, _Transport(world))
    return _batch(world, hooks.convert_samples(args, samples, default=_slime_usual))


def _reference(logits, world):
    """The project's own path on the test's arrays, one gathered sample at a time."""
    total, end = 0.0, 0
    cfg = pdm.PolicyLossConfig.preset("pdm-agg")
    for b, (p, r) in enumerate(zip(PROMPTS, RESP)):
        end += p + r
        w = world[b]
        ids, lp, valid, _ = pdm.fold_support_torch(w["ids"], w["lp"], torch.isfinite(w["lp"]),
                                                   w["sampled"], w["sampled_lp"])
        st = pdm.token_stats(logits[0, end - r - 1:end - 1].clone(), w["sampled"], ids, lp,
                             valid, tp_group=None, vocab_size=V, temperature=TEMP)
        m = torch.ones(r)
        if b == 2:
            m[1] = 0
        out = pdm.policy_loss(st, w["adv"], w["sampled_lp"], m.bool(), cfg)
        total = total + out.per_token_loss.sum() / m.sum()
    return total


def test_generate_asks_sglang_for_the_top_k_and_stores_it_beside_slime_fields():
    _, world = _world()
    transport = _Transport(world)
    samples = _generate_all(world, _args(), transport)
    for payload, w in zip(transport.payloads, world):
        assert payload["top_logprobs_num"] == K and payload["return_logprob"] is True
        assert payload["input_ids"] == w["prompt"]
    for s, w in zip(samples, world):
        assert s.tokens == w["prompt"] + w["sampled"].tolist()
        assert s.rollout_log_probs == w["sampled_lp"].tolist()
        assert s.status == _Sample.Status.TRUNCATED and s.response_length == len(w["sampled"])
        assert s.pdm_topk_ids_RK.dtype == torch.int32
        valid = torch.isfinite(w["lp"])
        assert torch.equal(torch.isfinite(s.pdm_topk_logprobs_RK), valid)
        assert torch.equal(s.pdm_topk_ids_RK[valid], w["ids"][valid].int())
        assert torch.equal(s.pdm_topk_logprobs_RK[valid], w["lp"][valid])


def test_partial_rollout_appends_the_top_k_rows():
    _, world = _world()
    args = _args()
    transport = _Transport(world, cut=2)      # the first answer is aborted after 2 tokens
    s = _Sample(group_index=0, index=2)
    asyncio.run(hooks.generate(args, s, {"max_new_tokens": 8}, transport=transport))
    assert s.status == _Sample.Status.ABORTED and s.pdm_topk_ids_RK.shape == (2, K)
    asyncio.run(hooks.generate(args, s, {"max_new_tokens": 8}, transport=transport))
    assert transport.payloads[1]["sampling_params"]["max_new_tokens"] == 6
    whole = _generate_all(world, args, _Transport(world))[2]
    assert torch.equal(s.pdm_topk_ids_RK, whole.pdm_topk_ids_RK)
    assert torch.equal(s.pdm_topk_logprobs_RK, whole.pdm_topk_logprobs_RK)
    assert s.rollout_log_probs == whole.rollout_log_probs


def test_generate_convert_loss_equals_the_project_path_and_its_gradient():
    base, world = _world()
    batch = _hooked(world, _args())
    logits = base.clone().requires_grad_()
    loss, _ = pdm_loss(_args(), batch, logits, _sum_of_sample_mean(batch), tp_group=None)
    ref_logits = base.clone().requires_grad_()
    ref = _reference(ref_logits, world)
    assert torch.allclose(loss, ref, atol=1e-12), (float(loss), float(ref))
    loss.backward()
    ref.backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-12)


def _tp_worker(rank, world_size, out_dir):
    base, world = _world()
    batch = _hooked(world, _args())
    vl = V // world_size
    shard = base[..., rank * vl:(rank + 1) * vl].clone().requires_grad_()
    loss, _ = pdm_loss(_args(), batch, shard, _sum_of_sample_mean(batch),
                       tp_group=torch.distributed.group.WORLD)
    loss.backward()
    torch.save((float(loss), shard.grad), pathlib.Path(out_dir) / f"r{rank}.pt")


@pytest.mark.gloo
def test_generate_convert_loss_at_tp2_equals_the_project_path(tmp_path):
    base, world = _world()
    logits = base.clone().requires_grad_()
    ref = _reference(logits, world)
    ref.backward()
    run_gloo(_tp_worker, 2, str(tmp_path))
    for rank in range(2):
        value, grad = torch.load(tmp_path / f"r{rank}.pt")
        assert math.isclose(value, float(ref.detach()), rel_tol=1e-10)
        assert torch.allclose(grad, logits.grad[..., rank * 12:(rank + 1) * 12], atol=1e-10)


def _answer(world, b=2):
    transport = _Transport(world)
    transport.current = b
    return asyncio.run(transport.post(
        {"input_ids": world[b]["prompt"], "return_logprob": True, "top_logprobs_num": K}, None))


@pytest.mark.parametrize("spoil, message", [
    (lambda m: m["output_top_logprobs"][2][0].__setitem__(1, V + 3), r"position 2: .*\b27\b"),
    (lambda m: m["output_token_logprobs"][1].__setitem__(1, -1), r"position 1: "),
    (lambda m: m.pop("output_top_logprobs"), r"output_top_logprobs"),
    (lambda m: m["output_top_logprobs"].pop(), r"length mismatch"),
])
def test_bad_sglang_bodies_name_the_sample_and_position(spoil, message):
    _, world = _world()
    body = _answer(world)
    spoil(body["meta_info"])
    s = _Sample(group_index=1, index=2)
    with pytest.raises(RolloutValidationError, match=r"slime sample index=2 group=1.*" + message):
        hooks.record_response(_args(), s, body)
    assert s.response_length == 0 and not hasattr(s, hooks.IDS)   # nothing half-appended


def test_missing_or_misshaped_inputs_are_named():
    _, world = _world()
    with pytest.raises(ValueError, match="pdm_top_k"):
        hooks.record_response(_args(pdm_top_k=None), _Sample(index=0), _answer(world))
    samples = _generate_all(world, _args(), _Transport(world))
    del samples[1].pdm_topk_ids_RK
    with pytest.raises(ValueError, match=r"samples\[1\] \(slime sample index=1.*no top-K"):
        hooks.convert_samples(_args(), samples, default=_slime_usual)
    tool = _Sample(group_index=0, index=0, response_length=2, tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="index=0.*2 response tokens but top-K rows for 0"):
        hooks.record_response(_args(), tool, _answer(world, 0))
    base, world = _world()
    batch = _hooked(world, _args())
    for key, value, message in [("pdm_topk_ids", None, "missing.*passthrough.patch"),
                                ("pdm_topk_logprobs", batch["pdm_topk_logprobs"][:2], "2 samples"),
                                ("pdm_topk_ids", [x[:, :2].T for x in batch["pdm_topk_ids"]],
                                 r"sample 0: shape \(2, 3\), expected \[R=3, K\]")]:
        bad = dict(batch, **{key: value})
        with pytest.raises(ValueError, match=rf"batch\['{key}'\].*{message}"):
            pdm_loss(_args(), bad, base, _sum_of_sample_mean(batch), tp_group=None)


def test_convert_without_default_calls_slime_own_conversion(monkeypatch):
    """The @ray.remote RolloutManager's own method, on a stand-in self (hooks._slime_default)."""
    class Manager:   # the class ray keeps as __ray_metadata__.modified_class
        def _post_process_rewards(self, samples):
            post = self.custom_reward_post_process_func
            return post(self.args, samples) if post else ([1.0] * len(samples),) * 2

        def _convert_samples_to_train_data(self, samples):
            assert self.custom_convert_samples_to_train_data_func is None
            raw, rewards = self._post_process_rewards(samples)
            return dict(_slime_usual(self.args, samples), rewards=rewards, raw_reward=raw)

    remote = SimpleNamespace(__ray_metadata__=SimpleNamespace(modified_class=Manager))
    monkeypatch.setitem(sys.modules, "slime", types.ModuleType("slime"))
    def load_function(path):   # the reward post-process hook it resolves: (raw, normalised)
        return lambda args, samples: ([0.5] * len(samples), [2.0] * len(samples))

    for name, attrs in [("slime.ray", {}), ("slime.ray.rollout", {"RolloutManager": remote}),
                        ("slime.utils", {}),
                        ("slime.utils.misc", {"load_function": load_function})]:
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    _, world = _world()
    samples = _generate_all(world, _args(), _Transport(world))
    data = hooks.convert_samples(_args(), [samples[:2], samples[2:]])   # nested groups
    assert data["rewards"] == [1.0] * 3 and len(data["pdm_topk_ids"]) == 3
    data = hooks.convert_samples(_args(custom_reward_post_process_path="x.y"), samples)
    assert data["rewards"] == [2.0] * 3 and data["raw_reward"] == [0.5] * 3
    assert [x.shape for x in data["pdm_topk_logprobs"]] == [(r, K) for r in RESP]


def test_the_loss_import_loads_no_sglang_parser_and_the_hooks_resolve_lazily():
    code = ("import sys, megatron_pdm.integrations.slime as m; "
            "assert 'rollout_bridge.sglang.parse' not in sys.modules and 'orjson' not in "
            "sys.modules, sorted(k for k in sys.modules if 'rollout' in k); "
            "assert m.generate.__module__ == 'megatron_pdm.integrations.slime.hooks'; "
            "assert callable(m.convert_samples)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_passthrough_patch_names_its_commit_and_adds_both_keys_to_both_lists():
    text = (ROOT / "megatron_pdm/integrations/slime/passthrough.patch").read_text()
    assert re.search(r"THUDM/slime commit [0-9a-f]{40}", text)
    files = re.findall(r"^\+\+\+ b/(\S+)", text, re.MULTILINE)
    assert files == ["slime/backends/megatron_utils/model.py", "slime/ray/rollout.py"]
    added = re.findall(r'^\+\s+"(pdm_topk_\w+)",$', text, re.MULTILINE)
    assert added == list(hooks.TRAIN_KEYS) * 2
    assert not re.findall(r"^-[^-]", text, re.MULTILINE)     # adds only
