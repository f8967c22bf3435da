"""Real logits of the real model (SmolLM2-135M-Instruct), cached: what the op sees in RL.

One reproducible recipe (docs/real-model.md, "The op on real distributions"):

1. prompts through the model's chat template: arithmetic questions ("What is 7 plus 5? Answer
   with a number.", numbers and operation drawn from the seed) and a few general prompts;
2. `samples` continuations per prompt sampled from the fp32 model at temperature 1, no top-k /
   top-p truncation, seeded (own sampling loop with a KV cache: the draws do not depend on the
   generate() defaults of a transformers version), up to `max_new_tokens`, stopping at EOS;
3. the response positions' logits [N, V] (the first `tokens` response tokens in prompt order),
   teacher-forced, of three models:
     base   the fp32 model that sampled the tokens,
     bf16   the same weights cast to bf16 (an engine's precision; logits upcast to fp32),
     step   the fp32 model after ONE Adam step (lr `step_lr`, betas 0.9/0.999, no weight decay)
            on the GRPO loss of these samples: reward 1 when the response's last integer is
            the arithmetic answer, advantage = reward - mean reward of the prompt's samples
            (general prompts: advantage 0), loss = -sum(A * log pi) / #response tokens.

The RL pairs (pi = trainer's policy, mu = behaviour that produced the rollout) are `PAIRS`:
  "bf16"  pi = base, mu = bf16   (engine precision mismatch; tokens drawn from the fp32 model)
  "step"  pi = step, mu = base   (policy drift: one optimizer step after the rollout, measured on
                                  the tokens the step trained on)

The cache (`.cache/real-logits/<key>.pt`, key = SHA-256 of the recipe and the model's
prepared.json) holds base and step logits in fp32 and bf16 logits in bf16 (exact: the model's own
output dtype); about 1 GB at N = 2048. Nothing touches the network.

Shape legend: N response tokens, V vocabulary (49,152), L sequence length.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["DEFAULT_MODEL_DIR", "PAIRS", "RealLogits", "RealLogitsConfig", "engine_support",
           "load_or_build",
           "model_available", "prompts", "reward"]

DEFAULT_MODEL_DIR = Path(".cache/real-model/smollm2-135m-instruct")
DEFAULT_CACHE_DIR = Path(".cache/real-logits")
PAIRS = {"bf16": ("base", "bf16"), "step": ("step", "base")}
"""pair name -> (pi model, mu model)."""

GENERAL_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a prime number is.",
    "Name three colours of the rainbow.",
    "Give one tip for learning to program.",
    "Why is the sky blue? Answer briefly.",
)
_OPS = (("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b),
        ("times", lambda a, b: a * b))


@dataclass(frozen=True)
class RealLogitsConfig:
    """The recipe; every field enters the cache key."""

    model_dir: str = str(DEFAULT_MODEL_DIR)
    tokens: int = 2048
    arithmetic_prompts: int = 12
    general_prompts: int = 4
    samples: int = 8
    max_new_tokens: int = 48
    seed: int = 0
    step_lr: float = 1e-5
    threads: int = 1

    def key(self, manifest: str) -> str:
        blob = json.dumps({**asdict(self), "threads": None, "manifest": manifest},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class RealLogits:
    """Response-position logits of the three models on the same N sampled tokens.

    Attributes:
        logits: {"base": [N, V] fp32, "bf16": [N, V] bf16, "step": [N, V] fp32}.
        sampled_ids: [N] int64 token at each position; seq_ids: [N] its sample's index.
        arithmetic: [N] bool, position of an arithmetic prompt's response.
        meta: the recipe, texts of the first samples, rewards, the step's size, timings.
    """

    logits: dict[str, torch.Tensor]
    sampled_ids: torch.Tensor
    seq_ids: torch.Tensor
    arithmetic: torch.Tensor
    meta: dict = field(default_factory=dict)

    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(pi logits [N, V] fp32, mu logits [N, V] fp32) of the RL pair `name` (PAIRS)."""
        if name not in PAIRS:
            raise ValueError(f"unknown pair {name!r}; choose from {sorted(PAIRS)}")
        pi, mu = PAIRS[name]
        return self.logits[pi].float(), self.logits[mu].float()


