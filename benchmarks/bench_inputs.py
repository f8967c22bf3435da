"""Benchmark inputs for one TP rank's logits shard: RL-realistic, or with a random support.

`realistic` is what reinforcement learning feeds the op. The training policy pi = softmax(z) over
the full vocabulary V = V_local * tp is LLM-shaped: a few dozen "candidate" tokens per row carry
almost all of the mass above a Gaussian background (top-20 mass ~99%). The behaviour policy mu
is a nearby distribution: the same logits with N(0, 0.3^2) noise on the 64 largest of them (so
mu's top-K and pi's top-K overlap as they do between a rollout engine and the trainer). The
support is mu's top-K with the sampled token folded in (docs/math.md §3.9), the sampled token
is drawn from pi, and the behaviour log-probabilities are log mu, exactly normalized. On such
rows the training policy's row maximum is almost always a support column, and rank 0 owns the
support ids that fall in its shard [0, V_local).

`real` is the real model's logits (SmolLM2-135M-Instruct, V = 49,152; megatron_pdm/analysis/
real_logits.py, cached in .cache/): pi = the fp32 trainer's logits on sampled responses, the
support = the top-K of the bf16 engine copy (the "bf16" pair) with the sampled token folded in.

`random` is the earlier benchmark's input: Gaussian logits (scale 3) and a support drawn with
`randperm` from the local shard, so the row maximum is almost never a support column. Kept as a
second row: it shows what changes when the op's masked columns do not hold the maximum.

Shape legend: N tokens, V full vocabulary, Vl local shard, S = K + 1 support slots, C candidates.
"""

from __future__ import annotations

import math

import torch

__all__ = ["describe", "make_inputs"]

CANDIDATES = 64
"""mu differs from pi on pi's top-C logits (enough to hold mu's top-K for K <= 40)."""


def _realistic_rows(g: torch.Generator, rows: int, vocab: int, k: int):
    """One chunk of rows: (full logits [R, V] fp32, sampled [R], ids [R, S], logmu [R, S],
    valid [R, S], behaviour log-prob of the sampled token [R])."""
    z_RV = 2.0 * torch.randn(rows, vocab, generator=g)
    hot_RH = torch.randint(0, vocab, (rows, 24), generator=g)
    boost_RH = 11.0 + 3.0 * torch.randn(rows, 24, generator=g)
    z_RV.scatter_add_(1, hot_RH, boost_RH)
    # pi: sample the token (fp64 probabilities for multinomial's accuracy on the small tail)
    lse_R = torch.logsumexp(z_RV.double(), -1)
    probs_RV = torch.exp(z_RV.double() - lse_R[:, None])
    sampled_R = torch.multinomial(probs_RV, 1, generator=g).squeeze(1)
    del probs_RV
    # mu: noise on pi's top-C logits, the rest unchanged; exact normalizer in fp64
    top_val_RC, top_idx_RC = z_RV.topk(CANDIDATES, dim=-1)
    mu_val_RC = top_val_RC.double() + 0.3 * torch.randn(rows, CANDIDATES, generator=g).double()
    pi_top_mass_R = torch.exp(top_val_RC.double() - lse_R[:, None]).sum(-1)
    rest_R = torch.log((1.0 - pi_top_mass_R).clamp_min(1e-300)) + lse_R
    log_z_mu_R = torch.logsumexp(torch.cat([mu_val_RC, rest_R[:, None]], 1), -1)
    logmu_RC = mu_val_RC - log_z_mu_R[:, None]
    sup_lp_RK, order_RK = logmu_RC.topk(k, dim=-1)
    sup_id_RK = top_idx_RC.gather(1, order_RK)
    # behaviour log-prob of the sampled token (candidate or background)
    is_cand_RC = top_idx_RC == sampled_R[:, None]
    beh_cand_R = torch.where(is_cand_RC, logmu_RC, 0.0).sum(-1)
    beh_bg_R = z_RV.gather(1, sampled_R[:, None]).squeeze(1).double() - log_z_mu_R
    beh_R = torch.where(is_cand_RC.any(-1), beh_cand_R, beh_bg_R)
    # fold the sampled token into the support (slot K when outside the top-K)
    in_top_R = (sup_id_RK == sampled_R[:, None]).any(-1)
    sup_lp_RK = torch.where(sup_id_RK == sampled_R[:, None], beh_R[:, None], sup_lp_RK)
    ids_RS = torch.cat([sup_id_RK, torch.where(in_top_R, 0, sampled_R)[:, None]], 1)
    lp_RS = torch.cat([sup_lp_RK, torch.where(in_top_R, -math.inf, beh_R)[:, None]], 1)
    valid_RS = torch.ones_like(ids_RS, dtype=torch.bool)
    valid_RS[:, -1] = ~in_top_R
    return z_RV, sampled_R, ids_RS.int(), lp_RS.float(), valid_RS, beh_R.float()


