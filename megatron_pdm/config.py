"""PolicyLossConfig: the trust-region family as three independent axes plus aggregation.

GRPO clip-higher, DPPO (4 variants), PDM (3 tail estimators + a TV version) and DRPO differ only
in (docs/math.md §2-§4):

    proximity   which divergence D is compared with delta(sign A)
    direction   how "moving away" is decided: sign(A (r - 1)) or sign(A * Ddot) (predictive)
    shaping     a hard mask (coefficient A * min(r, C) * M) or DRPO's smooth weight (A * r * w)

so one dataclass describes all of them and `policy_loss` has no per-method branches. Presets
reproduce the papers' defaults; each preset's docstring entry in PRESETS names its source.

Config is plain data parsed by `megatron_pdm.configtree` (the same parser as the run config):
values are converted by field type (`ratio_cap: inf`, `noise_floor: 1e-3`), unknown keys are an
error listing the valid ones, `to_dict` gives the resolved values (with the preset name first) and
`with_overrides` applies dotted CLI overrides.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_pdm.configfile import read_yaml
from megatron_pdm.configtree import (
    ConfigError,
    apply_override,
    check_fields,
    from_mapping,
    to_plain,
)

__all__ = ["PolicyLossConfig", "PRESETS", "Proximity", "Direction", "Tail", "Shaping",
           "Aggregation", "IsLevel", "IsMask", "SeqRatio"]

Proximity = Literal["ratio", "binary_tv", "binary_kl", "topk_tv", "topk_kl", "none"]
Direction = Literal["ratio", "predictive"]
Tail = Literal["aggregated", "uniform", "exact"]
Shaping = Literal["mask", "drpo"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
IsLevel = Literal["token", "sequence"]
IsMask = Literal["none", "token", "sequence"]
SeqRatio = Literal["geometric", "product"]


@dataclass(kw_only=True)
class PolicyLossConfig:
    """One member of the trust-region family. See the module docstring and PRESETS."""

    _config_aliases = ("preset",)

    name: str | None = None
    """The preset this config started from (informational; None when built field by field).
    In yaml and overrides it is spelt `preset:`, which also loads the preset's values."""

    proximity: Proximity = "topk_kl"
    """Divergence D for the proximity test: "ratio" (|r - 1|, PPO/GRPO clip with delta_low/high
    as eps_low/high), "binary_tv" |pi_k - mu_k|, "binary_kl", "topk_tv", "topk_kl" (§2.3), or
    "none" (D = 0: never out of region)."""

    direction: Direction = "predictive"
    """"ratio": moving away iff A (r - 1) > 0 (PPO/DPPO); "predictive": iff A * Ddot > 0 with
    Ddot the first-order change of D along the token's step (PDM, §3.2; TV ties per §3.6)."""

    tail: Tail = "aggregated"
    """Tail estimator of the predictive direction: "aggregated" | "uniform" (PDM paper) |
    "exact" (exact derivative of D_K / exact P2 for TV, §7.1, §3.6). Also used for the
    direction-disagreement metric when direction == "ratio"."""

    shaping: Shaping = "mask"
    """"mask": coeff = A * min(r, C) * M; "drpo": coeff = A * min(r, C) * w with
    w = 1 - s * D / delta(sign A), s = +1 moving away / -1 moving back (§4.2)."""

    delta_low: float = 0.15
    """Threshold for tokens with A < 0 (eps_low for proximity "ratio")."""

    delta_high: float = 0.15
    """Threshold for tokens with A > 0 (eps_high for proximity "ratio")."""

    ratio_cap: float = math.inf
    """C in min(w, C): the truncated importance weight (TIS) at level `is_level`, w = r (token)
    or the sequence ratio rho (sequence); inf disables the truncation (§2.2, §10.2)."""

    is_level: IsLevel = "token"
    """Importance weight multiplying A: "token" (r_t, every method's default) or "sequence"
    (rho_s of the token's sequence, `seq_ratio`; needs seq_ids). Detached either way (§10.2)."""

    seq_ratio: SeqRatio = "geometric"
    """How rho_s is formed from the loss rows' log r of one sequence: "geometric" (exp of the
    mean, length-normalised) or "product" (exp of the sum, the exact sequence ratio); clamped to
    +-log_ratio_clamp before exp (§10.1). Used by is_level / is_mask "sequence"."""

    is_mask: IsMask = "none"
    """Masked IS (MIS, §10.3): drop loss tokens whose r ("token") or whose sequence's rho
    ("sequence") lies outside [is_mask_low, is_mask_high]; "none" disables it."""

    is_mask_low: float | None = None
    """Lower MIS bound (inclusive, > 0); None with is_mask on: 1 / is_mask_high."""

    is_mask_high: float | None = None
    """Upper MIS bound (inclusive); required with is_mask on, > is_mask_low."""

    seq_mask_kl: float | None = None
    """Off-policy sequence mask (OPSM, §10.4): drop every loss token with A < 0 of a sequence
    whose mean log(mu / pi) over its loss rows exceeds this delta (>= 0); None disables it."""

    log_ratio_clamp: float = 20.0
    """log r = log pi_k - log mu_k is clamped to [-x, x] before exp (both reference codes)."""

    noise_floor: float | None = None
    """Optional §7.5 fallback (predictive KL only): c_rel of the rollout logprob error. Tokens
    whose |Ddot - local| is below (interval width + c_rel * sum_S mu_i pi_i) use the ratio
    direction instead. None (default) disables it; ~1e-3 suits bf16 engines."""

    aggregation: Aggregation = "token-mean"
    """"token-mean": (sum loss, #loss tokens); "seq-mean-token-sum": (sum loss, #sequences);
    "seq-mean-token-sum-norm": (sum loss / loss_horizon, #sequences)."""

    loss_horizon: int | None = None
    """Constant divisor for "seq-mean-token-sum-norm" (e.g. the max response length)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.direction == "predictive" and self.proximity in ("ratio", "none"):
            raise ConfigError(
                f"direction='predictive' needs a divergence proximity, got {self.proximity!r}"
            )
        if self.shaping == "drpo" and self.proximity == "none":
            raise ConfigError("shaping='drpo' needs a proximity divergence (DRPO: 'binary_tv')")
        for name in ("delta_low", "delta_high", "ratio_cap", "log_ratio_clamp"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        if self.noise_floor is not None:
            if self.noise_floor < 0:
                raise ConfigError(f"noise_floor must be >= 0, got {self.noise_floor}")
            if self.direction != "predictive" or self.divergence_kind != "kl":
                raise ConfigError("noise_floor applies to the predictive KL direction only")
        if self.aggregation == "seq-mean-token-sum-norm":
            if self.loss_horizon is None or self.loss_horizon <= 0:
                raise ConfigError("seq-mean-token-sum-norm needs loss_horizon > 0")
        self._check_off_policy()

    def _check_off_policy(self) -> None:
        """MIS bounds and the OPSM delta (§10); resolves is_mask_low = 1 / is_mask_high."""
        if self.is_mask == "none":
            for name in ("is_mask_low", "is_mask_high"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}={getattr(self, name)!r} is set but "
                                      "is_mask='none'; set is_mask to 'token' or 'sequence'")
        else:
            if self.is_mask_high is None:
                raise ConfigError(f"is_mask={self.is_mask!r} needs is_mask_high (the upper "
                                  "bound of the kept ratios)")
            if not self.is_mask_high > 0:
                raise ConfigError(f"is_mask_high must be > 0, got {self.is_mask_high!r}")
            if self.is_mask_low is None:
                self.is_mask_low = 1.0 / self.is_mask_high
            if not 0 < self.is_mask_low < self.is_mask_high:
                raise ConfigError(f"is_mask_low must be in (0, is_mask_high={self.is_mask_high})"
                                  f", got {self.is_mask_low!r}")
        if self.seq_mask_kl is not None and not self.seq_mask_kl >= 0:
            raise ConfigError(f"seq_mask_kl must be >= 0 (or null), got {self.seq_mask_kl!r}")

    @property
    def off_policy(self) -> bool:
        """A §10 correction beyond the token ratio is on (sequence IS, MIS or OPSM)."""
        return (self.is_level != "token" or self.is_mask != "none"
                or self.seq_mask_kl is not None)

    @property
    def uses_sequences(self) -> bool:
        """The loss needs seq_ids: a sequence aggregation or a sequence-level correction."""
        return (self.aggregation != "token-mean" or self.is_level == "sequence"
                or self.is_mask == "sequence" or self.seq_mask_kl is not None)

    @property
    def divergence_kind(self) -> str:
        """"tv" for TV proximities, else "kl" (the kind of Ddot used by the direction)."""
        return "tv" if self.proximity in ("binary_tv", "topk_tv") else "kl"

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PolicyLossConfig:
        """A preset by name (see PRESETS), with optional keyword overrides."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return cls(**{"name": name, **PRESETS[name], **overrides})

    @classmethod
    def _from_mapping(cls, data: dict[str, Any], path: str) -> dict[str, Any]:
        """configtree hook: `preset: NAME` loads the preset's values under the given keys."""
        name = data.pop("preset", None)
        if name is None:
            return data
        if name not in PRESETS:
            where = f"{path}.preset" if path else "preset"
            raise ConfigError(f"{where}={name!r}: unknown preset; available: {sorted(PRESETS)}")
        return {"name": name, **PRESETS[name], **data}

    def _to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"preset": self.name}
        out.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                   if f.name != "name")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "loss") -> PolicyLossConfig:
        """From a flat mapping; an optional "preset" key gives the base values. Values are
        converted by field type ("inf", "1e-3"); unknown keys raise with the valid ones listed."""
        return from_mapping(cls, data, path)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PolicyLossConfig:
        """Reads a yaml mapping of these fields (optionally `preset: name`). Unknown keys raise."""
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at top level")
        return cls.from_dict(data, path="")

    def to_dict(self) -> dict[str, Any]:
        """Resolved values, `preset` first (yaml writes inf as .inf, which loads back)."""
        return to_plain(self)

    def with_overrides(self, overrides: dict[str, Any] | list[str]) -> PolicyLossConfig:
        """A copy with overrides applied.

        Args:
            overrides: {"delta_high": 0.2} or CLI strings ["delta_high=0.2"]; keys may carry a
                "loss." (or "policy_loss.") prefix. String values are parsed as yaml scalars and
                converted by field type. `preset` may not be overridden here (it would discard
                the other fields); build a new config with `preset()` instead.
        """
        data = self.to_dict()
        data["name"] = data.pop("preset")
        if isinstance(overrides, dict):
            items = [(str(k), v) for k, v in overrides.items()]
        else:
            items = []
            for item in overrides:
                tree: dict = {}
                apply_override(tree, item)
                ((key, value),) = _flatten(tree)
                items.append((key, value))
        for key, value in items:
            for prefix in ("loss.", "policy_loss."):
                if key.startswith(prefix):
                    key = key[len(prefix):]
            if key == "preset":
                raise ConfigError("with_overrides cannot change the preset; use "
                                  "PolicyLossConfig.preset(name, **overrides)")
            data[key] = value
        return from_mapping(PolicyLossConfig, data, "loss")


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((prefix + k, v))
    return out


