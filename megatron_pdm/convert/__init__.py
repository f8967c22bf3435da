"""HF <-> megatron-core checkpoint conversion for the `arch.ModelArch` families (Qwen3-MoE, dense
Qwen3, Llama): the library behind the converter CLIs (megatron_pdm/tools/convert_*.py) and the
weight sync to the rollout engines.

- `names`: megatron's parameter-name patterns (layers, experts), the one table;
- `mapping`: pure-torch name/shape mapping between HF tensors and canonical megatron tensors
  (QKV fusion per query group, [gate; up] fc1, router, q/k norms, vocab padding);
- `expert_layouts`: sequential <-> grouped-GEMM experts of one rank's state dict;
- `sharding`: the TP/EP split of every tensor (import cuts, live export assembles);
- `hf_io`: lazy safetensors reader and size-capped sharded writer;
- `distributed`: spawn gloo ranks for a layout (or join torchrun);
- `checkpoint`: import into a megatron dist checkpoint at any TP/EP/PP, load it at any layout;
- `export`: stream a dist checkpoint back to HF safetensors;
- `live`: the running sharded model gathered as HF tensors on one rank (weight sync without disk);
- `load_dir`: the converted directory layout (Megatron-LM `--load` plus our metadata); `tiny`:
  the tiny random HF models of the tests and docs/conversion.md.

Only `checkpoint`, `export`, `distributed` and `live` import megatron/torch.distributed (lazily
for megatron).
"""
