"""How far an engine's log-probs are from a policy's logits on the same tokens (exactness checks).

`LogprobAgreement` takes a packed rollout batch (rollout_bridge/core/packing.py: row-aligned, the
engine's sampled-token log-prob and top-K support on the row that predicts each response token)
and, chunk by chunk, the policy's logits on the same rows; the policy's log-probs are
log_softmax(logits / T) in float64 over the engine's vocabulary (padded ids dropped). It reports,
over loss rows, max/mean |policy - engine| of the sampled token, of every valid support slot, and
the fraction of rows whose top-K id set is the engine's. Used by
tests/support/vllm_exactness.py (the Megatron trainer) and megatron_pdm/tools/check_real_vllm.py
(transformers).

Chunks keep memory bounded: a [b, s, V] float64 tensor of a real vocabulary (V = 49,152) is
hundreds of MB per few rows.
"""

from __future__ import annotations

import torch


class LogprobAgreement:
    """Accumulates the engine-vs-policy errors of row chunks; `report()` summarises them."""

    def __init__(self, top_logprobs: int, vocab_size: int, temperature: float):
        self.k = int(top_logprobs)
        self.vocab = int(vocab_size)
        self.temperature = float(temperature)
        self.err_sampled: list[torch.Tensor] = []
        self.err_support: list[torch.Tensor] = []
        self.same_set: list[torch.Tensor] = []

    def add(self, logits_bsv: torch.Tensor, packed) -> None:
        """`logits_bsv` [b, s, >= V]: the policy's logits on the rows of `packed` (b rows)."""
        if logits_bsv.shape[:2] != packed.tokens.shape:
            raise ValueError(f"logits {tuple(logits_bsv.shape)} do not cover the packed rows "
                             f"{tuple(packed.tokens.shape)}")
        vocab = self.vocab
        lp_bsv = torch.log_softmax(logits_bsv[..., :vocab].double() / self.temperature, dim=-1)
        mask_bs = packed.loss_mask
        sampled_bs = lp_bsv.gather(-1, packed.labels.clamp(max=vocab - 1)[..., None])[..., 0]
        self.err_sampled.append((sampled_bs - packed.behavior_logprob.double())[mask_bs].abs())
        valid_bss = packed.support_valid & mask_bs[..., None]
        ids_bss = packed.support_ids.long().clamp(max=vocab - 1)
        at_support_bss = lp_bsv.gather(-1, ids_bss)
        self.err_support.append(
            (at_support_bss - packed.support_logprobs.double())[valid_bss].abs())
        # top-K ids the policy would pick vs the engine's (rows whose K slots are all valid)
        k = self.k
        top_policy_bsk = torch.topk(lp_bsv, k, dim=-1).indices.sort(-1).values
        eng_bsk = packed.support_ids[..., :k].long()
        full_rows_bs = mask_bs & packed.support_valid[..., :k].all(-1)
        self.same_set.append((top_policy_bsk == eng_bsk.sort(-1).values).all(-1)[full_rows_bs])

    def report(self) -> dict:
        sampled = torch.cat(self.err_sampled) if self.err_sampled else torch.zeros(0)
        support = torch.cat(self.err_support) if self.err_support else torch.zeros(0)
        same = torch.cat(self.same_set) if self.same_set else torch.zeros(0, dtype=torch.bool)
        if sampled.numel() == 0:
            raise ValueError("no loss tokens were compared")
        return {"temperature": self.temperature, "tokens": int(sampled.numel()),
                "support_slots": int(support.numel()),
                "max_abs_err_sampled": float(sampled.max()),
                "mean_abs_err_sampled": float(sampled.mean()),
                "max_abs_err_support": float(support.max()),
                "mean_abs_err_support": float(support.mean()),
                "topk_set_agreement": float(same.double().mean()) if same.numel() else None}
