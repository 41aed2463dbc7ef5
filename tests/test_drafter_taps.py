"""Drafter context taps: DFlash `target_layer_ids` in any order, repeats included, pair with a target.

Upstream DFlash builds its context by taking the hidden state after each listed target layer, in list
order, repeats included, and concatenating them on the feature axis; its default rule for a 4-layer
target with 2 draft layers gives [1, 1]. The reference here is that concatenation done by hand from
single-layer taps of the target, then fc and the hidden norm in float64.
"""


import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import ar, spec
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ConfigError, ModelConfig
from helpers import random_params
from tests.test_drafter import _dflash_tensors, _write_dflash_checkpoint

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=8, qk_norm=True)


def upstream_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's documented default spacing: from 1 to L-3, one id per draft layer, rounded."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _layer_outputs(tp, tokens):
    """[L] arrays [B, T, H]: each decoder layer's output, from a target tapping that layer alone."""
    outs = []
    for layer in range(TARGET.num_layers):
        cfg = TARGET.with_taps((layer,))
        state = dense.init_state(cfg, tokens.shape[0], tokens.shape[1], jnp.float32)
        _, taps, _ = dense.chain_forward(tp, cfg, tokens, state)
        outs.append(np.asarray(taps, np.float64))
    return outs


def _reference_context(dp, dcfg, outs):
    cat = np.concatenate([outs[i] for i in dcfg.tap_layers], axis=-1)  # upstream's concatenation
    x = cat @ np.asarray(dp["fc"], np.float64)
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + dcfg.rms_norm_eps)
    return x * np.asarray(dp["hidden_norm"], np.float64)


@pytest.fixture(scope="module")
def target_params():
    return random_params(dense.param_shapes(TARGET), 0.3, 0)


def test_upstream_rule_repeats_a_layer():
    assert upstream_default_layer_ids(4, 2) == [1, 1]


@pytest.mark.parametrize("layer_ids", [(1, 1), (2, 0, 2), (3, 1)])
def test_context_is_upstream_concatenation(target_params, layer_ids):
    dcfg = dr.DrafterConfig.for_target(TARGET, num_layers=1, block_size=4, tap_layers=layer_ids)
    assert dcfg.num_taps == len(layer_ids)  # fc reads one H-slice per listed id
    target = TARGET.with_taps(dcfg.tap_layers)
    dr.BlockDrafter(dcfg, target)  # pairs
    dp = random_params(dr.param_shapes(dcfg), 0.3, 1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TARGET.vocab_size, (2, 5)), jnp.int32)
    _, taps, _ = dense.chain_forward(target_params, target, tokens, dense.init_state(target, 2, 5, jnp.float32))
    got = dr.context_features(dp, dcfg, taps)
    want = _reference_context(dp, dcfg, _layer_outputs(target_params, tokens))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


def test_dflash_checkpoint_with_repeated_ids_loads_and_pairs(tmp_path):
    h, heads, kvh, d, inter = 32, 4, 2, 8, 48
    tensors = _dflash_tensors(np.random.default_rng(0), h=h, n_taps=2, layers=2, heads=heads, kv_heads=kvh,
                              d=d, inter=inter)
    hf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4,
          "dflash_config": {"mask_token_id": 63, "target_layer_ids": upstream_default_layer_ids(4, 2)},
          "head_dim": d, "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
          "num_hidden_layers": 2, "num_key_value_heads": kvh, "num_target_layers": 4, "vocab_size": 64}
    _write_dflash_checkpoint(tmp_path, hf, tensors)
    _, dcfg = dr.load_drafter(tmp_path)
    assert dcfg.tap_layers == (1, 1)
    assert dcfg.to_hf_dict()["dflash_config"]["target_layer_ids"] == [1, 1]
    dr.BlockDrafter(dcfg, TARGET.with_taps(dcfg.tap_layers))


def test_mismatch_error_suggests_a_call_that_works():
    dcfg = dr.DrafterConfig.for_target(TARGET, num_layers=1, block_size=4, tap_layers=(2, 0, 2))
    with pytest.raises(ConfigError, match=r"with_taps\(\(2, 0, 2\)\)"):
        dr.BlockDrafter(dcfg, TARGET.with_taps((0,)))
    dr.BlockDrafter(dcfg, TARGET.with_taps((2, 0, 2)))  # the suggested call


def test_target_taps_each_layer_once_in_layer_order():
    assert TARGET.with_taps((2, 0, 2)).tap_layers == (0, 2)
    with pytest.raises(ConfigError, match="with_taps"):
        ModelConfig(**{**TARGET.__dict__, "tap_layers": (1, 1)})


@pytest.mark.slow
def test_repeated_ids_decode_losslessly(target_params):
    dcfg = dr.DrafterConfig.for_target(TARGET, num_layers=1, block_size=4, tap_layers=(1, 1))
    target = TARGET.with_taps(dcfg.tap_layers)
    dp = random_params(dr.param_shapes(dcfg), 0.3, 1)
    prompts = [[1, 2, 3], [5, 9, 11, 40, 7]]
    t = dense.target(target, jnp.float32)
    want = ar.generate(t, target_params, prompts, 8).tokens
    got = spec.generate(t, target_params, dr.BlockDrafter(dcfg, target), dp, prompts, 8, block_size=4)
    np.testing.assert_array_equal(got.tokens, want)