PRESETS: dict[str, dict[str, Any]] = {
    # No trust region: importance-weighted policy gradient A * r * grad log pi_k, no clip, no
    # mask, no ratio cap (the baseline of the stability benchmark, docs/stability.md).
    "is-pg": dict(proximity="none", direction="ratio", ratio_cap=math.inf),
    # Truncated IS policy gradient, no trust region: A * min(r, 2) * grad log pi_k; C = 2 as in
    # the TIS write-up and verl's rollout-correction default (§10.2).
    "tis": dict(proximity="none", direction="ratio", ratio_cap=2.0),
    # Token-level masked IS, no trust region: tokens with r outside [0.5, 5] dropped (IcePop
    # bounds; verl 0.9.1 RolloutCorrectionConfig.bypass_pg_token_icepop, §10.3).
    "icepop": dict(proximity="none", direction="ratio", is_mask="token", is_mask_low=0.5,
                   is_mask_high=5.0),
    # Sequence-level masked IS on the geometric-mean ratio, no trust region: sequences with rho
    # outside [0.999, 1.001] dropped (verl 0.9.1 RolloutCorrectionConfig.bypass_pg_geo_rs,
    # §10.1, §10.3).
    "geo-rs": dict(proximity="none", direction="ratio", is_mask="sequence",
                   seq_ratio="geometric", is_mask_low=0.999, is_mask_high=1.001),
    # GRPO clip-higher: eps_low 0.2 / eps_high 0.28 [P-DPPO App. C.1; C-verl]; C = inf in the
    # sanity study [P-DPPO App. C.1]. Proximity |r-1| + ratio direction is exactly PPO's clip.
    "grpo": dict(proximity="ratio", direction="ratio", delta_low=0.2, delta_high=0.28),
    # DPPO Binary-TV delta 0.15 [P-DPPO App. C.1; C-verl dppo_tv] (0.2 in scaling runs).
    "dppo-binary-tv": dict(proximity="binary_tv", direction="ratio", delta_low=0.15,
                           delta_high=0.15),
    # DPPO Binary-KL delta 0.05 [P-DPPO App. C.1, E; C-verl dppo_kl].
    "dppo-binary-kl": dict(proximity="binary_kl", direction="ratio", delta_low=0.05,
                           delta_high=0.05),
    # DPPO TopK-TV delta 0.2, K = 20 [P-DPPO App. F.3].
    "dppo-topk-tv": dict(proximity="topk_tv", direction="ratio", delta_low=0.2, delta_high=0.2),
    # DPPO TopK-KL delta 0.05, K = 20 [P-DPPO App. F.3].
    "dppo-topk-kl": dict(proximity="topk_kl", direction="ratio", delta_low=0.05,
                         delta_high=0.05),
    # PDM TopK-KL, delta 0.15, aggregated tail, ratio cap 5 [P-PDM notes; C-slime-fork, §3.8].
    "pdm-agg": dict(proximity="topk_kl", direction="predictive", tail="aggregated",
                    delta_low=0.15, delta_high=0.15, ratio_cap=5.0),
    # PDM uniform-tail estimator, otherwise as pdm-agg [P-PDM, §3.3].
    "pdm-uniform": dict(proximity="topk_kl", direction="predictive", tail="uniform",
                        delta_low=0.15, delta_high=0.15, ratio_cap=5.0),
    # Exact derivative of D_K (§7.1, [D]), otherwise as pdm-agg.
    "pdm-exact": dict(proximity="topk_kl", direction="predictive", tail="exact",
                      delta_low=0.15, delta_high=0.15, ratio_cap=5.0),
    # PDM-TopK-TV with exact P2 (§3.6, §7.6.1, [D]); delta 0.2 as DPPO TopK-TV [P-DPPO App. F.3].
    "pdm-tv": dict(proximity="topk_tv", direction="predictive", tail="exact", delta_low=0.2,
                   delta_high=0.2, ratio_cap=5.0),
    # DRPO: Binary-TV geometry, weight w, delta 12.5, no ratio cap [P-DRPO §4 via C-UniRL, §4.3].
    "drpo": dict(proximity="binary_tv", direction="ratio", shaping="drpo", delta_low=12.5,
                 delta_high=12.5),
}
