"""The fake SGLang server's models: loading pushed (name, tensor) pairs the way SGLang's
`model.load_weights` gets them, and the HF-backed engine that reloads an HF directory on
/update_weights_from_disk like a real server (used by tests/support/fake_sglang.py)."""

from __future__ import annotations

import re

import torch

from rollout_bridge import LocalEngine


def load_named(engine, named) -> None:
    """Loads (name, tensor) pairs the way SGLang's `model.load_weights` gets them (HF names,
    per-expert experts) into the fake's model: HF models (transformers 5 stores the experts
    fused) get the per-expert tensors written into their fused parameters; other engines take
    their own state-dict names."""
    model = engine.model
    if not hasattr(model, "config") or not hasattr(model.config, "num_experts"):
        engine._load(dict(named), strict=True)
        return
    params = dict(model.named_parameters())
    inter = model.config.moe_intermediate_size
    pat = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    with torch.no_grad():
        for name, tensor in named:
            m = pat.match(name)
            if m is None:
                if name not in params:
                    raise KeyError(f"unknown weight {name}")
                dst = params[name]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
                dst.copy_(tensor.to(dst.dtype))
                continue
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind == "down":
                params[prefix + "down_proj"][e].copy_(tensor.to(params[prefix + "down_proj"].dtype))
            else:
                gu = params[prefix + "gate_up_proj"]
                rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
                gu[e, rows].copy_(tensor.to(gu.dtype))


# ---------------------------------------------------------------------------------------------
# HF-backed mode: a transformers causal LM (e.g. Qwen3MoeForCausalLM) loaded from an HF directory
# and reloaded from the directory named by /update_weights_from_disk, like a real SGLang server.
# ---------------------------------------------------------------------------------------------


def load_hf_causal_lm(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers AutoModelForCausalLM from local files, eval mode, fp32 by default."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True,
                                                 dtype=dtype)
    return model.eval()


class HFModelEngine(LocalEngine):
    """`LocalEngine` over an HF model directory; `load_weights_from_disk` reloads the model.

    Right-padded batches are fine without an attention mask (causal model: padding after a
    sequence's last token cannot change its logits).
    """

    def __init__(self, model_path: str, *, top_logprobs: int = 0, seed: int = 0,
                 eos_token_id: int | None = None, dtype: torch.dtype = torch.float32,
                 weight_version: str = "0"):
        self.dtype = dtype
        self.model_path = model_path
        model = load_hf_causal_lm(model_path, dtype)
        super().__init__(model, vocab_size=model.config.vocab_size, top_logprobs=top_logprobs,
                         seed=seed, eos_token_id=eos_token_id, max_batch_size=256,
                         weight_version=weight_version)
        self.loaded_paths = [model_path]

    def load_weights_from_disk(self, model_path: str, version: str | None = None,
                               name_map=None) -> str:
        new = load_hf_causal_lm(model_path, self.dtype)
        if new.config.vocab_size != self.vocab_size:
            raise ValueError(f"{model_path}: vocab_size {new.config.vocab_size} != "
                             f"{self.vocab_size}")
        self.model = new
        self.model_path = model_path
        self.loaded_paths.append(model_path)
        self._num_updates += 1
        self._version = str(version) if version is not None else str(self._num_updates)
        return self._version
