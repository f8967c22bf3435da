"""worker_ext.retie_output_layer: a tied model's output layer follows the reloaded embedding."""

from __future__ import annotations

import types

import torch

from rollout_bridge.vllm import worker_ext as wx


class _PackingMethod:
    """Like vLLM's CPU `UnquantizedEmbeddingMethod`: builds its GEMM from the weight it sees."""

    def process_weights_after_loading(self, layer):
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x: x @ packed.t()


def _model(tied: bool):
    embed = torch.nn.Embedding(5, 3)
    lm_head = torch.nn.Module()
    lm_head.weight = embed.weight
    lm_head.quant_method = _PackingMethod()
    lm_head.quant_method.process_weights_after_loading(lm_head)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = embed
    model.lm_head = lm_head
    model.config = types.SimpleNamespace(tie_word_embeddings=tied)
    return model


def test_retie_rebuilds_the_output_kernel_from_the_new_embedding():
    model = _model(tied=True)
    x = torch.randn(2, 3)
    # an in-place reload that replaced the embedding's tensor (as the layerwise reload does)
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.randn(5, 3))
    stale = model.lm_head.cpu_linear(x)
    want = x @ model.model.embed_tokens.weight.detach().t()
    assert not torch.allclose(stale, want)
    assert wx.retie_output_layer(model) is True
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.allclose(model.lm_head.cpu_linear(x), want)


def test_untied_or_other_models_are_left_alone():
    model = _model(tied=False)
    kernel = model.lm_head.cpu_linear
    assert wx.retie_output_layer(model) is False and model.lm_head.cpu_linear is kernel
    assert wx.retie_output_layer(torch.nn.Linear(2, 2)) is False
