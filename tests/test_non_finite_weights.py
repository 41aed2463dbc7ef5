"""A checkpoint holding a NaN or Inf weight is refused at load, the error naming the tensor.

Such a model would load silently and make every logit NaN (greedy decoding then emits token 0).
Checkpoints are written with safetensors itself and one value is replaced, so each case breaks exactly
one tensor.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specpilot.models import drafter as dr
from specpilot.models.checkpoint import CheckpointError, load_hf, save_hf
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import load_model, save_model
from specpilot.models import dense

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, qk_norm=True)


def _params(cfg_shapes, seed=0):
    rng = np.random.default_rng(seed)

    def draw(shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    out = {k: draw(v) for k, v in cfg_shapes.items() if k != "layers"}
    out["layers"] = tuple({k: draw(v) for k, v in layer.items()} for layer in cfg_shapes["layers"])
    return out


def _poison(path, key, value, dtype=None):
    """Rewrite path/model.safetensors with one element of `key` set to `value` (stored as dtype)."""
    tensors = load_file(str(path / "model.safetensors"))
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    flat = tensors[key].reshape(-1).copy()
    flat[flat.size // 2] = value
    tensors[key] = flat.reshape(tensors[key].shape)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def target_dir(tmp_path):

    save_hf(_params(dense.param_shapes(TARGET)), TARGET, tmp_path / "target")
    return tmp_path / "target"


@pytest.mark.parametrize("key, value", [
    ("model.layers.1.mlp.down_proj.weight", np.nan),
    ("lm_head.weight", np.inf),
    ("model.norm.weight", -np.inf),
])
@pytest.mark.parametrize("stored", [None, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_target_with_a_non_finite_weight_is_refused(target_dir, key, value, stored):
    load_hf(target_dir)  # loads before the damage
    _poison(target_dir, key, value, stored)
    for dtype in (jnp.bfloat16, jnp.float32, None):
        kind = "NaN" if np.isnan(value) else "Inf"
        with pytest.raises(CheckpointError, match=rf"tensor {key} holds non-finite values \(1 {kind} of"):
            load_hf(target_dir, dtype=dtype)


def test_weight_that_overflows_the_load_dtype_is_refused(target_dir):
    # float32's largest value is finite as stored but rounds to Inf in bfloat16.
    _poison(target_dir, "model.layers.0.self_attn.k_proj.weight", np.finfo(np.float32).max)
    load_hf(target_dir, dtype=jnp.float32)
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*bfloat16"):
        load_hf(target_dir, dtype=jnp.bfloat16)


@pytest.mark.parametrize("key, value", [("layers.0.mlp.up_proj.weight", np.nan),
                                        ("fc.weight", np.inf)])
def test_drafter_with_a_non_finite_weight_is_refused(tmp_path, key, value):
    dcfg = dr.DrafterConfig.for_target(TARGET, num_layers=1, block_size=4)
    dr.save_drafter(tmp_path, _params(dr.param_shapes(dcfg)), dcfg)
    dr.load_drafter(tmp_path)
    _poison(tmp_path, key, value)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    kind = "NaN" if np.isnan(value) else "Inf"
    with pytest.raises(dr.DrafterCheckpointError,
                       match=rf"tensor {key} holds non-finite values \(1 {kind} of"):
        dr.load_drafter(tmp_path)


def test_model_folder_with_a_nan_weight_is_refused(tmp_path):

    params = _params(dense.param_shapes(TARGET))
    save_model(tmp_path / "model", params, TARGET)
    load_model(tmp_path / "model")
    layer1 = dict(params["layers"][1], up=params["layers"][1]["up"].at[3, 5].set(jnp.nan))
    bad = dict(params, layers=(params["layers"][0], layer1))
    save_model(tmp_path / "model", bad, TARGET)
    with pytest.raises(CheckpointError, match=r"param layers/1/up holds non-finite values \(1 NaN of"):
        load_model(tmp_path / "model")
