"""Synthetic controls of the mask study: criteria with a KNOWN effect on the same tokens.

A control takes a base criterion's per-token decisions on the study tokens and the D change of
the base criterion's own step, and changes the decisions in a stated way:

    oracle-<base>  positive control. Each WRONG decision of the base criterion on an
                   out-of-region active token (kept although D grew after the step, masked
                   although D shrank) is set right with probability `flip` (independently per
                   token; a generator seeded by the study seed and the control's name, so a
                   rerun flips the same tokens). flip = 0 is the base criterion, flip = 1 the
                   oracle that keeps exactly the shrinking tokens (unsafe-keep rate 0 wherever
                   it keeps a token). Its unsafe-keep rate is lower than the base's on every
                   seed where any decision was flipped and the rate can move.
    copy-<base>    negative control: the base criterion's decisions unchanged (an identical
                   criterion); every paired difference is exactly 0.

Both are counted with the base criterion's after-step tables (and its control steps'): the
control's mask is NOT re-stepped, so they test the counting, the seed count and the inference
(does the comparison detect an effect of known size; does it stay silent without one), not the
gradient a different mask would produce. The study compares each control against its base in
the same Holm family as the criteria (inference.py) and reports whether the positive control was
detected and the negative one was not (`check`).

Shape legend: n rows of a seed's token table.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Control", "build_controls", "check", "control_keep"]


@dataclass(frozen=True)
class Control:
    """One synthetic control (module docstring).

    Attributes:
        name: "oracle-<base>" or "copy-<base>".
        base: the criterion whose decisions and step it reuses.
        kind: "oracle" (positive control) or "copy" (negative control).
        flip: the probability a wrong decision is set right (oracle; 0 for copy).
    """

    name: str
    base: str
    kind: Literal["oracle", "copy"]
    flip: float = 0.0

    @property
    def expected(self) -> str:
        """What the comparison against the base must say: "lower" (the oracle, whatever its
        flip: at flip 0 it is no positive control and its check fails) or "not detected"."""
        return "lower" if self.kind == "oracle" else "not detected"


def build_controls(base: str, names: list[str], *, flip: float) -> list[Control]:
    """The positive and the negative control of criterion `base`.

    Raises:
        ValueError: `base` not among the study's criteria `names`, or flip outside [0, 1].
    """
    if base not in names:
        raise ValueError(f"--controls {base}: not among the study's criteria {names}")
    if not 0.0 <= flip <= 1.0:
        raise ValueError(f"--control-flip {flip}: must be in [0, 1]")
    return [Control(f"oracle-{base}", base, "oracle", flip), Control(f"copy-{base}", base, "copy")]


def _uniform(n: int, seed: int, name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode()))
                                      % (2 ** 63))
    return torch.rand(n, generator=g, dtype=torch.float64)


def control_keep(ctrl: Control, kept_n: torch.Tensor, oor_n: torch.Tensor,
                 delta_d_n: torch.Tensor, *, tol: float, seed: int) -> torch.Tensor:
    """[n] bool: the control's keep decisions from its base's `kept_n`, the out-of-region
    active tokens `oor_n` and the D change of the base's step `delta_d_n`."""
    if ctrl.kind == "copy":
        return kept_n.clone()
    wrong_n = oor_n & ((kept_n & (delta_d_n > tol)) | (~kept_n & (delta_d_n < -tol)))
    flip_n = wrong_n & (_uniform(len(kept_n), seed, ctrl.name) < ctrl.flip)
    return kept_n ^ flip_n


def check(summary: dict, controls: list[Control]) -> dict | None:
    """Did the comparison detect the positive control and stay silent on the negative one?

    Returns: {name: {"expected", "verdict", "p_holm", "ok"}, ..., "ok": all of them} or None
    without controls.
    """
    if not controls:
        return None
    rows = {(r["criterion"], r["baseline"]): r for r in summary["paired"]}
    out: dict = {}
    for c in controls:
        r = rows[(c.name, c.base)]
        ok = (r["verdict"] == "lower") if c.expected == "lower" else (
            r["verdict"] not in ("lower", "higher"))
        out[c.name] = {"kind": c.kind, "flip": c.flip, "expected": c.expected,
                       "verdict": r["verdict"], "p_holm": r["p_holm"],
                       "mean_difference": r["mean_difference"],
                       "n_seeds_entered": r["n_seeds_entered"], "ok": ok}
    out["ok"] = all(v["ok"] for v in out.values())
    return out
