"""Checks of megatron_pdm.integrations.verl against the installed verl 0.9.1 (run in the verl
env by tests/integrations/test_verl_adapter.py: `python verl_checks.py REPORT.json [CHECK...]`).

Each check runs on CPU at function level and records "ok" or its traceback in the report, so
one interpreter (one verl import, ~8 s) serves several tests. Shapes: B samples, R response
tokens, S support slots.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import SimpleNamespace

import torch

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _batch(seed: int = 0, b: int = 3, r: int = 7, v: int = 13, k: int = 3, noise: float = 0.7):
    """verl-shaped [B, R] tensors plus the flat [N] view the project's loss takes (fp64)."""
    from megatron_pdm.integrations import verl_rows
    g = torch.Generator().manual_seed(seed)
    logits_BRV = torch.randn(b, r, v, generator=g, dtype=torch.float64) * 2
    behav_BRV = torch.log_softmax(logits_BRV + noise * torch.randn(b, r, v, generator=g,
                                                                   dtype=torch.float64), -1)
    label_BR = torch.multinomial(behav_BRV.exp().reshape(-1, v), 1, generator=g).reshape(b, r)
    # the engine's logprobs are fp32 (the support keeps fp32): the same numbers for both sides
    behav_BRV = behav_BRV.float().double()
    top = behav_BRV.topk(k, -1)
    ids, lp = [], []
    for bi in range(b):  # vLLM-shaped dicts through the rollout conversion
        dicts = []
        for t in range(r):
            d = {int(top.indices[bi, t, j]): SimpleNamespace(logprob=float(top.values[bi, t, j]),
                                                            rank=j + 1) for j in range(k)}
            tok = int(label_BR[bi, t])
            d.setdefault(tok, SimpleNamespace(logprob=float(behav_BRV[bi, t, tok]), rank=k + 5))
            dicts.append(d)
        i_RS, l_RS = verl_rows.support_from_vllm_logprobs(dicts, label_BR[bi].tolist(), k)
        ids.append(i_RS)
        lp.append(l_RS)
    adv_BR = torch.randn(b, r, generator=g, dtype=torch.float64)
    adv_BR[0, 1] = 0.0
    mask_BR = torch.ones(b, r, dtype=torch.bool)
    mask_BR[2, r - 2:] = False  # a shorter last sample
    return SimpleNamespace(logits=logits_BRV, label=label_BR, ids=torch.stack(ids),
                           lp=torch.stack(lp).double(), adv=adv_BR, mask=mask_BR,
                           behav=behav_BRV.gather(-1, label_BR[..., None])[..., 0])


def _project(x, cfg):
    """The project's own policy_loss on the same rows: (loss, grad of the logits)."""
    import megatron_pdm as pdm
    b, r, v = x.logits.shape
    logits = x.logits.clone().requires_grad_(True)
    valid = torch.isfinite(x.lp)
    stats = pdm.token_stats(logits.reshape(-1, v), x.label.reshape(-1),
                            x.ids.reshape(b * r, -1).int(), x.lp.reshape(b * r, -1).float(),
                            valid.reshape(b * r, -1), tp_group=None, vocab_size=None)
    seq = torch.arange(b)[:, None].expand(b, r).reshape(-1)
    out = pdm.policy_loss(stats, x.adv.reshape(-1), x.behav.reshape(-1), x.mask.reshape(-1), cfg,
                          seq_ids=seq)
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    return loss.detach(), logits.grad


