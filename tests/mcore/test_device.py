"""Batches reach the model on the driver's device (megatron_pdm/mcore/device.py).

Packing builds CPU tensors; on a GPU the model's weights are on CUDA, so a batch handed over
unmoved meets CUDA embedding weights. The test maps the "current device" to torch's "meta"
device (no GPU needed) and runs the driver's own forward step: before the move existed the
forward step passed the CPU batch through unchanged and the model saw CPU tensors.
"""

import dataclasses

import torch

from megatron_pdm.mcore import device as dev
from megatron_pdm.train import schedule


@dataclasses.dataclass
class _Batch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    temperature: float
    cu_seqlens: torch.Tensor | None = None


def test_to_device_moves_every_tensor_field():
    b = _Batch(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), 0.7)
    m = dev.to_device(b, torch.device("meta"))
    assert m.tokens.device.type == "meta" and m.position_ids.device.type == "meta"
    assert m.temperature == 0.7 and m.cu_seqlens is None
    assert b.tokens.device.type == "cpu"  # the packed batch itself is untouched


def test_forward_step_hands_the_model_device_tensors(monkeypatch):
    monkeypatch.setattr(dev, "current_device", lambda: torch.device("meta"))
    seen = {}

    class Model:
        def __call__(self, tokens, position_ids, attention_mask=None):
            seen["tokens"], seen["pos"] = tokens.device.type, position_ids.device.type
            return torch.zeros(())

    def fake_schedule(**kw):  # megatron's schedule calls forward_step once per micro-batch
        kw["forward_step_func"](kw["data_iterator"], Model())
        return []

    class Opt:
        def zero_grad(self):
            pass

        def step(self):
            return True, None, None

    class DDP(Model):
        def zero_grad_buffer(self):
            pass

    monkeypatch.setattr("megatron.core.pipeline_parallel.get_forward_backward_func",
                        lambda: fake_schedule)
    mb = _Batch(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), 1.0)
    schedule.optimizer_step(DDP(), Opt(), [mb], lambda m: (lambda out: out), pp=1)
    assert seen == {"tokens": "meta", "pos": "meta"}


def test_gpu_initialises_weights_on_the_device(monkeypatch):
    from megatron_pdm.arch import ModelArch
    from megatron_pdm.mcore.model import transformer_config

    arch = ModelArch(vocab_size=64)
    assert transformer_config(arch).use_cpu_initialization  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not transformer_config(arch).use_cpu_initialization
