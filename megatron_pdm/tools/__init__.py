"""Command-line tools (thin CLIs over the library), installed as console commands by setup.py.

    megatron-pdm-make-tiny-hf           python -m megatron_pdm.tools.make_tiny_hf
    megatron-pdm-convert-hf-to-megatron python -m megatron_pdm.tools.convert_hf_to_megatron
    megatron-pdm-convert-megatron-to-hf python -m megatron_pdm.tools.convert_megatron_to_hf
    megatron-pdm-verify-conversion      python -m megatron_pdm.tools.verify_conversion
    megatron-pdm-analyze-masks          torchrun ... -m megatron_pdm.tools.analyze_masks

Each module has `main(argv=None) -> int`; the console command calls it.
"""