def _verl(x, name, loss_agg_mode="token-mean"):
    """The same loss through verl's registry: log_prob from the logits, w from the processor."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    import megatron_pdm as pdm
    from megatron_pdm.integrations import verl_rows
    cfg = pdm.PolicyLossConfig.preset(name)
    logits = x.logits.clone().requires_grad_(True)
    f = verl_rows.pdm_token_fields(logits, x.label, x.ids, x.lp, cfg, tp_group=None,
                                   vocab_size=None)
    w = verl_rows.select_weight(x.adv, f["pdm_weight_pos"], f["pdm_weight_neg"])
    log_prob = torch.log_softmax(logits, -1).gather(-1, x.label[..., None])[..., 0]
    config = SimpleNamespace(global_batch_info={})
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=x.behav, log_prob=log_prob, advantages=x.adv, response_mask=x.mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=w)
    loss.backward()
    return loss.detach(), logits.grad, metrics


@check
def registry_after_import_only():
    from verl.trainer.ppo import core_algos
    assert "pdm-agg" not in core_algos.POLICY_LOSS_REGISTRY, "registered before the import"
    import megatron_pdm.integrations.verl as mv
    assert set(mv.REGISTERED) >= {"pdm-agg", "pdm-tv", "grpo", "dppo-topk-kl", "drpo"}
    for name in mv.REGISTERED:
        assert core_algos.get_policy_loss_fn(name) is mv.verl_policy_loss, name
    assert core_algos.get_policy_loss_fn("vanilla").__module__ == "verl.trainer.ppo.core_algos"


@check
def loss_equals_project_token_mean():
    import megatron_pdm as pdm
    import megatron_pdm.integrations.verl as mv
    for i, name in enumerate(mv.REGISTERED):
        x = _batch(seed=i)
        want, want_g = _project(x, pdm.PolicyLossConfig.preset(name))
        got, got_g, metrics = _verl(x, name)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-9), (name, float(got), float(want))
        assert torch.allclose(got_g, want_g, rtol=1e-6, atol=1e-9), name
        assert 0.0 <= metrics["actor/pg_clipfrac"] <= 1.0


@check
def loss_equals_project_seq_mean_token_sum():
    import megatron_pdm as pdm
    x = _batch(seed=5)
    cfg = pdm.PolicyLossConfig.preset("pdm-agg", aggregation="seq-mean-token-sum")
    want, want_g = _project(x, cfg)
    got, got_g, _ = _verl(x, "pdm-agg", "seq-mean-token-sum")
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9), (float(got), float(want))
    assert torch.allclose(got_g, want_g, rtol=1e-6, atol=1e-9)


@check
def masking_is_live():
    """Trust-region weights really drop tokens (else the equality above proves little)."""
    from megatron_pdm.integrations import verl_rows
    import megatron_pdm as pdm
    x = _batch(seed=1, noise=2.0)
    f = verl_rows.pdm_token_fields(x.logits, x.label, x.ids, x.lp,
                                   pdm.PolicyLossConfig.preset("pdm-agg"), tp_group=None,
                                   vocab_size=None)
    w = verl_rows.select_weight(x.adv, f["pdm_weight_pos"], f["pdm_weight_neg"])
    moving = x.mask & (x.adv != 0)
    assert 0 < int((moving & (w == 0)).sum()) < int(moving.sum())


def _td(x, fields):
    """A verl-shaped no-padding micro-batch (nested prompts/responses) and model output."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    b, r = x.adv.shape
    p = 2
    lens = x.mask.sum(-1).tolist()
    nest = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    data = TensorDict({
        "prompts": nest([torch.ones(p, dtype=torch.long)] * b),
        "responses": nest([x.label[i, :n] for i, n in enumerate(lens)]),
        "response_mask": nest([x.mask[i, :n].long() for i, n in enumerate(lens)]),
        "old_log_probs": nest([x.behav[i, :n] for i, n in enumerate(lens)]),
        "advantages": nest([x.adv[i, :n] for i, n in enumerate(lens)]),
    }, batch_size=[b])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)

    def seq(t_BR):  # per token of the whole sequence: row p - 1 + t scores response token t
        return nest([torch.cat([torch.zeros(p - 1, dtype=t_BR.dtype), t_BR[i, :n],
                                torch.zeros(1, dtype=t_BR.dtype)]) for i, n in enumerate(lens)])
    out = {k: seq(v) for k, v in fields.items()}
    return data, out


@check
def ppo_loss_path_equals_project():
    """pdm_ppo_loss's final role through verl's own ppo_loss and no_padding_2_padding."""
    import megatron_pdm as pdm
    from megatron_pdm.integrations import verl_rows
    import megatron_pdm.integrations.verl as mv
    from verl.workers.config import ActorConfig
    x = _batch(seed=3)
    x.mask[:] = True  # verl's response_mask is 1 on every real response token
    cfg = pdm.PolicyLossConfig.preset("pdm-tv")
    want, _ = _project(x, cfg)
    logits = x.logits.clone().requires_grad_(True)
    f = verl_rows.pdm_token_fields(logits, x.label, x.ids, x.lp, cfg, tp_group=None,
                                   vocab_size=None)
    f["log_probs"] = torch.log_softmax(logits, -1).gather(-1, x.label[..., None])[..., 0]
    data, model_output = _td(x, f)
    actor = ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                        policy_loss={"loss_mode": "pdm-tv"})
    loss, metrics = mv.pdm_ppo_loss(actor, model_output=model_output, data=data, vocab_size=None)
    assert torch.allclose(loss.detach(), want, rtol=1e-6, atol=1e-9), (float(loss), float(want))
    assert "rollout_is_weights" not in data.keys()
    data["rollout_is_weights"] = data["advantages"]
    try:
        mv.pdm_ppo_loss(actor, model_output=model_output, data=data, vocab_size=None)
    except ValueError as e:
        assert "rollout_is_weights" in str(e) and "rollout correction" in str(e)
    else:
        raise AssertionError("a batch with verl's rollout_is_weights was accepted")


