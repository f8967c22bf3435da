"""PDM in your own training loop: a tiny vocab-parallel LM, rollouts with top-K, one RL step.

Run:  python examples/own_loop/forward_step.py            (one process, TP 1)
      torchrun --nproc-per-node 2 examples/own_loop/forward_step.py   (TP 2, gloo on CPU)

Needs only torch, numpy, pyyaml and megatron-pdm (no megatron-core). The "engine" is the same
model sampling at `TEMPERATURE` and reporting the top-K logprobs of the tempered distribution,
as SGLang / vLLM do; replace `generate` with your engine's call. docs/own-loop.md walks through
`train_step`; tests/base/test_own_loop.py runs this file at TP 1 and TP 2.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_pdm as pdm

VOCAB, PADDED, HIDDEN, TOP_K, TEMPERATURE = 47, 48, 16, 4, 0.8


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over TP (the replicated hidden
    states feed every rank's vocab shard: megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # SUM of d loss / d hidden over the vocab shards
        return grad, None


class TinyLM(torch.nn.Module):
    """Embedding -> tanh -> a vocab-parallel LM head: this rank owns rows [r Vl, (r+1) Vl)."""

    def __init__(self, seed: int, tp_group=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tp_group = tp_group
        rank, world = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group \
            else (0, 1)
        self.embed = torch.nn.Parameter(torch.randn(PADDED, HIDDEN, generator=g))
        full_head = torch.randn(PADDED, HIDDEN, generator=g)
        vl = PADDED // world
        self.head = torch.nn.Parameter(full_head[rank * vl:(rank + 1) * vl].clone())

    def forward(self, tokens_bt: torch.Tensor) -> torch.Tensor:
        hidden_bth = torch.tanh(self.embed[tokens_bt])
        if self.tp_group is not None:
            hidden_bth = _CopyToTP.apply(hidden_bth, self.tp_group)
        return hidden_bth @ self.head.T                         # [B, T, V_local]

    def full_head(self) -> torch.Tensor:
        if self.tp_group is None:
            return self.head.detach()
        parts = [torch.empty_like(self.head) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(parts, self.head.detach(), group=self.tp_group)  # the engine's weights
        return torch.cat(parts)


@torch.no_grad()
def generate(model: TinyLM, prompts: list[list[int]], new_tokens: int, seed: int) -> dict:
    """The stand-in engine: samples at TEMPERATURE, returns sampled and top-K logprobs."""
    g = torch.Generator().manual_seed(seed)
    head = model.full_head()[:VOCAB]                             # the engine's real vocabulary
    out = {"tokens": [], "top_ids": [], "top_lp": [], "sampled": [], "sampled_lp": []}
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            z = torch.tanh(model.embed[seq[-1]]) @ head.T
            logp = torch.log_softmax(z / TEMPERATURE, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            top = logp.topk(TOP_K)
            out["top_ids"].append(top.indices)
            out["top_lp"].append(top.values)
            out["sampled"].append(tok)
            out["sampled_lp"].append(float(logp[tok]))
            seq.append(tok)
        out["tokens"].append(seq)
    return out


def advantages_of(tokens: list[list[int]], prompt_len: int, group: int) -> list[float]:
    """Reward = fraction of even response tokens; GRPO: reward minus its group's mean."""
    rewards = [sum(t % 2 == 0 for t in s[prompt_len:]) / (len(s) - prompt_len) for s in tokens]
    out = []
    for i in range(0, len(rewards), group):
        chunk = rewards[i:i + group]
        mean = sum(chunk) / len(chunk)
        out += [r - mean for r in chunk]
    return out


def train_step(model, opt, cfg, tp_group, step: int, *, check: bool = False) -> dict:
    """One RL step with PDM: rollouts -> rows -> loss -> normalised backward -> optimizer."""
    prompt_len, new_tokens, group = 3, 5, 4
    g = torch.Generator().manual_seed(100 + step)
    prompts = [torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist()] * group * 2
    ro = generate(model, prompts, new_tokens, seed=step)
    tokens_bt = torch.tensor(ro["tokens"])
    b, t = tokens_bt.shape
    adv_b = advantages_of(ro["tokens"], prompt_len, group)
    # 1. the support: engine top-K with the sampled token folded in (torch, no host copy)
    sampled_R = torch.tensor(ro["sampled"])
    sampled_lp_R = torch.tensor(ro["sampled_lp"])
    top_ids_RK = torch.stack(ro["top_ids"])
    ids_RS, lp_RS, valid_RS, _ = pdm.fold_support_torch(
        top_ids_RK, torch.stack(ro["top_lp"]), torch.ones_like(top_ids_RK, dtype=torch.bool),
        sampled_R, sampled_lp_R)
    # 2. the rows that score each response token (row p scores token p+1)
    rows = pdm.response_rows([prompt_len] * b, [new_tokens] * b, seq_len=t)
    logits_btv = model(tokens_bt)
    placed = pdm.place_on_rows(
        logits_btv, rows, sampled_ids=sampled_R, support_ids=ids_RS, support_logprobs=lp_RS,
        support_valid=valid_RS, behavior_logprob=sampled_lp_R,
        advantages=torch.tensor(adv_b).repeat_interleave(new_tokens))
    # 3. the loss (fast path: the logits are consumed here), normalised to a token mean
    out = pdm.loss_on_rows(placed, cfg, tp_group=tp_group, vocab_size=VOCAB,
                           temperature=TEMPERATURE, check_alignment=check)
    loss = pdm.normalize_loss(out.loss_sum, placed.loss_mask, "token-mean")
    opt.zero_grad()
    loss.backward()
    opt.step()
    metrics = pdm.reduce_metrics([out.metrics])
    return {"loss": float(loss.detach()), "reward": sum(adv_b), **metrics}


def run(steps: int = 3, tp_group=None, seed: int = 0, preset: str = "pdm-agg") -> list[dict]:
    torch.manual_seed(seed)
    model = TinyLM(seed, tp_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = pdm.PolicyLossConfig.preset(preset)
    # step 0 is on-policy (engine = trainer weights): check the logprob alignment there
    return [train_step(model, opt, cfg, tp_group, s, check=(s == 0)) for s in range(steps)]


def main() -> None:
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    for i, row in enumerate(run(tp_group=group)):
        if group is None or dist.get_rank() == 0:
            print(f"step {i}: loss {row['loss']:+.6f} masked {row['pdm/masked_frac']:.3f} "
                  f"ratio {row['pdm/ratio_mean']:.4f}")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
