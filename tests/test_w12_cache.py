"""The on-disk cache of W12 encodings (`specpilot.formats.w12_cache`): a second encode of the same weights
loads the entry instead of encoding and gives the same fields; other weights or settings get their own
entry; a corrupt, truncated or stale entry is rebuilt, never used; writes leave no temporary file and old
entries go past the size budget."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from specpilot import formats
from specpilot.formats import w12, w12_cache


def _params(seed: int = 0) -> dict:
    """Two layers of fused matrices (one layer's `o` without exceptions), a head with many exceptions (kept
    bf16 by the 1% rule) and the non-matrix leaves an encoder leaves alone."""
    rng = np.random.default_rng(seed)

    def normal(k, n):
        return jnp.asarray((rng.standard_normal((k, n)) * 0.02).astype(jnp.bfloat16))

    layers = tuple({"qkv": normal(128, 192), "o": normal(64, 128) if i else jnp.full((64, 128), 0.5, jnp.bfloat16),
                    "input_norm": jnp.ones((128,), jnp.bfloat16)} for i in range(2))
    wild = rng.integers(0, 65536, (128, 256), dtype=np.uint16)
    return {"layers": layers, "embed": normal(256, 128), "lm_head": jnp.asarray(wild.view(jnp.bfloat16))}


def _assert_same_encoding(got: dict, want: dict):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)


def _count_encodes(monkeypatch) -> list:
    calls = []
    real = w12.encode_matrix
    monkeypatch.setattr(w12, "encode_matrix", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_second_encode_loads_the_entry(tmp_path, monkeypatch):
    params = _params()
    want = w12.encode_params(params)
    calls = _count_encodes(monkeypatch)
    first = formats.encode_params(params, "w12", cache_dir=str(tmp_path))
    assert len(calls) == 5
    second = formats.encode_params(params, "w12", cache_dir=str(tmp_path))
    assert len(calls) == 5  # loaded, not encoded
    _assert_same_encoding(first, want)
    _assert_same_encoding(second, want)
    assert second["lm_head"] is params["lm_head"]  # kept bf16: the source itself
    assert second["layers"][0]["o"].num_exceptions == 0 and isinstance(second["layers"][1]["o"], w12.W12)
    assert second["embed"] is params["embed"]
    assert all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(second))
    entries = list((tmp_path / w12_cache.SUBDIR).iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".safetensors"  # no temporary file left
    with safe_open(str(entries[0]), "np") as f:  # a standard safetensors file
        sm = f.get_tensor("layers.1.qkv.sm")
    np.testing.assert_array_equal(sm, np.asarray(want["layers"][1]["qkv"].sm))


def test_other_weights_or_settings_get_their_own_entry(tmp_path, monkeypatch):
    params = _params()
    formats.encode_params(params, "w12", cache_dir=str(tmp_path))
    bits = np.asarray(params["layers"][1]["qkv"]).view(np.uint16).copy()
    bits[7, 9] ^= 1  # one mantissa bit of one weight
    layers = (params["layers"][0], {**params["layers"][1], "qkv": jnp.asarray(bits.view(jnp.bfloat16))})
    changed = {**params, "layers": layers}
    want = w12.encode_params(changed)
    calls = _count_encodes(monkeypatch)
    _assert_same_encoding(formats.encode_params(changed, "w12", cache_dir=str(tmp_path)), want)
    assert len(calls) == 5
    formats.encode_params(params, "w12", cache_dir=str(tmp_path), group_k=16)
    assert len(calls) == 10
    assert len(list((tmp_path / w12_cache.SUBDIR).glob("*.safetensors"))) == 3


def _entry(tmp_path):
    (path,) = (tmp_path / w12_cache.SUBDIR).glob("*.safetensors")
    return path


@pytest.mark.parametrize("damage", ["flip_a_data_byte", "truncate", "garbage", "stale_key"])
def test_a_damaged_entry_is_rebuilt_never_used(tmp_path, monkeypatch, caplog, damage):
    params = _params()
    formats.encode_params(params, "w12", cache_dir=str(tmp_path))
    path = _entry(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip_a_data_byte":
        data[-100] ^= 0x10  # inside the last tensor's bytes
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"\x00" * 64)
    else:  # an entry of other weights under this name
        other = _params(seed=1)
        formats.encode_params(other, "w12", cache_dir=str(tmp_path / "other"))
        data = bytearray(_entry(tmp_path / "other").read_bytes())
    path.write_bytes(bytes(data))
    want = w12.encode_params(params)
    calls = _count_encodes(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=w12_cache.__name__):
        got = formats.encode_params(params, "w12", cache_dir=str(tmp_path))
    assert len(calls) == 5 and "rebuilt" in caplog.text
    _assert_same_encoding(got, want)
    calls.clear()
    _assert_same_encoding(formats.encode_params(params, "w12", cache_dir=str(tmp_path)), want)
    assert not calls  # the rebuilt entry is good


def test_old_entries_go_past_the_budget(tmp_path, monkeypatch):
    for seed in range(3):
        formats.encode_params(_params(seed), "w12", cache_dir=str(tmp_path))
    folder = tmp_path / w12_cache.SUBDIR
    assert len(list(folder.glob("*.safetensors"))) == 3
    size = max(p.stat().st_size for p in folder.glob("*.safetensors"))
    monkeypatch.setattr(w12_cache, "MAX_BYTES", 2 * size)
    formats.encode_params(_params(3), "w12", cache_dir=str(tmp_path))
    assert len(list(folder.glob("*.safetensors"))) == 2


def test_no_cache_dir_and_non_bf16_encode_as_before(tmp_path):
    params = _params()
    _assert_same_encoding(formats.encode_params(params, "w12"), w12.encode_params(params))
    as_f32 = {**params, "lm_head": params["lm_head"].astype(jnp.float32)}
    with pytest.raises(TypeError, match="bf16"):
        formats.encode_params(as_f32, "w12", cache_dir=str(tmp_path))
    assert not (tmp_path / w12_cache.SUBDIR).exists()
