"""The direction criteria the mask study compares (docs/math.md §3.4, §3.7).

Every criterion is a `PolicyLossConfig` that differs from the others ONLY in its direction test:
the proximity divergence (Top-K KL, or Top-K TV for the optional TV pair), the threshold delta,
the ratio cap C, the log-ratio clamp and the aggregation are the same for all of them, taken from
the run's own loss config with delta set by the study. So the kept sets differ exactly on the
out-of-region tokens where the directions disagree.

    name          proximity  direction                         paper / preset
    ratio         topk_kl    sign(A (r - 1))                   DPPO-TopK-KL (dppo-topk-kl)
    pdm-agg       topk_kl    sign(A Ddot), aggregated tail     PDM (pdm-agg)
    pdm-uniform   topk_kl    sign(A Ddot), uniform tail        PDM (pdm-uniform)
    pdm-exact     topk_kl    sign(A Ddot), exact D_K tail      ours, §7.1 (pdm-exact)
    ratio-tv      topk_tv    sign(A (r - 1))                   DPPO-TopK-TV (dppo-topk-tv)
    pdm-tv        topk_tv    one-sided sign of Ddot_TV, exact  ours, §3.6 (pdm-tv)

`keep_all_config` is the reference step with no mask at all (proximity "none"): the realised
change of every token when its own update is applied, against which the first-order predictions
of all directions are scored on the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pdm.config import PolicyLossConfig
from megatron_pdm.configtree import ConfigError

__all__ = [
    "CRITERIA",
    "DEFAULT_CRITERIA",
    "CONTROLS",
    "KEEP_ALL",
    "MOMENTUM_ONLY",
    "Criterion",
    "control_key",
    "build_criteria",
    "keep_all_config",
]

KEEP_ALL = "keep-all"
"""Name of the unmasked reference step."""

MOMENTUM_ONLY = "momentum-only"
"""Name of the zero-gradient control step: the optimizer's step from the same state with every
gradient zero (Adam: the displacement of its momentum alone; criterion-independent)."""

CONTROLS = ("momentum", "gradient")
"""The decomposition controls beside every criterion's full step: "momentum" (the zero-gradient
step, `MOMENTUM_ONLY`) and "gradient" (plain SGD on the criterion's own masked loss, no optimizer
state: `control_key(name, "gradient")`)."""


def control_key(name: str, control: str) -> str:
    """The after-step table key of criterion `name` under `control` ("full", "momentum",
    "gradient")."""
    if control == "full":
        return name
    if control == "momentum":
        return MOMENTUM_ONLY
    if control == "gradient":
        return f"{name}@own-gradient"
    raise ValueError(f"control {control!r}: one of 'full', 'momentum', 'gradient'")

# name -> (proximity, direction, tail)
CRITERIA: dict[str, tuple[str, str, str]] = {
    "ratio": ("topk_kl", "ratio", "exact"),
    "pdm-agg": ("topk_kl", "predictive", "aggregated"),
    "pdm-uniform": ("topk_kl", "predictive", "uniform"),
    "pdm-exact": ("topk_kl", "predictive", "exact"),
    "ratio-tv": ("topk_tv", "ratio", "exact"),
    "pdm-tv": ("topk_tv", "predictive", "exact"),
}
DEFAULT_CRITERIA = ("ratio", "pdm-agg", "pdm-uniform", "pdm-exact")


@dataclass(frozen=True)
class Criterion:
    """One direction criterion.

    Attributes:
        name: key of CRITERIA.
        cfg: its loss config (mask shaping; proximity/delta/C shared with the other criteria).
        baseline: the ratio-direction criterion with the same proximity ("ratio" or "ratio-tv"),
            against which its disagreement set is defined; None for the ratio criteria.
    """

    name: str
    cfg: PolicyLossConfig
    baseline: str | None

    @property
    def predictive(self) -> bool:
        return self.cfg.direction == "predictive"

    @property
    def divergence(self) -> str:
        """The token-table column of its proximity divergence: "topk_kl" or "topk_tv"."""
        return self.cfg.proximity


def _shared_fields(base: PolicyLossConfig) -> dict:
    """What every criterion inherits from the run's loss config."""
    return {"ratio_cap": base.ratio_cap, "log_ratio_clamp": base.log_ratio_clamp,
            "aggregation": base.aggregation, "loss_horizon": base.loss_horizon}


def build_criteria(names: list[str] | tuple[str, ...], base: PolicyLossConfig, *,
                   delta_kl: float, delta_tv: float) -> list[Criterion]:
    """The criteria `names`, all sharing `base`'s cap/clamp/aggregation and the given deltas.

    Raises:
        ConfigError: an unknown name, a duplicate, a predictive criterion without its ratio
            baseline in the list, or a non-positive delta.
    """
    for label, value in (("delta_kl", delta_kl), ("delta_tv", delta_tv)):
        if not value > 0:
            raise ConfigError(f"--{label.replace('_', '-')}={value} must be > 0")
    unknown = [n for n in names if n not in CRITERIA]
    if unknown:
        raise ConfigError(f"--criteria: unknown {unknown}; available: {list(CRITERIA)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--criteria: duplicates in {list(names)}")
    out = []
    for name in names:
        proximity, direction, tail = CRITERIA[name]
        delta = delta_kl if proximity == "topk_kl" else delta_tv
        cfg = PolicyLossConfig(name=f"analysis:{name}", proximity=proximity, direction=direction,
                               tail=tail, shaping="mask", delta_low=delta, delta_high=delta,
                               **_shared_fields(base))
        baseline = None
        if direction == "predictive":
            baseline = "ratio" if proximity == "topk_kl" else "ratio-tv"
            if baseline not in names:
                raise ConfigError(f"--criteria: {name} needs its ratio baseline {baseline!r} "
                                  "in the list (the paired comparison is against it)")
        out.append(Criterion(name, cfg, baseline))
    return out


def keep_all_config(base: PolicyLossConfig) -> PolicyLossConfig:
    """The unmasked reference step: coeff = A min(r, C) for every token."""
    return PolicyLossConfig(name=f"analysis:{KEEP_ALL}", proximity="none", direction="ratio",
                            shaping="mask", **_shared_fields(base))
