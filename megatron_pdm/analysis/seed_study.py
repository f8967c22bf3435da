"""One seed of the mask study: same state, same tokens, one step per criterion (§3.7).

    before = probe.evaluate()                       D, masks, Ddot of every criterion
    snap   = probe.snapshot()
    for each criterion c, then the unmasked reference step:
        probe.restore(snap); probe.step(c.cfg)      ONE optimizer step with c's mask
        after[c] = probe.evaluate()                 D against the stored behaviour policy
    with controls (module counting.py), from the same snapshot each:
        probe.step_momentum()                       zero gradient: the momentum's step alone
        probe.step_gradient(c.cfg, lr) per c        plain SGD on c's masked loss, no state
    probe.restore(snap); probe.verify(snap)         bit-exact, or RuntimeError
    probe.evaluate() == before                      bit-exact, or RuntimeError
    counts = count_seed(criteria, before, after)

A `Probe` is anything that can evaluate the study tokens, take one optimizer step with a given
loss config and snapshot/restore its state: `megatron_probe.MegatronProbe` (the real model and
optimizer of a run, any TP size) for the CLI, a free-logit policy for the closed-form test. The
orchestration and the counting are the same code for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_pdm.analysis.counting import count_seed
from megatron_pdm.analysis.criteria import KEEP_ALL, MOMENTUM_ONLY, Criterion, control_key
from megatron_pdm.analysis.token_table import TokenTable
from megatron_pdm.config import PolicyLossConfig

__all__ = ["Probe", "SeedMeasurement", "measure_seed", "token_arrays"]


class Probe(Protocol):
    def evaluate(self) -> TokenTable:
        """The token table of the current state on the study tokens (same order every call)."""

    def step(self, cfg: PolicyLossConfig) -> None:
        """One optimizer step on the study tokens with the loss `cfg`."""

    def step_momentum(self) -> None:
        """The optimizer's step from the current state with every gradient zero."""

    def step_gradient(self, cfg: PolicyLossConfig, lr: float) -> None:
        """Plain SGD (params -= lr * grad, no optimizer state) on the loss `cfg`."""

    def snapshot(self) -> Any:
        """An exact copy of everything a step changes."""

    def restore(self, snap: Any) -> None:
        """Writes `snap` back."""

    def verify(self, snap: Any) -> list[str]:
        """What differs from `snap` (empty when the state equals it bit for bit)."""


@dataclass
class SeedMeasurement:
    """counts: `count_seed` output; before/after: the token tables (after: per criterion and
    KEEP_ALL)."""

    counts: dict
    before: TokenTable
    after: dict[str, TokenTable]


def measure_seed(probe: Probe, criteria: list[Criterion], keep_all: PolicyLossConfig | None, *,
                 tol: float = 0.0, sgd_lr: float | None = None, controls: tuple = (),
                 control_seed: int = 0) -> SeedMeasurement:
    """Runs the protocol of the module docstring on `probe`'s current state.

    Args:
        probe: the model/optimizer and tokens under study.
        criteria: the compared criteria (one step each).
        keep_all: config of the unmasked reference step (None: skip it and the prediction scores).
        tol: dead zone of dD for the counts.
        sgd_lr: with a value, the decomposition controls too (the zero-gradient step and one
            plain-SGD step of this size per criterion); None: no controls.
        controls, control_seed: the synthetic controls counted beside the criteria
            (controls.py; no step of their own) and the seed of their flips.

    Raises:
        RuntimeError: when the state after the restore is not bit-exact (naming what differs),
            or the batch re-evaluates differently.
    """
    before = probe.evaluate()
    snap = probe.snapshot()
    steps = [(c.name, c.cfg) for c in criteria]
    if keep_all is not None:
        steps.append((KEEP_ALL, keep_all))
    after: dict[str, TokenTable] = {}
    for name, cfg in steps:
        probe.restore(snap)
        probe.step(cfg)
        after[name] = probe.evaluate()
    if sgd_lr is not None:
        if not sgd_lr > 0:
            raise ValueError(f"sgd_lr={sgd_lr}: the own-gradient control needs a step size > 0")
        probe.restore(snap)
        probe.step_momentum()
        after[MOMENTUM_ONLY] = probe.evaluate()
        for c in criteria:
            probe.restore(snap)
            probe.step_gradient(c.cfg, sgd_lr)
            after[control_key(c.name, "gradient")] = probe.evaluate()
    probe.restore(snap)
    bad = probe.verify(snap)
    if bad:
        raise RuntimeError(f"state restore is not bit-exact: {len(bad)} entries differ "
                           f"(first: {bad[:5]})")
    again = probe.evaluate()
    if not again.equal(before):
        diff = [k for k in before.columns if not torch.equal(before[k].nan_to_num(7.0),
                                                             again[k].nan_to_num(7.0))]
        raise RuntimeError(f"restored state re-evaluates differently in columns {diff}")
    return SeedMeasurement(count_seed(criteria, before, after, tol=tol, controls=controls,
                                      control_seed=control_seed), before, after)


def token_arrays(m: SeedMeasurement, criteria: list[Criterion]) -> dict[str, torch.Tensor]:
    """The per-token arrays the plots and `tokens.npz` need (active tokens of one seed).

    Keys: adv, ratio, topk_kl, topk_tv, local, global_<tail>, ddot_tv, out_of_region (1.0 where
    D_K > the KL criteria's delta), delta_d_ref (D_K change after the unmasked step, NaN when it
    was skipped), delta_d_momentum (after the zero-gradient control, when run), per criterion
    keep/<name>, away/<name>, delta_d/<name> (after its own step), delta_d_gradient/<name>
    (after its plain-SGD control, when run),
    and per predictive criterion disagree/<name> (1.0 where its direction test differs from its
    ratio baseline's).
    """
    b = m.before
    active = b["adv"] != 0
    out = {k: b[k][active] for k in b.columns if not k.startswith(("keep/", "away/"))}
    kl = [c for c in criteria if c.divergence == "topk_kl"]
    delta = kl[0].cfg.delta_high if kl else float("inf")
    out["out_of_region"] = (b["topk_kl"][active] > delta).double()
    ref = m.after.get(KEEP_ALL)
    out["delta_d_ref"] = ((ref["topk_kl"] - b["topk_kl"])[active] if ref is not None
                          else torch.full_like(b["adv"][active], float("nan")))
    if MOMENTUM_ONLY in m.after:
        out["delta_d_momentum"] = (m.after[MOMENTUM_ONLY]["topk_kl"] - b["topk_kl"])[active]
    for c in criteria:
        out[f"keep/{c.name}"] = b[f"keep/{c.name}"][active]
        out[f"away/{c.name}"] = b[f"away/{c.name}"][active]
        out[f"delta_d/{c.name}"] = (m.after[c.name][c.divergence] - b[c.divergence])[active]
        key = control_key(c.name, "gradient")
        if key in m.after:
            out[f"delta_d_gradient/{c.name}"] = (m.after[key][c.divergence]
                                                 - b[c.divergence])[active]
        if c.baseline is not None:
            out[f"disagree/{c.name}"] = ((b[f"away/{c.name}"] > 0)
                                         != (b[f"away/{c.baseline}"] > 0))[active].double()
    return out
