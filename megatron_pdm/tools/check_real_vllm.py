"""vLLM serving the real model vs transformers fp32 on the same tokens (docs/real-model.md).

    python -m megatron_pdm.tools.check_real_vllm [--model-dir D] [--prompts 8] [--samples 4]
        [--max-new-tokens 48] [--top-logprobs 8] [--temperatures 1.0 0.7] [--dtype float32]
        [--url URL] [--perturb 0.01] [--out report.json]

1. Starts a CPU vLLM server on the HF directory
   (`train.rollout.vllm_server.process.VLLMServer`: 127.0.0.1, a random API key, own process
   group, stopped at the end), or uses `--url` (key in $PDM_VLLM_API_KEY).
2. Prompts: arithmetic word problems through the model's chat template (train/word_task.py);
   vLLM samples `--samples` responses per prompt with its top-K log-probs
   (`rollout_bridge.vllm.client.VLLMEngine`, processed log-probs = log_softmax(logits / T)).
3. transformers (`AutoModelForCausalLM`, float32, eager) scores the same prompt + response tokens;
   `train.logprob_check.LogprobAgreement` gives max/mean |transformers - vLLM| of the sampled
   token and of every top-K entry, and how often the top-K id sets agree, per temperature.
With `--perturb S` every weight first gets N(0, S * its std) noise, in the transformers model and
pushed to vLLM in memory (`VLLMEngine.update_weights` through a /dev/shm file, digest-checked):
the check then covers an in-place reload, as after a training step (the tied output layer
included, rollout_bridge/vllm/worker_ext.py `retie_output_layer`).
The report also names the dtype the server reports (`--dtype` is passed to vLLM; vLLM's CPU
backend runs what it is given) and the reward of the samples (the task's final-number rule).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_MODEL = Path(".cache/real-model/smollm2-135m-instruct")


def score_with_transformers(model, packed, check, rows_per_chunk: int = 4) -> None:
    """Feeds `check` the transformers logits of every packed row (chunks bound the memory)."""
    b = packed.tokens.shape[0]
    for start in range(0, b, rows_per_chunk):
        rows = packed.select_rows(torch.arange(start, min(b, start + rows_per_chunk)))
        with torch.no_grad():
            logits_bsv = model(input_ids=rows.tokens, position_ids=rows.position_ids).logits
        check.add(logits_bsv.float(), rows)


def perturb_and_push(model, engine, scale: float, seed: int) -> dict:
    """Adds N(0, scale * std) to every weight of `model` and pushes the HF state to vLLM."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (scale * float(p.float().std())))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the checkpoint has the embedding only
    engine.update_weights(state, "perturbed")
    return engine.last_push_info


def run_check(engine, model, task, *, prompts: int, samples: int, temperatures, seed: int = 0
              ) -> list[dict]:
    from megatron_pdm.train.logprob_check import LogprobAgreement
    from megatron_pdm.train.rollout.feed import sampling_params
    from rollout_bridge.core.packing import pack_padded

    problems = task.problems(seed, 0, prompts)
    prompt_ids = [task.prompt_ids(p) for p in problems]
    out = []
    for temperature in temperatures:
        t0 = time.time()
        batch = engine.generate(prompt_ids, sampling_params(task, temperature), n=samples,
                                raise_on_failure=True)
        gen_s = time.time() - t0
        rewards = [task.score(problems[s.prompt_index], s.response_ids.tolist())
                   for s in batch.samples]
        packed = pack_padded(batch, None, pad_id=task.pad_id)
        check = LogprobAgreement(batch.top_logprobs, batch.vocab_size, temperature)
        t0 = time.time()
        score_with_transformers(model, packed, check)
        out.append({**check.report(), "samples": len(batch.samples),
                    "mean_response_tokens": sum(s.num_tokens for s in batch.samples)
                    / len(batch.samples),
                    "finished": sum(s.finish_reason == "stop" for s in batch.samples),
                    "reward": sum(rewards) / len(rewards), "vllm_generate_s": gen_s,
                    "transformers_score_s": time.time() - t0})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pdm.tools.check_real_vllm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--top-logprobs", type=int, default=8)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--url", default=None, help="an already running server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--perturb", type=float, default=0.0,
                        help="push weights with this relative noise first (an in-place reload)")
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from megatron_pdm.train.rollout.vllm_server.process import VLLMServer
    from megatron_pdm.train.word_task import WordProblemTask
    from rollout_bridge.vllm.client import VLLMEngine

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        print(f"check_real_vllm: no HF model at {model_dir} (prepare it with make real-model)",
              file=sys.stderr)
        return 2
    task = WordProblemTask(str(model_dir), max_new_tokens=args.max_new_tokens)
    server = None
    if args.url:
        url, key = args.url, os.environ.get("PDM_VLLM_API_KEY")
    else:
        key = secrets.token_hex(16)
        server = VLLMServer(model_dir, tempfile.mkdtemp(prefix="pdm_real_vllm_"), api_key=key,
                            dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                            kv_cache_bytes=512 << 20)
        server.start()
    try:
        report: dict = {"model_dir": str(model_dir), "vllm_dtype_requested": args.dtype}
        if server is not None:
            report["server_start_s"] = server.wait_ready(900)
            url = server.url
        engine = VLLMEngine(url, top_logprobs=args.top_logprobs, api_key=key,
                            vocab_size=task.vocab_size, timeout_s=1800, seed=args.seed,
                            push_dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        info = engine.check_server()
        facts = info["facts"][0]
        report.update(vllm_version=facts.get("vllm_version"), vllm_dtype=facts.get("dtype"),
                      vllm_vocab=facts.get("vocab_size"))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        report["transformers_dtype"] = str(next(model.parameters()).dtype)
        if args.perturb:
            push = perturb_and_push(model, engine, args.perturb, args.seed)
            report["push"] = {"perturb": args.perturb, "bytes": push.get("bytes"),
                              "push_s": push.get("push_s"),
                              "lm_head_retied": [w.get("lm_head_retied")
                                                 for w in push.get("worker", [])]}
        report["checks"] = run_check(engine, model, task, prompts=args.prompts,
                                     samples=args.samples, temperatures=args.temperatures,
                                     seed=args.seed)
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
