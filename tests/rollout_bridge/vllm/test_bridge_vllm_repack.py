"""The worker extension's CPU MoE repack decision (rollout_bridge/vllm/worker_ext.py), without vLLM.

The reload of a buggy vLLM (0.32.0, 0.33.0) re-runs the layer's quant method but skips the
kernel's prepack; a fixed one runs it (or builds a new kernel). The fakes below mimic the call
structure of `UnquantizedFusedMoEMethod._setup_kernel`.
"""

from __future__ import annotations

import pytest

from rollout_bridge.vllm import worker_ext as wx


class FakeExperts:
    def __init__(self):
        self.prepacks = 0

    def process_weights_after_loading(self, layer):
        self.prepacks += 1


class FakeKernel:
    def __init__(self):
        self.fused_experts = FakeExperts()


class FakeMethod:
    """`fixed`: the reload runs the kernel prepack; `rebuild`: it builds a new kernel."""

    def __init__(self, fixed=False, rebuild=False):
        self.moe_kernel = FakeKernel()
        self.fixed, self.rebuild = fixed, rebuild

    def process_weights_after_loading(self, layer):
        if self.rebuild:
            self.moe_kernel = FakeKernel()
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)
        elif self.fixed:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)


class FakeLayer:
    def __init__(self, method):
        self.quant_method = method


def _layers(method, n=3):
    out = []
    for i in range(n):
        layer = FakeLayer(method)
        out.append((f"model.layers.{i}.mlp.experts", layer, method.moe_kernel.fused_experts))
    return out


def _reload(layers, which):
    """The layerwise reload: process_weights_after_loading of the layers that got weights."""
    for i in which:
        layer = layers[i][1]
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("fixed,rebuild,expect", [
    (False, False, {0, 2}),   # buggy vLLM: the reloaded layers need the repack
    (True, False, set()),     # fixed vLLM: it prepacked them itself
    (False, True, set()),     # fixed by building a new kernel
])
def test_auto_repacks_exactly_the_reloaded_layers_vllm_did_not_prepack(fixed, rebuild, expect):
    method = FakeMethod(fixed=fixed, rebuild=rebuild)
    layers = _layers(method)
    with wx._track_reloaded_moe_layers(layers) as (reloaded, prepacked):
        _reload(layers, [0, 2])
    ids = {id(x[1]): i for i, x in enumerate(layers)}
    assert {ids[r] for r in reloaded} == {0, 2}
    todo = wx.layers_to_repack("auto", reloaded, prepacked)
    assert {ids[t] for t in todo} == expect
    # the wrappers are gone: the class methods are back
    assert "process_weights_after_loading" not in vars(method)
    assert "process_weights_after_loading" not in vars(layers[0][2])


def test_tracking_still_calls_the_wrapped_methods():
    method = FakeMethod(fixed=True)
    layers = _layers(method, 1)
    with wx._track_reloaded_moe_layers(layers):
        _reload(layers, [0])
    assert layers[0][2].prepacks == 1


def test_forced_modes_and_mode_parsing(monkeypatch):
    assert wx.layers_to_repack("1", {1, 2}, {2}) == {1, 2}
    assert wx.layers_to_repack("0", {1, 2}, set()) == set()
    assert wx.layers_to_repack("auto", {1, 2}, {2}) == {1}
    monkeypatch.delenv("PDM_VLLM_MOE_REPACK", raising=False)
    assert wx.repack_mode() == "auto"
    assert wx.repack_mode("yes") == "1"
    monkeypatch.setenv("PDM_VLLM_MOE_REPACK", "0")
    assert wx.repack_mode("auto") == "0"
    assert wx.repack_mode("1") == "1"
    monkeypatch.setenv("PDM_VLLM_MOE_REPACK", "sometimes")
    with pytest.raises(ValueError, match="PDM_VLLM_MOE_REPACK"):
        wx.repack_mode()
    with pytest.raises(ValueError, match="repack mode"):
        wx.layers_to_repack("maybe", set(), set())


def test_no_version_list_decides_any_more():
    assert not hasattr(wx, "MOE_REPACK_BUGGY_VERSIONS")