@check
def bad_input_is_named():
    import megatron_pdm.integrations.verl as mv
    from tensordict import TensorDict
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    x = _batch(seed=2)
    actor = SimpleNamespace(policy_loss={"loss_mode": "pdm-agg"})
    data = TensorDict({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, batch_size=[1])
    for call, needle in (
        (lambda: mv.pdm_ppo_loss(actor, data=data, student_logits=x.logits, vocab_size=None),
         "pdm_topk_ids"),
        (lambda: get_policy_loss_fn("pdm-agg")(x.behav, x.behav, x.adv, x.mask, "token-mean",
                                               SimpleNamespace(), None), "rollout_is_weights"),
        (lambda: get_policy_loss_fn("pdm-agg")(x.behav, x.behav, x.adv[:, :3], x.mask,
                                               "token-mean", SimpleNamespace(), x.adv),
         "advantages"),
        (lambda: mv.preset_for(SimpleNamespace(policy_loss={"loss_mode": "vanilla"})),
         "loss_mode"),
    ):
        try:
            call()
        except (KeyError, ValueError) as e:
            assert needle in str(e), (needle, str(e))
        else:
            raise AssertionError(f"no error naming {needle}")


def _processor_worker(rank: int, world: int) -> None:
    """pdm_ppo_loss as verl's logits processor on this rank's vocab shard of packed THD logits:
    verl's own preprocess_thd_engine packs the keys; the fields equal the op on the full logits,
    and exactly the rows that score a response token carry a support."""
    from megatron_pdm.mcore.parallel import apply_cpu_shim, init_model_parallel
    apply_cpu_shim()
    init_model_parallel(world, 1, 1)
    from tensordict import TensorDict
    from verl.models.mcore.util import preprocess_thd_engine
    import megatron_pdm as pdm
    import megatron_pdm.integrations.verl as mv
    from megatron_pdm.integrations import verl_rows
    v, k = 16, 3
    g = torch.Generator().manual_seed(7)
    prompt, resp = [2, 3], [4, 3]
    seqs, ids, lps = [], [], []
    for p, r in zip(prompt, resp):
        tok = torch.randint(0, v, (p + r,), generator=g)
        behav = torch.log_softmax(torch.randn(r, v, generator=g), -1)
        top = behav.topk(k, -1)
        dicts = [{int(top.indices[t, j]): SimpleNamespace(logprob=float(top.values[t, j]),
                                                         rank=j + 1) for j in range(k)}
                 for t in range(r)]
        for t in range(r):
            dicts[t].setdefault(int(tok[p + t]), SimpleNamespace(
                logprob=float(behav[t, tok[p + t]]), rank=k + 2))
        i_RS, l_RS = verl_rows.support_from_vllm_logprobs(dicts, tok[p:].tolist(), k)
        i_TS, l_TS = verl_rows.full_sequence_support(p, i_RS, l_RS)
        seqs.append(tok)
        ids.append(i_TS)
        lps.append(l_TS)
    nest = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    # the support under verl's own top-K keys (the path verl's agent loop already has)
    data = TensorDict({"input_ids": nest(seqs), "teacher_ids": nest(ids),
                       "teacher_logprobs": nest(lps)}, batch_size=[2])
    label = preprocess_thd_engine(data["input_ids"], pre_process=True, need_roll=True)[0]
    t_packed = label.shape[-1]
    logits = torch.randn(1, t_packed, v, generator=g)
    shard = logits.chunk(world, -1)[rank].contiguous()
    actor = SimpleNamespace(policy_loss={"loss_mode": "pdm-agg"})
    got = mv.pdm_ppo_loss(actor, data=data, student_logits=shard, data_format="thd",
                          vocab_size=v, support_keys=("teacher_ids", "teacher_logprobs"))
    pack = lambda key: preprocess_thd_engine(data[key], pre_process=True,  # noqa: E731
                                             need_roll=True)[0]
    want = verl_rows.pdm_token_fields(logits, label.reshape(1, -1),
                                      pack("teacher_ids").reshape(1, t_packed, -1),
                                      pack("teacher_logprobs").reshape(1, t_packed, -1),
                                      pdm.PolicyLossConfig.preset("pdm-agg"), tp_group=None,
                                      vocab_size=None)
    for key in verl_rows.FIELD_KEYS:
        assert got[key].shape == (1, t_packed), (key, got[key].shape)
        assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-6), (rank, key)
    # rows p - 1 .. p + r - 2 of each (tp-aligned) packed sequence score its response tokens
    expect = torch.zeros(t_packed)
    start = 0
    for p, r in zip(prompt, resp):
        expect[start + p - 1: start + p + r - 1] = 1
        start += -(-(p + r) // world) * world
    assert torch.equal(got["pdm_has_support"][0].float(), expect), got["pdm_has_support"]
    assert bool((got["pdm_weight_pos"][0][expect == 0] == 0).all())


def _processor(world: int) -> None:
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/support")  # tests/support, for _dist
    from _dist import run_gloo
    run_gloo(_processor_worker, world)


@check
def processor_role_tp1():
    _processor(1)


@check
def processor_role_tp2():
    _processor(2)


def main() -> None:
    """verl_checks.py REPORT [CHECK ...]: the named checks (default: all)."""
    report = {}
    for name, fn in CHECKS.items():
        if sys.argv[2:] and name not in sys.argv[2:]:
            continue
        try:
            fn()
            report[name] = "ok"
        except BaseException:  # noqa: BLE001  (each check reports its own traceback)
            report[name] = traceback.format_exc()
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
