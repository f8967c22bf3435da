"""The rollout tests' tiny causal LM (`TinyLM`), its vocabulary and prompts: shared by the
fake-engine tests, the fake SGLang server's `--tiny-lm` mode and the sglang box."""

from __future__ import annotations

import os

import torch

VOCAB = 50          # real vocabulary
VOCAB_PADDED = 64   # model output width (Megatron-style padding, must be masked)
ASSETS = os.path.join(os.path.dirname(__file__), "..", "assets")


class TinyLM(torch.nn.Module):
    """Causal toy LM: logits at q depend on tokens <= q only (embedding + causal mean)."""

    def __init__(self, vocab: int = VOCAB_PADDED, dim: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(2 * dim, dim)
        self.out = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)
            self.out.bias[VOCAB:] = 5.0  # padding logits are large: masking must matter

    def forward(self, ids_bl: torch.Tensor) -> torch.Tensor:
        e_bld = self.emb(ids_bl)
        steps = torch.arange(1, ids_bl.shape[1] + 1, dtype=e_bld.dtype)[None, :, None]
        mean_bld = e_bld.cumsum(1) / steps
        h_bld = torch.tanh(self.mix(torch.cat([e_bld, mean_bld], -1)))
        return self.out(h_bld) * 1.5


def prompts(num: int, length: int = 4) -> list[list[int]]:
    return [[(7 * i + j) % (VOCAB - 5) + 5 for j in range(length + i % 3)] for i in range(num)]