def engine_support(mu_logits_NV: torch.Tensor, sampled_N: torch.Tensor, top_k: int = 20,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an engine returns for these positions: mu's top-K log-probs (fp32 log_softmax of its
    logits, as SGLang / vLLM report them) with the sampled token folded in (ops/support.py).

    Returns:
        (support_ids [N, K+1] int32, support_logprobs [N, K+1] fp32, support_valid [N, K+1],
        behaviour log-prob of the sampled token [N] fp32), checked against the contract.
    """
    import numpy as np

    from megatron_pdm.ops.support import check_support, fold_support

    lp_NV = torch.log_softmax(mu_logits_NV.float(), -1)
    top_lp_NK, top_ids_NK = lp_NV.topk(top_k, dim=-1)
    sampled_lp_N = lp_NV.gather(1, sampled_N.long()[:, None])[:, 0]
    del lp_NV
    ids, lp, valid, _ = fold_support(top_ids_NK.numpy(), top_lp_NK.numpy(),
                                     np.ones(tuple(top_ids_NK.shape), dtype=bool),
                                     sampled_N.numpy(), sampled_lp_N.numpy())
    check_support(ids, lp, valid, sampled_N.numpy(), mu_logits_NV.shape[1],
                  sampled_lp_N.numpy())
    return (torch.from_numpy(ids), torch.from_numpy(lp), torch.from_numpy(valid),
            sampled_lp_N)


def model_available(model_dir: str | Path = DEFAULT_MODEL_DIR) -> bool:
    d = Path(model_dir)
    return (d / "prepared.json").is_file() and (d / "model.safetensors").is_file()


def prompts(cfg: RealLogitsConfig) -> list[tuple[str, int | None]]:
    """[(user message, integer answer or None for a general prompt)], seeded; every third
    prompt is a general one while they last (the first `tokens` responses hold both kinds)."""
    rng = random.Random(cfg.seed)
    arith: list[tuple[str, int | None]] = []
    for _ in range(cfg.arithmetic_prompts):
        name, fn = _OPS[rng.randrange(len(_OPS))]
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        arith.append((f"What is {a} {name} {b}? Answer with a number.", fn(a, b)))
    general = [(GENERAL_PROMPTS[i % len(GENERAL_PROMPTS)], None)
               for i in range(cfg.general_prompts)]
    out: list[tuple[str, int | None]] = []
    while arith or general:
        out.extend(arith[:2])
        del arith[:2]
        out.extend(general[:1])
        del general[:1]
    return out


def reward(text: str, answer: int | None) -> float:
    """1.0 when the last integer in `text` equals `answer` (0.0 otherwise, and for None)."""
    if answer is None:
        return 0.0
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return float(bool(found) and int(found[-1]) == answer)


def _sample(model, prompt_ids: list[int], n: int, max_new: int, eos: int,
            gen: torch.Generator) -> list[list[int]]:
    """n continuations of one prompt at temperature 1 (full softmax, fp64 multinomial)."""
    ids_BL = torch.tensor([prompt_ids] * n)
    out = model(input_ids=ids_BL, use_cache=True)
    cache, logits_BV = out.cache, out.logits[:, -1]
    seqs: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_new):
        probs_BV = torch.softmax(logits_BV.double(), -1)
        tok_B = torch.multinomial(probs_BV, 1, generator=gen)[:, 0]
        for b in range(n):
            if not done[b]:
                seqs[b].append(int(tok_B[b]))
                done[b] = int(tok_B[b]) == eos
        if all(done):
            break
        out = model(input_ids=tok_B[:, None], cache=cache, use_cache=True)
        cache, logits_BV = out.cache, out.logits[:, -1]
    return seqs


def _group_logits(model, prompt_ids: list[int], resps: list[list[int]], eos: int):
    """[(len(resp), V) logits predicting each response token] of one prompt's samples, in one
    right-padded forward (causal attention: padding after a sequence never changes it)."""
    p = len(prompt_ids)
    width = max(len(r) for r in resps)
    ids_BL = torch.tensor([prompt_ids + r + [eos] * (width - len(r)) for r in resps])
    logits_BLV = model(input_ids=ids_BL).logits
    return [logits_BLV[b, p - 1: p - 1 + len(r)] for b, r in enumerate(resps)]


def _response_logits(model, groups, eos: int) -> torch.Tensor:
    """[sum of response lengths, V] logits predicting each response token (teacher forcing),
    in sample order."""
    rows = []
    for prompt_ids, resps in groups:
        rows.extend(_group_logits(model, prompt_ids, resps, eos))
    return torch.cat(rows)


def _grpo_step(model, groups, advantages: list[list[float]], lr: float, eos: int) -> float:
    """One Adam step on -sum(A * log pi_k) / #tokens; returns the parameter change's L2 norm."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    n_tok = sum(len(r) for _, resps in groups for r in resps)
    opt.zero_grad()
    for (prompt_ids, resps), adv in zip(groups, advantages):
        if not any(adv):
            continue
        loss = 0.0
        for a, r, logits_LV in zip(adv, resps, _group_logits(model, prompt_ids, resps, eos)):
            logp_L = torch.log_softmax(logits_LV.float(), -1).gather(
                1, torch.tensor(r)[:, None])[:, 0]
            loss = loss - a * logp_L.sum()
        (loss / n_tok).backward()
    opt.step()
    return float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in
                                zip(model.parameters(), before))))


