"""Loss layer: the masked / shaped policy-gradient surrogate of the whole family (torch only).

The megatron-core `loss_func` adapter lives in `megatron_pdm.mcore.loss_adapter`.
"""
