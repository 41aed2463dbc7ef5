"""Block drafter: cached drafting equals a cache-free float64 recomputation; DFlash checkpoint I/O."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ConfigError, ModelConfig
from helpers import random_params

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, tap_layers=(0, 2))
DCFG = dr.DrafterConfig.for_target(CFG, num_layers=2, block_size=4)


@pytest.fixture(scope="module")
def params():
    tp = random_params(dense.param_shapes(CFG), 0.3, 0)
    dp = random_params(dr.param_shapes(DCFG), 0.3, 1)
    # Non-uniform norm weights, so a norm applied to the wrong tensor cannot go unnoticed.
    rng = np.random.default_rng(2)
    return tp, jax.tree.map(lambda x: x * (1 + 0.3 * rng.standard_normal(x.shape, np.float32))
                            if x.ndim == 1 else x, dp)


# ------------------------------------------------------------------------------------------------
# float64 reference: DFlash's formulation with no cache — context K/V recomputed from all taps and
# concatenated with the block's K/V, no mask.


def _np(x):
    return np.asarray(x, np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _np(w)


def _rope(x, pos, theta):  # x [T, N, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def reference_hidden(dp, tp, taps, block):
    """taps [L, n*H] (context at positions 0..L-1), block [Bs] -> final hidden [Bs, H]."""
    c, eps, d = DCFG, DCFG.rms_norm_eps, DCFG.head_dim
    ctx = _rms(_np(taps) @ _np(dp["fc"]), dp["hidden_norm"], eps)  # [L, H]
    x = _np(tp["embed"])[block]  # [Bs, H]
    n_ctx, bs = ctx.shape[0], x.shape[0]
    pos = np.arange(n_ctx + bs, dtype=np.float64)
    for lp in dp["layers"]:
        h = _rms(x, lp["attn_norm"], eps)
        q = _rope(_rms((h @ _np(lp["q"])).reshape(bs, c.num_heads, d), lp["q_norm"], eps), pos[n_ctx:],
                  c.rope_theta)
        src = np.concatenate([ctx, h])  # context rows skip the layer's input norm, as in DFlash
        k = _rope(_rms((src @ _np(lp["k"])).reshape(-1, c.num_kv_heads, d), lp["k_norm"], eps), pos,
                  c.rope_theta)
        v = (src @ _np(lp["v"])).reshape(-1, c.num_kv_heads, d)
        rep = c.num_heads // c.num_kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # [S, N, D]
        s = np.einsum("tnd,snd->nts", q, k) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snd->tnd", p, v).reshape(bs, -1) @ _np(lp["o"])
        h = _rms(x, lp["mlp_norm"], eps)
        g = h @ _np(lp["gate"])
        x = x + (g / (1 + np.exp(-g)) * (h @ _np(lp["up"]))) @ _np(lp["down"])
    return _rms(x, dp["norm"], eps)


def test_cached_drafting_matches_reference(params):
    tp, dp = params
    rng = np.random.default_rng(0)
    b, bs, max_len = 2, DCFG.block_size, 32
    taps = rng.normal(size=(b, 20, DCFG.num_taps * CFG.hidden_size)).astype(np.float32)
    drafter = dr.BlockDrafter(DCFG, CFG)
    state = drafter.init_state(dp, b, max_len, jnp.float32)
    lengths = np.array([5, 9])
    # Prompt of different lengths per row (right-padded taps), then two verified blocks with
    # different accepted counts per row; each draft must see exactly the committed context.
    feeds = [(taps[:, :9], lengths), (None, np.array([3, 1])), (None, np.array([4, 2]))]
    committed = np.zeros(b, int)
    for step, (chunk, n_new) in enumerate(feeds):
        if chunk is None:  # a verified block: its rows are the taps at the next Bs positions
            chunk = np.stack([taps[i, committed[i]:committed[i] + bs] for i in range(b)])
        state = drafter.extend(dp, tp, state, jnp.asarray(chunk), jnp.asarray(n_new, jnp.int32))
        committed += n_new
        last = jnp.asarray(rng.integers(0, CFG.vocab_size, b), jnp.int32)
        block = jnp.concatenate([last[:, None], jnp.full((b, bs - 1), DCFG.mask_token_id)], 1)
        hidden, state = dr.draft_block(dp, DCFG, tp, CFG, state, block)
        for i in range(b):
            want = reference_hidden(dp, tp, taps[i, : committed[i]], np.asarray(block[i]))
            np.testing.assert_allclose(np.asarray(hidden[i]), want, rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {step} row {i}")
        np.testing.assert_array_equal(np.asarray(state.lengths), committed)
    logits, _ = drafter.propose(dp, tp, state, last, bs)
    assert logits.shape == (b, bs - 1, CFG.vocab_size)


def test_config_validation():
    with pytest.raises(ConfigError, match="with_taps"):
        dr.BlockDrafter(DCFG, CFG.with_taps((0, 1)))
    with pytest.raises(ConfigError, match="mask_token_id"):
        dataclasses.replace(DCFG, mask_token_id=CFG.vocab_size)
    with pytest.raises(ConfigError, match="tap layers"):
        dataclasses.replace(DCFG, tap_layers=(0, 3))
    with pytest.raises(ConfigError, match="hidden"):
        dr.BlockDrafter(dataclasses.replace(DCFG, hidden_size=64), CFG)
    assert dr.DrafterConfig.from_hf_dict(DCFG.to_hf_dict()) == DCFG
    hf = DCFG.to_hf_dict()
    del hf["num_target_layers"]  # older DFlash configs lack it: taps are still checked against the target
    assert dr.DrafterConfig.from_hf_dict(hf).num_target_layers is None
    dr.BlockDrafter(dr.DrafterConfig.from_hf_dict(hf), CFG)
    with pytest.raises(ConfigError, match="tapping"):
        dr.BlockDrafter(dr.DrafterConfig.from_hf_dict(dict(hf, dflash_config={
            "mask_token_id": 3, "target_layer_ids": [0, 5]})), CFG)


# ------------------------------------------------------------------------------------------------
# DFlash checkpoint format


def test_save_load_roundtrip_in_dflash_layout(params, tmp_path):
    _, dp = params
    dp16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), dp)
    dr.save_drafter(tmp_path, dp16, DCFG)
    # readable by all: a sandboxed candidate (a uid of its own) loads the drafter
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in tmp_path.iterdir() if f.is_file())
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"] == {"block_size": 4, "mask_token_id": CFG.vocab_size - 1,
                                   "target_layer_ids": [0, 2]}
    with safe_open(str(tmp_path / "model.safetensors"), framework="flax") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    h, kv = CFG.hidden_size, DCFG.num_kv_heads * DCFG.head_dim
    assert shapes["fc.weight"] == (h, 2 * h)  # torch [out, in]
    assert shapes["layers.1.self_attn.k_proj.weight"] == (kv, h)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (DCFG.head_dim,)
    assert {"hidden_norm.weight", "norm.weight", "layers.1.mlp.down_proj.weight"} <= set(shapes)
    assert len(shapes) == 3 + 2 * 11
    loaded, cfg = dr.load_drafter(tmp_path)
    assert cfg == DCFG
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(dp16)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _write_dflash_checkpoint(path, hf_cfg, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_cfg))
    save_file(tensors, str(path / "model.safetensors"))


def _dflash_tensors(rng, h=32, n_taps=2, layers=1, heads=4, kv_heads=2, d=8, inter=48):
    """A checkpoint written the way DFlash's PyTorch code names and lays out its weights."""
    t = {"fc.weight": rng.normal(size=(h, n_taps * h)), "hidden_norm.weight": rng.normal(size=h),
         "norm.weight": rng.normal(size=h)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": rng.normal(size=h),
                  p + "post_attention_layernorm.weight": rng.normal(size=h),
                  p + "self_attn.q_proj.weight": rng.normal(size=(heads * d, h)),
                  p + "self_attn.k_proj.weight": rng.normal(size=(kv_heads * d, h)),
                  p + "self_attn.v_proj.weight": rng.normal(size=(kv_heads * d, h)),
                  p + "self_attn.o_proj.weight": rng.normal(size=(h, heads * d)),
                  p + "self_attn.q_norm.weight": rng.normal(size=d),
                  p + "self_attn.k_norm.weight": rng.normal(size=d),
                  p + "mlp.gate_proj.weight": rng.normal(size=(inter, h)),
                  p + "mlp.up_proj.weight": rng.normal(size=(inter, h)),
                  p + "mlp.down_proj.weight": rng.normal(size=(h, inter))})
    return {k: v.astype(np.float32) for k, v in t.items()}


