"""Hybrid (Qwen3.5) config and checkpoint loading: both HF layouts, and every error named."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import hf_tiny_hybrid as hth
from specpilot import state as st
from specpilot.models import checkpoint, hybrid
from specpilot.models.checkpoint import CheckpointError
from specpilot.models.config import ConfigError
from specpilot.models.hybrid_config import HybridConfig

LOGITS_ATOL = 3e-4  # as tests/test_hybrid.py: float32 logits of magnitude ~5-8


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return hth.save(hth.build("grouped_v_heads"), tmp_path_factory.mktemp("causal"))


@pytest.fixture
def good(text_dir, tmp_path):
    """A fresh copy of the Qwen3_5ForCausalLM checkpoint to break."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        (out / f).write_bytes((Path(text_dir) / f).read_bytes())
    return out


def _edit_tensors(root, edit):
    tensors = load_file(str(root / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})


def _error(root) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_hf(root, jnp.float32)
    return str(e.value)


def test_causal_lm_layout_loads_through_load_hf_and_load_target(text_dir):
    params, cfg = checkpoint.load_hf(text_dir, jnp.float32)
    assert isinstance(cfg, HybridConfig) and cfg.architecture == "Qwen3_5ForCausalLM"
    target, same = checkpoint.load_target(text_dir, jnp.bfloat16)
    assert isinstance(target, hybrid.Target) and target.dtype == "bfloat16"
    assert same["layers"][0]["conv"].dtype == jnp.bfloat16
    model = hth.build("grouped_v_heads")
    conv = model.model.layers[0].linear_attn.conv1d.weight.detach().numpy()  # [C, 1, W]
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["conv"]), conv[:, 0, :].T)


def test_multimodal_layout_loads_the_text_model_and_ignores_the_vision_tower(tmp_path):
    model = hth.build_multimodal("equal_heads_tied")
    path = hth.save(model, tmp_path / "vl")
    keys = load_file(str(tmp_path / "vl" / "model.safetensors")).keys()
    assert any(k.startswith("model.visual.") for k in keys)
    target, params = checkpoint.load_target(path, jnp.float32)
    assert target.cfg.architecture == "Qwen3_5ForConditionalGeneration"
    assert target.cfg.tie_word_embeddings and "lm_head" not in params
    tokens = np.random.default_rng(0).integers(1, hth.VOCAB, size=(1, 70))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    chain_forward = jax.jit(lambda p, x, s: st.chain_forward(target, p, x, s)[0])  # not op by op
    logits = chain_forward(params, jnp.asarray(tokens, jnp.int32), target.init_state(1, 72))
    np.testing.assert_allclose(np.asarray(logits), ref, atol=LOGITS_ATOL, rtol=0)


def test_missing_tensor_is_named(good):
    _edit_tensors(good, lambda t: t.pop("model.layers.0.linear_attn.A_log"))
    msg = _error(good)
    assert "missing key(s): model.layers.0.linear_attn.A_log" in msg


def test_unexpected_tensor_is_named_but_mtp_and_vision_are_ignored(good):
    def add(t):
        t["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
        t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((2, 2), np.float32)
    _edit_tensors(good, add)
    params, _ = checkpoint.load_hf(good, jnp.float32)
    _edit_tensors(good, lambda t: t.update({"model.layers.0.linear_attn.extra": np.zeros(3, np.float32)}))
    assert "unexpected key(s): model.layers.0.linear_attn.extra" in _error(good)


def test_wrong_shape_is_named(good):
    _edit_tensors(good, lambda t: t.update({"model.layers.3.self_attn.q_proj.weight": np.zeros((64, 64),
                                                                                              np.float32)}))
    msg = _error(good)
    assert "shape mismatch for model.layers.3.self_attn.q_proj.weight: expected (128, 64)" in msg


def test_conv_weight_with_the_wrong_kernel_is_named(good):
    _edit_tensors(good, lambda t: t.update({"model.layers.1.linear_attn.conv1d.weight":
                                            np.zeros((80, 1, 3), np.float32)}))
    want = "shape mismatch for model.layers.1.linear_attn.conv1d.weight: expected (80, 1, 4), got (80, 1, 3)"
    assert want in _error(good)


def test_non_finite_tensor_is_named(good):
    def poison(t):
        t["model.layers.2.linear_attn.dt_bias"][1] = np.nan
    _edit_tensors(good, poison)
    msg = _error(good)
    assert "model.layers.2.linear_attn.dt_bias" in msg and "1 NaN" in msg


def test_overflow_in_the_requested_dtype_is_named(good):
    def huge(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = 3e38  # finite in float32, not in float16
    _edit_tensors(good, huge)
    with pytest.raises(CheckpointError, match="up_proj.weight holds non-finite values .* overflow"):
        checkpoint.load_hf(good, jnp.float16)


def test_bad_config_is_refused_with_the_field_named(good):
    hf = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps(dict(hf, layer_types=["linear_attention"] * 4)))
    assert "at least one full_attention layer" in _error(good)
    (good / "config.json").write_text(json.dumps(dict(hf, layer_types=["linear_attention", "mamba",
                                                                         "full_attention", "x"])))
    assert "unsupported layer type(s) ['mamba', 'x']" in _error(good)


# --------------------------------------------------------------------------------------------------
# Config


def test_config_defaults_follow_transformers():
    hf = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 2, "head_dim": 16}
    cfg = HybridConfig.from_hf_dict(hf)
    assert cfg.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 4 and cfg.rope_theta == 10000.0
    assert HybridConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": dict(hf),
          "vision_config": {"depth": 2}, "tie_word_embeddings": True}
    vl_cfg = HybridConfig.from_hf_dict(vl)
    assert vl_cfg.tie_word_embeddings and vl_cfg.layer_types == cfg.layer_types
    with pytest.raises(ConfigError, match="text_config"):
        HybridConfig.from_hf_dict({"architectures": ["Qwen3_5ForConditionalGeneration"]})
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        HybridConfig.from_hf_dict(dict(hf, linear_num_key_heads=3, linear_num_value_heads=4))
    with pytest.raises(ConfigError, match="rotary_dim"):
        HybridConfig.from_hf_dict(dict(hf, rope_parameters={"partial_rotary_factor": 0.01}))
