"""Per-token quantities of one evaluation of the policy on the study batch.

`token_table` turns the vocab-parallel `TokenStats` of a batch (computed by `token_stats`, at any
TP size) plus the batch's advantages and behaviour log-probs into a `TokenTable`: one float64 CPU
column per quantity, one row per loss token with a behaviour support, in the batch's row order.
Every direction decision is taken by the project's own `policy_loss` (its `.mask` and
`.away_score`), never re-implemented here, so the study counts exactly what training would do.

Columns (docs/math.md §3.2, §3.3, §3.6, §3.7):

    adv            A
    ratio          r = pi_k / mu_k (clamped log-ratio, as the loss uses it)
    topk_kl        D_K, the Top-K KL proximity (§2.3)
    topk_tv        D_TV,K
    local          pi_k - mu_k (mu_k from the support slot), the local term of Ddot_KL
                   (the sign of r - 1)
    global_<tail>  Ddot_KL - local = sum_S pi_i (mu_i - pi_i) + tau_<tail>, the "global" term
                   sum_j pi_j (mu_j - pi_j) with the tail estimated by <tail> in
                   {aggregated, uniform, exact} (§3.3)
    ddot_tv        Ddot_TV,K with the exact P2 (§3.6; ties excluded)
    keep/<name>    1.0 where criterion <name> keeps the token (its M), else 0.0
    away/<name>    the criterion's direction score (> 0: predicted to move away)
    state_h1/h2    (optional) a hash of the token's state, the prompt + response prefix it is
                   sampled from (`state_hashes`)

Shape legend: N rows of the flattened batch, n table rows (loss rows with support).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_pdm.loss.policy_loss import policy_loss
from megatron_pdm.ops.direction import TAIL_ESTIMATORS
from megatron_pdm.ops.stats import TokenStats

__all__ = ["TokenTable", "state_hashes", "token_table"]


@dataclass
class TokenTable:
    """float64 CPU columns of equal length n (see the module docstring)."""

    columns: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        sizes = {k: tuple(v.shape) for k, v in self.columns.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"TokenTable columns differ in shape: {sizes}")

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.columns:
            raise KeyError(f"TokenTable has no column {key!r}; columns: {sorted(self.columns)}")
        return self.columns[key]

    def __len__(self) -> int:
        return 0 if not self.columns else int(next(iter(self.columns.values())).shape[0])

    @staticmethod
    def cat(tables: list[TokenTable]) -> TokenTable:
        """Row-wise concatenation (same columns, in order)."""
        tables = [t for t in tables if t.columns]
        if not tables:
            return TokenTable({})
        keys = list(tables[0].columns)
        for t in tables[1:]:
            if list(t.columns) != keys:
                raise ValueError(f"cannot concatenate tables with columns {keys} and "
                                 f"{list(t.columns)}")
        return TokenTable({k: torch.cat([t.columns[k] for t in tables]) for k in keys})

    def equal(self, other: TokenTable) -> bool:
        """Bit-exact equality of every column (NaN == NaN)."""
        if list(self.columns) != list(other.columns):
            return False
        return all(torch.equal(self.columns[k].nan_to_num(7.0), other.columns[k].nan_to_num(7.0))
                   for k in self.columns)


def state_hashes(tokens_bs: torch.Tensor) -> torch.Tensor:
    """[b*s, 2] int64 hashes of every row's state (the prefix tokens[b, :p+1] that row p of a
    row-aligned batch conditions on), in the bs row order of `PackedBatch.flat()`.

    Two polynomial rolling hashes modulo the Mersenne prime 2^31 - 1 (each value < 2^31, so the
    pair is exact in float64 columns); two rows with equal pairs have the same prefix except
    for a ~1e-18 collision chance.
    """
    mod = (1 << 31) - 1
    x_bs = tokens_bs.to(torch.int64).cpu() + 1
    out = torch.empty(*x_bs.shape, 2, dtype=torch.int64)
    for i, base in enumerate((1_000_003, 999_983)):
        h_b = torch.zeros(x_bs.shape[0], dtype=torch.int64)
        for p in range(x_bs.shape[1]):
            h_b = (h_b * base + x_bs[:, p]) % mod  # < 2^31 * 2^20: no int64 overflow
            out[:, p, i] = h_b
    return out.reshape(-1, 2)


def token_table(stats: TokenStats, adv_N: torch.Tensor, behavior_logprob_N: torch.Tensor,
                loss_mask_N: torch.Tensor, criteria: list, *,
                seq_ids_N: torch.Tensor | None = None,
                states_N2: torch.Tensor | None = None) -> TokenTable:
    """The study's per-token columns of one batch evaluation.

    Args:
        stats: `token_stats` output for the N rows (any TP size; replicated after the op).
        adv_N, behavior_logprob_N, loss_mask_N: the batch's A, log mu_k and loss rows.
        criteria: `analysis.criteria.Criterion`s; each one's mask and direction score are taken
            from `policy_loss` with its config.
        seq_ids_N: sequence ids (needed only by the sequence aggregations of `policy_loss`).
        states_N2: optional `state_hashes` of the rows (columns state_h1, state_h2): tokens of
            different samples with the same prefix share one softmax, so one step moves their
            D together whatever their own advantages say.

    Returns:
        The TokenTable of the loss rows that have a behaviour support.
    """
    lm_N = loss_mask_N.to(torch.bool)
    rows_N = lm_N & stats.has_support

    def col(t: torch.Tensor) -> torch.Tensor:
        return t.detach()[rows_N].to(device="cpu", dtype=torch.float64)

    with torch.no_grad():
        local_N = stats.pi_k - stats.mu_k  # the local term of kl_rate (mu_k from the support)
        cols = {"adv": col(adv_N), "topk_kl": col(stats.topk_kl), "topk_tv": col(stats.topk_tv),
                "local": col(local_N)}
        for tail in TAIL_ESTIMATORS:
            cols[f"global_{tail}"] = col(stats.divergence_rate("kl", tail) - local_N)
        cols["ddot_tv"] = col(stats.divergence_rate("tv", "exact"))
        ratio = None
        for c in criteria:
            out = policy_loss(stats, adv_N, behavior_logprob_N, lm_N, c.cfg, seq_ids=seq_ids_N,
                              check_inputs=False)
            cols[f"keep/{c.name}"] = col(out.mask.to(torch.float64))
            cols[f"away/{c.name}"] = col(out.away_score)
            ratio = out.ratio if ratio is None else ratio
        if ratio is not None:
            cols["ratio"] = col(ratio)
        if states_N2 is not None:
            cols["state_h1"] = col(states_N2[:, 0].to(rows_N.device))
            cols["state_h2"] = col(states_N2[:, 1].to(rows_N.device))
    return TokenTable(cols)
