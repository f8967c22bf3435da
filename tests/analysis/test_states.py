"""State hashes and the shared-state split of the prediction scores (counting.shared_state)."""

from __future__ import annotations

import torch

from megatron_pdm.analysis.counting import shared_state
from megatron_pdm.analysis.token_table import TokenTable, state_hashes


def test_rows_with_the_same_prefix_get_the_same_hash():
    tokens_bs = torch.tensor([[5, 2, 3, 7], [5, 2, 4, 7], [5, 2, 3, 7], [6, 2, 3, 7]])
    h = state_hashes(tokens_bs).reshape(4, 4, 2)

    def same(a, b):
        return bool((h[a] == h[b]).all())

    assert same((0, 0), (1, 0)) and same((0, 1), (1, 1))  # prefixes [5], [5, 2]
    assert not same((0, 2), (1, 2)) and not same((0, 3), (1, 3))  # [.., 3] vs [.., 4]
    assert same((0, 3), (2, 3))  # identical samples
    assert not any(same((0, p), (3, p)) for p in range(4))  # different first token
    assert not same((0, 1), (0, 2))  # a longer prefix is another state
    assert int(h.max()) < 2 ** 31 and int(h.min()) >= 0  # exact in float64 columns


def test_shared_state_counts_only_active_tokens():
    # rows: 0 and 1 share a state; 2 shares it too but has A = 0 (no gradient); 3 is alone.
    table = TokenTable({"adv": torch.tensor([1.0, -0.5, 0.0, 1.0], dtype=torch.float64),
                        "state_h1": torch.tensor([7.0, 7.0, 7.0, 7.0], dtype=torch.float64),
                        "state_h2": torch.tensor([1.0, 1.0, 1.0, 2.0], dtype=torch.float64)})
    assert shared_state(table).tolist() == [True, True, False, False]
    table = TokenTable({"adv": torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),
                        "state_h1": torch.tensor([7.0, 7.0, 8.0], dtype=torch.float64),
                        "state_h2": torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)})
    assert shared_state(table).tolist() == [False, False, False]
    assert shared_state(TokenTable({"adv": torch.ones(2, dtype=torch.float64)})) is None