DFLASH_CONFIG = {  # shaped like z-lab's published Qwen3 DFlash configs, at toy size
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
    "block_size": 16, "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]},
    "head_dim": 8, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48,
    "layer_types": ["full_attention"], "max_position_embeddings": 40960, "num_attention_heads": 4,
    "num_hidden_layers": 1, "num_key_value_heads": 2, "num_target_layers": 3, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "tie_word_embeddings": False, "vocab_size": 96,
}


def test_loads_a_dflash_checkpoint(tmp_path):
    tensors = _dflash_tensors(np.random.default_rng(0))
    _write_dflash_checkpoint(tmp_path, DFLASH_CONFIG, tensors)
    p, cfg = dr.load_drafter(tmp_path)
    assert (cfg.block_size, cfg.mask_token_id, cfg.tap_layers, cfg.num_layers) == (16, 95, (0, 2), 1)
    np.testing.assert_array_equal(p["fc"], tensors["fc.weight"].T)
    np.testing.assert_array_equal(p["layers"][0]["k"], tensors["layers.0.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(p["layers"][0]["attn_norm"],
                                  tensors["layers.0.input_layernorm.weight"])
    dr.BlockDrafter(cfg, CFG)  # compatible with the 3-layer target tapping (0, 2)


@pytest.mark.parametrize("breakage, error, match", [
    ("missing_tensor", dr.DrafterCheckpointError, "missing.*layers.0.mlp.up_proj.weight"),
    ("extra_tensor", dr.DrafterCheckpointError, "unexpected.*candidate_selector"),
    ("bad_shape", dr.DrafterCheckpointError, "fc.weight has shape"),
    ("dflash2", ConfigError, "DFlash2DraftModel"),
    ("no_mask", ConfigError, "mask_token_id"),
    ("sliding", ConfigError, "sliding"),
    ("no_config", dr.DrafterCheckpointError, "no config.json"),
    ("no_weights", dr.DrafterCheckpointError, "no \\*.safetensors"),
    ("corrupt", dr.DrafterCheckpointError, "not a readable safetensors"),
])
def test_bad_checkpoints_fail_clearly(tmp_path, breakage, error, match):
    hf = json.loads(json.dumps(DFLASH_CONFIG))
    tensors = _dflash_tensors(np.random.default_rng(0))
    if breakage == "missing_tensor":
        del tensors["layers.0.mlp.up_proj.weight"]
    elif breakage == "extra_tensor":
        tensors["candidate_selector.hidden_projection.weight"] = np.zeros((4, 32), np.float32)
    elif breakage == "bad_shape":
        tensors["fc.weight"] = tensors["fc.weight"].T.copy()
    elif breakage == "dflash2":
        hf["architectures"] = ["DFlash2DraftModel"]
    elif breakage == "no_mask":
        del hf["dflash_config"]["mask_token_id"]
    elif breakage == "sliding":
        hf["layer_types"] = ["sliding_attention"]
    _write_dflash_checkpoint(tmp_path, hf, tensors)
    if breakage == "no_config":
        (tmp_path / "config.json").unlink()
    elif breakage == "no_weights":
        (tmp_path / "model.safetensors").unlink()
    elif breakage == "corrupt":
        (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(error, match=match):
        dr.load_drafter(tmp_path)


def test_context_cache_dtype_follows_the_drafter(params):
    _, dp = params
    state = dr.BlockDrafter(DCFG, CFG).init_state(dp, 2, 8)  # float32 drafter: float32 K/V
    assert {leaf.dtype for leaf in jax.tree.leaves(state.layers)} == {jnp.dtype(jnp.float32)}
    assert state.max_len == 8 and state.lengths.tolist() == [0, 0]
    with pytest.raises(ValueError, match="dtype must be given"):
        dr.init_context_cache(DCFG, 2, 8)


def test_drafting_wider_than_the_plan_keeps_its_first_rows_and_writes_only_those(params):
    """draft_width: the block drafted as wide as the drafter was trained (every row sees all mask rows, as
    in training), the plan's first rows kept; the cache holds only the kept rows' K/V."""
    tp, dp = params
    rng = np.random.default_rng(3)
    b, max_len, keep = 2, 16, 2
    taps = rng.normal(size=(b, 6, DCFG.num_taps * CFG.hidden_size)).astype(np.float32)
    wide = dr.BlockDrafter(DCFG, CFG, draft_width=DCFG.block_size)
    state = wide.init_state(dp, b, max_len, jnp.float32)
    state = wide.extend(dp, tp, state, jnp.asarray(taps), jnp.asarray([6, 4], jnp.int32))
    last = jnp.asarray([3, 7], jnp.int32)
    logits, after = wide.propose(dp, tp, state, last, keep)
    assert logits.shape == (b, keep - 1, CFG.vocab_size)
    narrow, _ = dr.BlockDrafter(DCFG, CFG).propose(dp, tp, state, last, keep)
    for i, n in enumerate((6, 4)):
        block = np.array([int(last[i])] + [DCFG.mask_token_id] * (DCFG.block_size - 1))
        hidden = reference_hidden(dp, tp, taps[i, :n], block)  # the full-width block, cache-free
        want = np.asarray(dense.lm_head(tp, CFG, jnp.asarray(hidden[1:keep], jnp.float32)))
        np.testing.assert_allclose(np.asarray(logits[i]), want, rtol=1e-4, atol=1e-4)
        assert not np.allclose(np.asarray(narrow[i]), want, rtol=1e-4, atol=1e-4)  # the width matters
        for layer in after.layers:  # the kept rows written, the slots past them untouched
            assert np.abs(np.asarray(layer.k[i, :, n:n + keep])).sum() > 0
            assert np.abs(np.asarray(layer.k[i, :, n + keep:])).sum() == 0
