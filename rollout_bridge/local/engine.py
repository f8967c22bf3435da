"""In-process rollout engine over a torch logits callable (CPU, or the model's `device`).

What: `LocalEngine` samples responses from `softmax(model(ids)[:, -1] / temperature)` and returns
the exact top-K of the tempered log-softmax in the same `RolloutSample` format as the SGLang
parser (support folding and validation are shared with `parse.py`).

Design choices:
  * No KV cache: every step recomputes the whole prefix (tiny test/demo models). Sequences of a
    batch are right-padded; for a causal model the logits at a sequence's last real position do
    not depend on the padding after it, so no attention mask is needed. Non-causal models are
    not supported.
  * Logits beyond `vocab_size` (Megatron vocabulary padding) are dropped before the softmax.
  * Sampling is Gumbel-max on the fp32 full-vocab log-probs with noise drawn from a CPU
    `torch.Generator` seeded from (seed, call counter). So every tensor-parallel rank that calls
    `generate` in lockstep with the same seed on identical gathered logits samples identical
    tokens. A Megatron wrapper must therefore return the *full-vocab* logits on every rank
    (gather the vocab shards), e.g.::

        class GatheredGPT(torch.nn.Module):
            def __init__(self, gpt):            # megatron.core GPTModel (TP group initialised)
                super().__init__(); self.gpt = gpt
            def forward(self, ids):             # [B, L] -> [B, L, V_padded]
                pos = torch.arange(ids.shape[1]).expand_as(ids)
                out = self.gpt(ids, pos, attention_mask=None)   # [B, L, V/TP] (causal mask)
                return gather_from_tensor_model_parallel_region(out)

  * Rollout precision: "bf16" rounds the engine's weights to bf16 values but keeps fp32 compute
    (the rounding of weights is the dominant train/rollout mismatch; activations stay fp32 so the
    result is deterministic on CPU); "fp8" simulates e4m3 weights with 128x128 block scales (per
    tensor for non-2-D tensors). Both apply at construction and at every `update_weights`.
  * Greedy (temperature 0) returns log_softmax of the raw logits, like SGLang.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from rollout_bridge.core.engine import assemble_batch, check_sampling_params
from rollout_bridge.core.decode import folded_support
from rollout_bridge.core.types import RolloutBatch, RolloutSample
from rollout_bridge.core.weights import apply_rollout_precision, load_safetensors_dir

logger = logging.getLogger(__name__)


def _logits_of(out) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _truncate(lp_bv: torch.Tensor, params: dict) -> torch.Tensor:
    """Applies top_k / top_p / min_p to log-probs for *sampling* only (-inf outside)."""
    out = lp_bv.clone()
    top_k = int(params.get("top_k", -1) or -1)
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, -torch.inf)
    min_p = float(params.get("min_p", 0.0) or 0.0)
    if min_p > 0:
        out = out.masked_fill(out < out.max(-1, keepdim=True).values + np.log(min_p), -torch.inf)
    top_p = float(params.get("top_p", 1.0) if params.get("top_p") is not None else 1.0)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop_sorted = (cum - sorted_lp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, -torch.inf)
    return out


class LocalEngine:
    """In-process rollout engine (see module docstring).

    Args:
        model: Callable `LongTensor [B, L] -> logits [B, L, V']` with V' >= vocab_size (plain
            module, HF-style output with `.logits`, or a Megatron wrapper returning gathered
            logits). The engine owns it: `update_weights` overwrites its parameters, so pass a
            copy of the trainer's module (see `from_policy`).
        vocab_size: Real vocabulary; logits at ids >= vocab_size are dropped.
        top_logprobs: K of the support.
        seed: Sampling seed (combined with a per-call counter).
        rollout_precision: None, "bf16" or "fp8" (applied to the weights).
        eos_token_id: Stops a response (finish_reason "stop") unless `ignore_eos`.
        pad_token_id: Right-padding id inside batches.
        fp8_block_size: Block edge of the simulated FP8 scales (None: per tensor).
        precision_skip: Name substrings kept at full precision.
        allow_truncated_sampling: Accept top_p/top_k/min_p (logprobs stay untruncated).
        max_batch_size: Sequences per forward.
        weight_version: Initial version string.
        validate: Validate every produced support (cheap; on by default).
        device: Where the model's parameters live: its inputs are built there and the sampling
            math runs there (the Gumbel noise is drawn on the CPU generator, for identical draws
            on every device, and moved); the samples come back as host tensors.
    """

    def __init__(self, model: Callable[[torch.Tensor], torch.Tensor], *, vocab_size: int,
                 top_logprobs: int, seed: int = 0, rollout_precision: str | None = None,
                 eos_token_id: int | None = None, pad_token_id: int = 0,
                 fp8_block_size: int | None = 128, precision_skip: Iterable[str] = (),
                 allow_truncated_sampling: bool = False, max_batch_size: int = 64,
                 weight_version: str = "0", validate: bool = True,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.vocab_size = int(vocab_size)
        self.top_logprobs = int(top_logprobs)
        if not 0 <= self.top_logprobs <= self.vocab_size:
            raise ValueError(f"top_logprobs={top_logprobs} outside [0, vocab_size={vocab_size}]")
        self.seed = int(seed)
        self.rollout_precision = rollout_precision
        self.eos_token_id = eos_token_id
        self.pad_token_id = int(pad_token_id)
        self.fp8_block_size = fp8_block_size
        self.precision_skip = tuple(precision_skip)
        self.allow_truncated_sampling = allow_truncated_sampling
        self.max_batch_size = int(max_batch_size)
        self.validate = validate
        self._version = str(weight_version)
        self._num_updates = 0
        self._calls = 0
        if rollout_precision not in (None, "fp32") and isinstance(model, torch.nn.Module):
            self._load(model.state_dict(), strict=True)

    @classmethod
    def from_policy(cls, policy: torch.nn.Module, **kwargs) -> LocalEngine:
        """Builds an engine over a deep copy of the trainer's module (weights never shared)."""
        return cls(copy.deepcopy(policy), **kwargs)

    # ------------------------------------------------------------------ weights

    def weight_version(self) -> str:
        """Version string of the weights currently loaded."""
        return self._version

    def _load(self, weights: Mapping[str, torch.Tensor], strict: bool) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError("update_weights needs the engine's model to be a torch.nn.Module")
        own = dict(self.model.state_dict(keep_vars=True))
        unknown = [k for k in weights if k not in own]
        if unknown and strict:
            raise KeyError(f"unknown weight names {unknown[:5]} (strict=True)")
        converted = apply_rollout_precision({k: v for k, v in weights.items() if k in own},
                                            self.rollout_precision, self.fp8_block_size,
                                            self.precision_skip)
        with torch.no_grad():
            for name, tensor in converted.items():
                dst = own[name]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != engine "
                                     f"{tuple(dst.shape)}")
                dst.copy_(tensor.to(dtype=dst.dtype, device=dst.device))

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[
                       tuple[str, torch.Tensor]], version: str | None = None, *,
                       strict: bool = True) -> str:
        """Copies trainer weights into the engine's module, applying the rollout precision.

        Args:
            weights: A state dict or an iterable of (name, tensor) with the module's names.
            version: New version string (default: the update counter, "1", "2", ...).
            strict: Refuse names the module does not have.

        Returns:
            The new weight version.
        """
        if not isinstance(weights, Mapping):
            weights = dict(weights)
        self._load(weights, strict)
        self._num_updates += 1
        self._version = str(version) if version is not None else str(self._num_updates)
        logger.info("LocalEngine weights updated to version %s (%s)", self._version,
                    self.rollout_precision or "fp32")
        return self._version

    def state_dict(self) -> dict:
        """Sampling state that, with the loaded weights, fixes the next samples (for resume)."""
        return {"seed": self.seed, "calls": self._calls, "num_updates": self._num_updates,
                "version": self._version}

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()` (the weights are restored separately)."""
        self.seed = int(state["seed"])
        self._calls = int(state["calls"])
        self._num_updates = int(state["num_updates"])
        self._version = str(state["version"])

    def load_weights_from_disk(self, model_path: str, version: str | None = None,
                               name_map: Callable[[str], str] | None = None) -> str:
        """`update_weights` from a safetensors file/directory (what SGLang's endpoint does)."""
        state = load_safetensors_dir(model_path)
        if name_map is not None:
            state = {name_map(k): v for k, v in state.items()}
        return self.update_weights(state, version)

    # ------------------------------------------------------------------ math

    @torch.no_grad()
    def _forward_last(self, seqs: list[list[int]]) -> torch.Tensor:
        """Full-vocab fp32 logits at each sequence's last position: [B, vocab_size]."""
        lens = torch.tensor([len(s) for s in seqs])
        ids_bl = torch.full((len(seqs), int(lens.max())), self.pad_token_id, dtype=torch.int64)
        for b, s in enumerate(seqs):
            ids_bl[b, :len(s)] = torch.as_tensor(s, dtype=torch.int64)
        logits_blv = _logits_of(self.model(ids_bl.to(self.device)))
        if logits_blv.shape[-1] < self.vocab_size:
            raise ValueError(f"model returns {logits_blv.shape[-1]} logits < vocab_size "
                             f"{self.vocab_size}")
        last_bv = logits_blv[torch.arange(len(seqs)), lens - 1]
        return last_bv[:, :self.vocab_size].float()

    @torch.no_grad()
    def score(self, input_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """Tempered log-probs of every prefix: row q is the distribution of token q+1.

        Args:
            input_ids: [L] token ids.
            temperature: Sampling temperature (0 = raw logits).

        Returns:
            [L, vocab_size] fp32 log-probs.
        """
        ids_1l = torch.as_tensor([input_ids], dtype=torch.int64).to(self.device)
        logits_lv = _logits_of(self.model(ids_1l))[0, :, :self.vocab_size].float()
        scale = temperature if temperature > 0 else 1.0
        return torch.log_softmax(logits_lv / scale, dim=-1).cpu()

    def _generator(self) -> torch.Generator:
        self._calls += 1
        return torch.Generator().manual_seed((self.seed * 1_000_003 + self._calls) % (1 << 62))

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_ids: list[list[int]], sampling_params: dict | None = None,
                 n: int = 1, *, raise_on_failure: bool = False) -> RolloutBatch:
        """Samples `n` responses per prompt.

        Args:
            prompt_ids: Prompts (non-empty lists of ids).
            sampling_params: SGLang-style: temperature (1.0), max_new_tokens (16),
                stop_token_ids, ignore_eos, and top_p/top_k/min_p only with
                allow_truncated_sampling.
            n: Samples per prompt (GRPO group size).
            raise_on_failure: Kept for interface parity (the local engine does not fail).

        Returns:
            `RolloutBatch` with samples ordered by (prompt, sample).
        """
        params = dict(sampling_params or {})
        temperature = check_sampling_params(params, self.allow_truncated_sampling)
        truncated = any(params.get(k) not in (None, d) for k, d in
                        (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0)))
        max_new = int(params.get("max_new_tokens", 16))
        stop_ids = set(params.get("stop_token_ids") or [])
        if self.eos_token_id is not None and not params.get("ignore_eos", False):
            stop_ids.add(int(self.eos_token_id))
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        gen = self._generator()
        items = [(p, j) for p in range(len(prompt_ids)) for j in range(n)]
        outcomes = {}
        for start in range(0, len(items), self.max_batch_size):
            chunk = items[start:start + self.max_batch_size]
            for key, sample in zip(chunk, self._generate_chunk(
                    [list(prompt_ids[p]) for p, _ in chunk], temperature, max_new, stop_ids,
                    gen, params if truncated else None)):
                outcomes[key] = sample
        return assemble_batch(outcomes, len(prompt_ids), n, temperature=temperature,
                              top_logprobs=self.top_logprobs, prompt_ids=prompt_ids,
                              default_version=self._version, raise_on_failure=raise_on_failure,
                              vocab_size=self.vocab_size, validated=self.validate)

    def _generate_chunk(self, prompts: list[list[int]], temperature: float, max_new: int,
                        stop_ids: set[int], gen: torch.Generator,
                        trunc_params: dict | None) -> list[RolloutSample]:
        b = len(prompts)
        seqs = [list(p) for p in prompts]
        sampled = [[] for _ in range(b)]
        sampled_lp = [[] for _ in range(b)]
        top_ids = [[] for _ in range(b)]
        top_lp = [[] for _ in range(b)]
        reasons = ["length"] * b
        active = list(range(b))
        for _ in range(max_new):
            if not active:
                break
            logits_av = self._forward_last([seqs[i] for i in active])
            lp_av = torch.log_softmax(logits_av / (temperature if temperature > 0 else 1.0), -1)
            # Noise for the whole chunk every step keeps draws independent of `active`.
            u_bv = torch.rand(b, self.vocab_size, generator=gen, dtype=torch.float64)
            gumbel_av = -torch.log(-torch.log(u_bv.clamp_min(1e-300)))[active].float().to(
                self.device)
            sample_lp_av = _truncate(lp_av, trunc_params) if trunc_params else lp_av
            if temperature > 0:
                tok_a = torch.argmax(sample_lp_av + gumbel_av, dim=-1)
            else:
                tok_a = torch.argmax(sample_lp_av, dim=-1)
            tok_lp_a = lp_av.gather(1, tok_a[:, None])[:, 0]
            if self.top_logprobs > 0:
                tv_ak, ti_ak = torch.topk(lp_av, self.top_logprobs, dim=-1)
            still = []
            for r, i in enumerate(active):
                tok = int(tok_a[r])
                seqs[i].append(tok)
                sampled[i].append(tok)
                sampled_lp[i].append(float(tok_lp_a[r]))
                if self.top_logprobs > 0:
                    top_ids[i].append(ti_ak[r])
                    top_lp[i].append(tv_ak[r])
                if tok in stop_ids:
                    reasons[i] = "stop"
                else:
                    still.append(i)
            active = still
        out = []
        for i in range(b):
            t = len(sampled[i])
            ids_t = np.asarray(sampled[i], dtype=np.int64)
            lp_t = np.asarray(sampled_lp[i], dtype=np.float64)
            if self.top_logprobs > 0 and t:
                ids_tk = torch.stack(top_ids[i]).cpu().numpy().astype(np.int64)
                lp_tk = torch.stack(top_lp[i]).cpu().numpy().astype(np.float64)
            else:
                ids_tk = np.zeros((t, self.top_logprobs), dtype=np.int64)
                lp_tk = np.zeros((t, self.top_logprobs))
            ids_ts, lp_ts, valid_ts, n_in = folded_support(
                ids_tk, lp_tk, np.ones_like(ids_tk, dtype=bool), ids_t, lp_t, self.vocab_size, i,
                self.validate)
            out.append(RolloutSample(
                prompt_ids=torch.as_tensor(prompts[i], dtype=torch.int64),
                response_ids=torch.from_numpy(ids_t),
                behavior_logprob=torch.from_numpy(lp_t.astype(np.float32)),
                support_ids=torch.from_numpy(ids_ts),
                support_logprobs=torch.from_numpy(lp_ts),
                support_valid=torch.from_numpy(valid_ts),
                finish_reason=reasons[i],
                meta_info={"weight_version": self._version, "prompt_tokens": len(prompts[i]),
                           "completion_tokens": t, "sampled_in_topk": n_in,
                           "num_short_positions": 0, "num_missing_topk_slots": 0,
                           "rollout_precision": self.rollout_precision},
            ))
        return out