def _realistic(n: int, vl: int, tp: int, k: int, dtype: torch.dtype, seed: int, other: bool):
    g = torch.Generator().manual_seed(seed)
    vocab = vl * tp
    shard = torch.empty(n, vl, dtype=dtype)
    rest = torch.empty(n, vocab - vl, dtype=dtype) if other else None
    parts = []
    step = 256
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        z_RV, *small = _realistic_rows(g, r1 - r0, vocab, k)
        shard[r0:r1] = z_RV[:, :vl]
        if rest is not None:
            rest[r0:r1] = z_RV[:, vl:]
        parts.append(small)
    sampled, ids, lp, valid, beh = (torch.cat(p) for p in zip(*parts))
    return {"shard": shard, "other": rest, "sampled": sampled, "ids": ids, "logprobs": lp,
            "valid": valid, "behavior_logprob": beh, "vocab_size": vocab}


def _random(n: int, vl: int, tp: int, k: int, dtype: torch.dtype, seed: int, other: bool):
    g = torch.Generator().manual_seed(seed)
    shard = (torch.randn(n, vl, generator=g) * 3).to(dtype)
    rest = (torch.randn(n, vl * (tp - 1), generator=g) * 3).to(dtype) if other else None
    top = torch.stack([torch.randperm(vl, generator=g)[:k] for _ in range(min(n, 64))])
    top = top.repeat((n + 63) // 64, 1)[:n]
    sampled = top[:, 0].clone()
    ids = torch.cat([top, torch.zeros(n, 1, dtype=torch.long)], 1).to(torch.int32)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[:, -1] = False  # sampled token inside the top-K
    logprobs = torch.full(ids.shape, -4.0)
    logprobs[:, -1] = -math.inf
    return {"shard": shard, "other": rest, "sampled": sampled, "ids": ids, "logprobs": logprobs,
            "valid": valid, "behavior_logprob": torch.full((n,), -4.0), "vocab_size": vl * tp}


def _real(n: int, vl: int, tp: int, k: int, dtype: torch.dtype, other: bool, pair: str):
    """The real model's logits (megatron_pdm/analysis/real_logits.py, cached): pi's logits of
    the RL pair `pair`, the engine's top-K of mu with the sampled token folded in."""
    from megatron_pdm.analysis import real_logits as rl

    data = rl.load_or_build(rl.RealLogitsConfig(tokens=max(n, rl.RealLogitsConfig.tokens)))
    pi_NV, mu_NV = data.pair(pair)
    vocab = pi_NV.shape[1]
    if vl * tp != vocab:
        raise ValueError(f"real inputs: V_local {vl} x TP {tp} != the model's vocabulary {vocab}")
    sampled = data.sampled_ids[:n]
    ids, lp, valid, beh = rl.engine_support(mu_NV[:n], sampled, k)
    return {"shard": pi_NV[:n, :vl].to(dtype).contiguous(),
            "other": pi_NV[:n, vl:].to(dtype).contiguous() if other else None,
            "sampled": sampled, "ids": ids, "logprobs": lp, "valid": valid,
            "behavior_logprob": beh, "vocab_size": vocab}


def make_inputs(kind: str, n: int, vl: int, tp: int, k: int, dtype: torch.dtype, *,
                seed: int = 0, other: bool = False, pair: str = "bf16") -> dict:
    """Inputs of rank 0: `shard` [N, Vl] in `dtype`, `other` (the remaining [N, V - Vl] columns,
    only with other=True: what an all-gather adds), `sampled` [N], `ids`/`logprobs`/`valid`
    [N, K+1], `behavior_logprob` [N], `vocab_size` V. `pair` (real inputs only): the RL pair of
    megatron_pdm/analysis/real_logits.py."""
    if kind == "realistic":
        return _realistic(n, vl, tp, k, dtype, seed, other)
    if kind == "random":
        return _random(n, vl, tp, k, dtype, seed, other)
    if kind == "real":
        return _real(n, vl, tp, k, dtype, other, pair)
    raise ValueError(f"unknown input kind {kind!r} (realistic | random | real)")


def describe(inp: dict) -> dict:
    """Facts about the inputs that decide the op's cost: how often the local row maximum is an
    owned support column, the support's mass under pi (full rows unknown here: local shard)."""
    shard = inp["shard"].float()
    vl = shard.shape[1]
    ids = inp["ids"].long()
    owned = inp["valid"] & (ids < vl)
    argmax = shard.argmax(-1)
    hit = (owned & (ids == argmax[:, None])).any(-1)
    return {"row_max_in_support": float(hit.double().mean()),
            "sampled_in_top_k": float((~inp["valid"][:, -1]).double().mean())}
