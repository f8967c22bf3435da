"""A free-logit policy for the closed-form test of the mask study (docs/math.md §1, §3.2).

The logits z [N, V] of N independent states are the parameters. One SGD step of size eta on the
summed surrogate sum_t -coeff_t log pi_k(t) (coeff = A min(r, C) M, detached) moves token t's
logits by exactly eta * coeff_t * (e_k - pi_t), and no token influences another, so the realised
change of D after the step is known in closed form. `FreeLogitProbe` implements the study's Probe
over it with the library's own `token_stats`, `policy_loss` and `token_table`.

`make_tokens` draws a reproducible case: behaviour logits z_mu, sampled token k ~ mu, support
TopK(mu, K) plus k (K + 1 slots, §3.9; fp32 behaviour log-probs as engines return them), a
training policy z = z_mu + noise, and advantages in {-1, -0.5, 0, 0.5, 1}.
"""

from __future__ import annotations

import math

import torch

import megatron_pdm as pdm
from megatron_pdm.analysis.token_table import token_table


def make_tokens(n: int, v: int, k_top: int, *, seed: int, noise: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    z_mu = 1.5 * torch.randn(n, v, generator=g, dtype=torch.float64)
    logmu = torch.log_softmax(z_mu, -1)
    k = torch.multinomial(logmu.exp(), 1, generator=g).squeeze(1)
    top = torch.topk(logmu, k_top, dim=-1).indices
    ids = torch.zeros(n, k_top + 1, dtype=torch.int64)
    lp = torch.full((n, k_top + 1), -math.inf, dtype=torch.float32)
    valid = torch.zeros(n, k_top + 1, dtype=torch.bool)
    ids[:, :k_top] = top
    valid[:, :k_top] = True
    outside = ~(top == k[:, None]).any(-1)
    ids[outside, k_top] = k[outside]
    valid[outside, k_top] = True
    lp[valid] = logmu.gather(1, ids)[valid].float()
    behavior = logmu.gather(1, k[:, None]).squeeze(1).float()
    adv = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])[torch.randint(0, 5, (n,), generator=g)]
    z = z_mu + noise * torch.randn(n, v, generator=g, dtype=torch.float64)
    return {"z": z, "k": k, "support_ids": ids, "support_logprobs": lp, "support_valid": valid,
            "behavior_logprob": behavior, "adv": adv, "loss_mask": torch.ones(n, dtype=torch.bool)}


class FreeLogitProbe:
    """Probe of `seed_study.measure_seed` with the logits themselves as the parameters."""

    def __init__(self, tokens: dict, criteria: list, *, lr: float):
        self.t = tokens
        self.criteria = criteria
        self.z = torch.nn.Parameter(tokens["z"].clone())
        self.opt = torch.optim.SGD([self.z], lr=lr)

    def _stats(self, logits):
        t = self.t
        return pdm.token_stats(logits, t["k"], t["support_ids"], t["support_logprobs"],
                               t["support_valid"], tp_group=None, vocab_size=None)

    def evaluate(self):
        with torch.no_grad():
            stats = self._stats(self.z.detach())
        return token_table(stats, self.t["adv"], self.t["behavior_logprob"],
                           self.t["loss_mask"], self.criteria)

    def step(self, cfg) -> None:
        self.opt.zero_grad()
        out = pdm.policy_loss(self._stats(self.z), self.t["adv"], self.t["behavior_logprob"],
                              self.t["loss_mask"], cfg)
        out.loss_sum.backward()  # the SUM: each token's step is eta * coeff * (e_k - pi)
        self.opt.step()

    def snapshot(self):
        return self.z.detach().clone()

    def restore(self, snap) -> None:
        with torch.no_grad():
            self.z.copy_(snap)

    def verify(self, snap) -> list[str]:
        return [] if torch.equal(self.z.detach(), snap) else ["z"]
