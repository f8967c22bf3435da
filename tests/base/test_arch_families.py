"""One architecture type for Qwen3-MoE, dense Qwen3 and Llama (megatron_pdm/arch.py): HF config
round trips per family, refusals naming the feature, old MoE dicts unchanged, the printer."""

from __future__ import annotations

import pytest

from megatron_pdm import arch as arch_mod
from megatron_pdm.arch import ModelArch, format_arch
from megatron_pdm.configtree import ConfigError
from megatron_pdm.convert import mapping

SMOLLM2_CONFIG = {  # config.json of the prepared SmolLM2-135M-Instruct (transformers 5)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.02,
    "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "vocab_size": 49152,
}
QWEN3_DENSE_CONFIG = {  # Qwen3-0.6B's shape
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rope_theta": 1000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "use_sliding_window": False, "attention_bias": False, "hidden_act": "silu",
}


def test_the_former_name_is_gone():
    assert not hasattr(arch_mod, "Qwen3MoeArch") and "Qwen3MoeArch" not in arch_mod.__all__


def test_smollm2_config_reads_as_tied_llama_with_the_exact_epsilon():
    arch = ModelArch.from_hf_config(SMOLLM2_CONFIG)
    assert arch == ModelArch.smollm2_135m()
    assert (arch.family, arch.is_moe, arch.qk_layernorm, arch.tie_word_embeddings) == \
        ("llama", False, False, True)
    assert arch.norm_epsilon == 9.999999747378752e-06 and arch.rotary_base == 100000.0
    back = arch.to_hf_config()
    assert back["rms_norm_eps"] == SMOLLM2_CONFIG["rms_norm_eps"]
    assert back["model_type"] == "llama" and back["tie_word_embeddings"] is True
    assert ModelArch.from_hf_config(back) == arch
    # 9 query / 3 KV heads: megatron splits them at TP 1 and 3, not 2; 49152 needs no padding
    assert arch.padded_vocab(3) == 49152


@pytest.mark.parametrize("cfg", [QWEN3_DENSE_CONFIG, dict(QWEN3_DENSE_CONFIG,
                                                          tie_word_embeddings=False)])
def test_dense_qwen3_round_trips_through_its_hf_config(cfg):
    arch = ModelArch.from_hf_config(cfg)
    assert arch.family == "qwen3" and arch.qk_layernorm and arch.ffn_hidden_size == 3072
    assert arch.tie_word_embeddings == cfg["tie_word_embeddings"]
    assert ModelArch.from_hf_config(arch.to_hf_config()) == arch


def test_moe_config_and_old_pdm_model_json_are_unchanged():
    moe = ModelArch.qwen3_30b_a3b()
    assert moe.family == "qwen3_moe" and moe.ffn_hidden_size is None
    assert ModelArch.from_hf_config(moe.to_hf_config()) == moe
    # a pdm_model.json arch written before the dense families (no new keys) loads as before
    old = {k: v for k, v in moe.to_dict().items()
           if k not in ("ffn_hidden_size", "qk_layernorm", "tie_word_embeddings")}
    assert ModelArch.from_dict(old) == moe
    assert ModelArch().family == "qwen3_moe"  # the defaults are today's MoE shape


@pytest.mark.parametrize("change,needle", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
])
def test_unsupported_hf_features_are_refused_by_name(change, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        ModelArch.from_hf_config(dict(SMOLLM2_CONFIG, **change))


def test_sliding_window_qwen3_is_refused():
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelArch.from_hf_config(dict(QWEN3_DENSE_CONFIG, use_sliding_window=True))


def test_field_rules_of_dense_and_moe():
    with pytest.raises(ConfigError, match="needs ffn_hidden_size"):
        ModelArch(num_experts=0)
    with pytest.raises(ConfigError, match="ffn_hidden_size=128 is for dense models"):
        ModelArch(ffn_hidden_size=128)
    with pytest.raises(ConfigError, match="qk_layernorm=false"):
        ModelArch(qk_layernorm=False)
    dense = ModelArch(num_experts=0, ffn_hidden_size=128, moe_router_topk=7)  # MoE field unused
    assert dense.mlp_width == 128
    # the unused MoE fields never make a dense run disagree with its checkpoint
    assert dense.differences(ModelArch(num_experts=0, ffn_hidden_size=128)) == []
    assert dense.differences(ModelArch(num_experts=0, ffn_hidden_size=64)) == \
        ["ffn_hidden_size=128, checkpoint has 64"]


def test_printer_dense_flags():
    flags = format_arch(ModelArch.smollm2_135m(), "flags").split("\n")
    assert flags[flags.index("--ffn-hidden-size") + 1] == "1536"
    for absent in ("--num-experts", "--moe-router-topk", "--qk-layernorm",
                   "--untie-embeddings-and-output-weights", "--moe-router-dtype"):
        assert absent not in flags, absent
    moe = format_arch(ModelArch.qwen3_30b_a3b(), "flags").split("\n")
    assert "--ffn-hidden-size" not in moe and "--untie-embeddings-and-output-weights" in moe
    sets = format_arch(ModelArch.smollm2_135m(), "sets").split("\n")
    pairs = dict(tok.split("=", 1) for tok in sets if tok != "--set")
    assert pairs["model.num_experts"] == "0" and pairs["model.qk_layernorm"] == "false"
    assert pairs["model.tie_word_embeddings"] == "true" and "model.moe_router_topk" not in pairs


def test_mapping_names_follow_the_family():
    llama = ModelArch(vocab_size=100, num_experts=0, ffn_hidden_size=96, qk_layernorm=False,
                      tie_word_embeddings=True, head_dim=16, num_layers=1)
    hf = mapping.hf_shapes(llama, "per_expert")
    assert "lm_head.weight" not in hf and "model.layers.0.self_attn.q_norm.weight" not in hf
    assert hf["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    mc = mapping.canonical_shapes(llama)
    assert "output_layer.weight" not in mc and "decoder.layers.0.mlp.router.weight" not in mc
    assert mc["decoder.layers.0.mlp.linear_fc1.weight"] == (192, 64)
    assert mapping.hf_output_name(llama) == "model.embed_tokens.weight"
    groups = dict(mapping.hf_group_names(llama))
    assert groups["head"] == ["decoder.final_layernorm.weight"]


def test_a_run_checkpoint_written_before_the_dense_fields_still_resumes():
    """An older manifest's identity lacks the dense families' model fields: it reads as the MoE
    defaults (resume.saved_identity), while a dense run is still refused against it."""
    from pathlib import Path

    from megatron_pdm.mcore import ckpt_files
    from megatron_pdm.train import resume
    from megatron_pdm.train.config import RunConfig

    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml"
    current = resume.identity(RunConfig.load(str(tiny), []), 2)
    old = {k: v for k, v in current.items()
           if k not in {f"model.{n}" for n in resume.LATER_MODEL_FIELDS}}
    with pytest.raises(ckpt_files.CheckpointError, match="model.qk_layernorm"):
        ckpt_files.check_identity(old, current, "ckpt")  # without the rule
    ckpt_files.check_identity(resume.saved_identity(old), current, "ckpt")
    dense = dict(current, **{"model.num_experts": 0, "model.ffn_hidden_size": 96})
    with pytest.raises(ckpt_files.CheckpointError, match="model.ffn_hidden_size"):
        ckpt_files.check_identity(resume.saved_identity(old), dense, "ckpt")
