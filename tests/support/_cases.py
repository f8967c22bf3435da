"""Seeded random token batches for the op tests (shared by unit and distributed tests).

A case is built once on the global (padded) vocabulary and sliced per rank, as torchtitan does.
The behavior policy mu is a perturbation of pi; the support is TopK(mu) plus the sampled token
folded in once (an extra slot when it is outside the top-K, otherwise that slot is invalid).
"""

from __future__ import annotations

import torch


def make_case(
    seed: int,
    n: int,
    vocab_size: int,
    k: int,
    *,
    padded_vocab: int | None = None,
    dtype: torch.dtype = torch.float32,
    noise: float = 0.5,
    scale: float = 2.0,
    hot_range: tuple[int, int] | None = None,
) -> dict:
    """Builds a case. hot_range=(lo, hi) makes mu's top-K land inside [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    vp = padded_vocab or vocab_size
    logits = torch.randn(n, vp, generator=g, dtype=torch.float64) * scale
    mu_logits = logits[:, :vocab_size] + noise * torch.randn(n, vocab_size, generator=g,
                                                              dtype=torch.float64)
    if hot_range is not None:
        mu_logits[:, hot_range[0]: hot_range[1]] += 8.0
    logmu = torch.log_softmax(mu_logits, -1)
    sampled = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1) if n else torch.zeros(
        0, dtype=torch.long)
    top_ids = logmu.topk(k, dim=-1).indices if n else torch.zeros(0, k, dtype=torch.long)
    in_top = (top_ids == sampled[:, None]).any(-1)
    ids = torch.cat([top_ids, sampled[:, None]], dim=1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[:, -1] = ~in_top
    ids[:, -1] = torch.where(in_top, 0, sampled)
    support_logprobs = torch.where(valid, logmu.gather(1, ids), -torch.inf).float()
    logits_pad = logits.clone()
    if vp > vocab_size:
        logits_pad[:, vocab_size:] = 30.0  # garbage padding the op must ignore
    return dict(
        logits=logits_pad.to(dtype),
        sampled_ids=sampled,
        support_ids=ids.to(torch.int32),
        support_logprobs=support_logprobs,
        support_valid=valid,
        behavior_logprob=logmu.gather(1, sampled[:, None]).squeeze(1).float(),
        vocab_size=vocab_size,
    )


def op_args(case: dict) -> tuple:
    return (case["sampled_ids"], case["support_ids"], case["support_logprobs"],
            case["support_valid"])