def build(cfg: RealLogitsConfig) -> RealLogits:
    """Samples, scores and steps the model (see the module docstring). No cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not model_available(cfg.model_dir):
        raise FileNotFoundError(f"no prepared real model at {cfg.model_dir}: run "
                                "`make real-model` "
                                "(python -m megatron_pdm.tools.prepare_real_model)")
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(cfg.model_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32).eval()
    eos = int(tok.eos_token_id)
    gen = torch.Generator().manual_seed(cfg.seed)
    groups, answers, n_tok = [], [], 0
    with torch.no_grad():
        for text, answer in prompts(cfg):
            p_ids = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
            resps = _sample(model, p_ids, cfg.samples, cfg.max_new_tokens, eos, gen)
            groups.append((p_ids, resps))
            answers.append(answer)
            n_tok += sum(len(r) for r in resps)
            if n_tok >= cfg.tokens:
                break
    if n_tok < cfg.tokens:
        raise ValueError(f"the recipe sampled {n_tok} response tokens, fewer than tokens="
                         f"{cfg.tokens}: raise arithmetic_prompts or samples")
    t_sample = time.perf_counter() - t0
    texts = [[tok.decode(r, skip_special_tokens=True) for r in resps] for _, resps in groups]
    rewards = [[reward(t, a) for t in ts] for ts, a in zip(texts, answers)]
    advantages = [[0.0 if a is None else r - sum(rs) / len(rs) for r in rs]
                  for rs, a in zip(rewards, answers)]
    if not any(any(adv) for adv in advantages):
        raise ValueError("every advantage is 0 (each prompt's samples got the same reward): "
                         "the step would not move the model; change the seed or the prompts")
    logits = {}
    with torch.no_grad():
        logits["base"] = _response_logits(model, groups, eos)[: cfg.tokens].contiguous()
        bf16 = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.bfloat16).eval()
        logits["bf16"] = _response_logits(bf16, groups, eos)[: cfg.tokens].contiguous()
        del bf16
    step_norm = _grpo_step(model.train(), groups, advantages, cfg.step_lr, eos)
    with torch.no_grad():
        logits["step"] = _response_logits(model.eval(), groups, eos)[: cfg.tokens].contiguous()
    flat = [(g, s, t) for g, (_, resps) in enumerate(groups) for s, r in enumerate(resps)
            for t in r][: cfg.tokens]
    seq_of = {}
    seq_ids = torch.tensor([seq_of.setdefault((g, s), len(seq_of)) for g, s, _ in flat])
    arith = [answers[g] is not None for g in range(len(groups))]
    flat_r = [r for rs in rewards for r in rs]
    flat_a = [a for g, rs in enumerate(rewards) for a in [arith[g]] * len(rs)]
    meta = {"config": asdict(cfg), "prompts_used": len(groups),
            "sequences": sum(len(r) for _, r in groups), "sequences_used": len(seq_of),
            "response_tokens_sampled": n_tok,
            "mean_reward_arithmetic": sum(r for r, a in zip(flat_r, flat_a) if a)
            / max(1, sum(flat_a)),
            "nonzero_advantages": sum(a != 0.0 for adv in advantages for a in adv),
            "step_param_change_l2": step_norm, "sample_s": t_sample,
            "total_s": time.perf_counter() - t0,
            "examples": [{"prompt": prompts(cfg)[g][0], "response": texts[g][0],
                          "reward": rewards[g][0]} for g in range(min(3, len(groups)))]}
    return RealLogits(logits, torch.tensor([t for _, _, t in flat]), seq_ids,
                      torch.tensor([arith[g] for g, _, _ in flat]), meta)


def load_or_build(cfg: RealLogitsConfig = RealLogitsConfig(),
                  cache_dir: str | Path = DEFAULT_CACHE_DIR) -> RealLogits:
    """The cached RealLogits of `cfg`, built (and cached atomically) on the first call."""
    manifest = (Path(cfg.model_dir) / "prepared.json").read_text() \
        if model_available(cfg.model_dir) else ""
    path = Path(cache_dir) / f"{cfg.key(manifest)}.pt"
    if path.is_file():
        blob = torch.load(path, weights_only=False)
        return RealLogits(**blob)
    out = build(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"logits": {k: (v.bfloat16() if k == "bf16" else v)
                           for k, v in out.logits.items()},
                "sampled_ids": out.sampled_ids, "seq_ids": out.seq_ids,
                "arithmetic": out.arithmetic, "meta": out.meta}, tmp)
    tmp.replace(path)
    out.meta["cache_path"] = str(path)
    return out
