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
    """Probe of `seed_study.measure_seed` with the logits themselves as the parameters.

    adam=None: plain SGD (no state); adam=(beta1, beta2, eps): torch Adam, whose moments
    `prime` builds with a few steps (the decomposition test's momentum)."""

    def __init__(self, tokens: dict, criteria: list, *, lr: float,
                 adam: tuple[float, float, float] | None = None):
        self.t = tokens
        self.criteria = criteria
        self.z = torch.nn.Parameter(tokens["z"].clone())
        self.opt = (torch.optim.SGD([self.z], lr=lr) if adam is None else
                    torch.optim.Adam([self.z], lr=lr, betas=adam[:2], eps=adam[2]))

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

    def prime(self, cfg, steps: int) -> None:
        """`steps` optimizer steps with the loss `cfg`, then the logits are put back to the
        tokens' z: the optimizer keeps the moments of those steps (a state with momentum)."""
        for _ in range(steps):
            self.step(cfg)
        with torch.no_grad():
            self.z.copy_(self.t["z"])

    def step_momentum(self) -> None:
        self.opt.zero_grad()
        self.z.grad = torch.zeros_like(self.z)
        self.opt.step()

    def step_gradient(self, cfg, lr: float) -> None:
        self.z.grad = None
        out = pdm.policy_loss(self._stats(self.z), self.t["adv"], self.t["behavior_logprob"],
                              self.t["loss_mask"], cfg)
        out.loss_sum.backward()
        with torch.no_grad():
            self.z.add_(self.z.grad, alpha=-lr)

    def snapshot(self):
        state = {k: (v.clone() if torch.is_tensor(v) else v)
                 for k, v in self.opt.state.get(self.z, {}).items()}
        return self.z.detach().clone(), state

    def restore(self, snap) -> None:
        z, state = snap
        with torch.no_grad():
            self.z.copy_(z)
        self.opt.state[self.z] = {k: (v.clone() if torch.is_tensor(v) else v)
                                  for k, v in state.items()}

    def verify(self, snap) -> list[str]:
        z, state = snap
        live = self.opt.state.get(self.z, {})
        bad = [] if torch.equal(self.z.detach(), z) else ["z"]
        def same(a, b):
            if torch.is_tensor(a) and torch.is_tensor(b):
                return torch.equal(a, b)
            return not torch.is_tensor(a) and not torch.is_tensor(b) and a == b

        return bad + [k for k in set(state) | set(live)
                      if k not in live or k not in state or not same(live[k], state[k])]
