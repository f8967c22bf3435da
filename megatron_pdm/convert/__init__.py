"""HF Qwen3-MoE <-> megatron-core checkpoint conversion (library behind the converter CLIs,
megatron_pdm/tools/convert_*.py).

- `mapping`: pure-torch name/shape mapping between HF tensors and canonical megatron tensors
  (QKV fusion per query group, [gate; up] fc1, router, q/k norms, vocab padding, expert layouts);
- `hf_io`: lazy safetensors reader and size-capped sharded writer;
- `distributed`: spawn gloo ranks for a layout (or join torchrun);
- `checkpoint`: import into a megatron dist checkpoint at any TP/EP/PP, load it at any layout;
- `export`: stream a dist checkpoint back to HF safetensors.

Only `checkpoint`, `export` and `distributed` import megatron/torch.distributed (lazily).
"""
