"""Checkpoint I/O: bit-exact round trips and one clear error per kind of bad input.

Design choices:
- Params come from `dense.init` with every leaf redrawn (init leaves norms at one and biases at zero,
  which would let a swapped norm or bias round-trip unnoticed). No transformers and no jit here, so
  the file runs in a few seconds; agreement with transformers lives in test_dense_vs_hf.py.
- Bad checkpoints are made by editing a good one with safetensors itself, so each test breaks exactly
  one thing and asserts the error names it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specpilot import atomic_io
from specpilot.models import checkpoint, dense, hf_files
from specpilot.models.checkpoint import CheckpointError, load_hf, save_hf
from specpilot.models.config import ModelConfig, RopeScaling
from specpilot.training.checkpointing import Checkpointer, abstract_of

QWEN3 = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=32, qk_norm=True, architecture="Qwen3ForCausalLM",
                    eos_token_id=3)
LLAMA_TIED = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=16, attention_bias=True, mlp_bias=True,
                         tie_word_embeddings=True, architecture="LlamaForCausalLM", rope_theta=5e5,
                         rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16), bos_token_id=1)
SHARD_BYTES = 40_000  # the f32 Qwen3 model above is ~0.5 MB: about a dozen shards


def random_params(cfg: ModelConfig, dtype, seed: int = 0):
    """Every leaf of `dense.param_shapes(cfg)` drawn from N(0, 1) (numpy: no per-shape compiles)."""
    rng = np.random.default_rng(seed)

    def draw(shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)

    shapes = dense.param_shapes(cfg)
    params = {k: draw(v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = tuple({k: draw(v) for k, v in layer.items()} for layer in shapes["layers"])
    return params


def assert_bit_equal(a, b):
    fa, ta = jax.tree_util.tree_flatten_with_path(a)
    fb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype, path
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=str(path))


@pytest.fixture
def good(tmp_path):
    """A valid single-file f32 Qwen3 checkpoint directory."""
    save_hf(random_params(QWEN3, jnp.float32), QWEN3, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_tensors(path, edit):
    """Rewrite model.safetensors after `edit(dict of numpy arrays)`."""
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(path, edit):
    hf = json.loads((path / "config.json").read_text())
    edit(hf)
    (path / "config.json").write_text(json.dumps(hf))


def _error(path, **kw) -> str:
    with pytest.raises(CheckpointError) as info:
        load_hf(path, **kw)
    return str(info.value)


# ------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA_TIED], ids=["qwen3", "llama_tied_bias_rope"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("shard_bytes", [None, SHARD_BYTES], ids=["single", "sharded"])
def test_round_trip_is_bit_exact(cfg, dtype, shard_bytes, tmp_path):
    params = random_params(cfg, dtype)
    save_hf(params, cfg, tmp_path, max_shard_bytes=shard_bytes)
    loaded, loaded_cfg = load_hf(tmp_path, dtype=dtype)
    assert_bit_equal(loaded, params)
    assert loaded_cfg == cfg
    kept, _ = load_hf(tmp_path, dtype=None)  # None keeps the stored dtype
    assert_bit_equal(kept, params)
    if shard_bytes is not None:
        index = json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) > 1 and not (tmp_path / checkpoint.SINGLE_FILE).exists()
        assert index["metadata"]["total_size"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def test_default_dtype_is_bf16_and_taps_reach_config(good):
    params, cfg = load_hf(good, tap_layers=(1,))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert cfg.tap_layers == (1,)
    f32, _ = load_hf(good, dtype=jnp.float32)
    assert_bit_equal(params, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), f32))


def test_resave_replaces_other_layout(tmp_path):
    params = random_params(QWEN3, jnp.bfloat16)
    save_hf(params, QWEN3, tmp_path, max_shard_bytes=SHARD_BYTES)
    save_hf(params, QWEN3, tmp_path)  # a leftover index would shadow the new single file
    assert not (tmp_path / checkpoint.INDEX_FILE).exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))
    assert_bit_equal(load_hf(tmp_path)[0], params)


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
    params = random_params(LLAMA_TIED, jnp.bfloat16)
    save_hf(params, LLAMA_TIED, tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    assert_bit_equal(load_hf(tmp_path)[0], params)
    _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] * 2}))
    assert "lm_head.weight differs" in _error(tmp_path)


def test_rotary_inv_freq_buffers_are_ignored(good):
    _edit_tensors(good, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(16, np.float32)}))
    load_hf(good)


# ------------------------------------------------------------------------------------------------
# Bad input: one error each, naming the problem, raised before any tensor is read


@pytest.fixture
def no_tensor_reads(monkeypatch):
    def fail(*_):
        raise AssertionError("tensor data was read before the checkpoint was validated")
    monkeypatch.setattr(hf_files, "read_tensors", fail)


def test_missing_path(tmp_path):
    assert "does not exist" in _error(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in _error(tmp_path / "file")


def test_missing_or_bad_config(good):
    (good / "config.json").write_text("{not json")
    assert "not valid JSON" in _error(good)
    (good / "config.json").unlink()
    assert "no config.json" in _error(good)


def test_unsupported_architecture(good):
    _edit_config(good, lambda hf: hf.update(architectures=["MistralForCausalLM"], model_type="mistral"))
    msg = _error(good)
    assert "unsupported architecture" in msg and "MistralForCausalLM" in msg


def test_missing_key(good, no_tensor_reads):
    _edit_tensors(good, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    msg = _error(good)
    assert "missing key(s): model.layers.1.mlp.up_proj.weight" in msg


def test_unexpected_key(good, no_tensor_reads):
    _edit_tensors(good, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    assert "unexpected key(s): model.layers.0.mlp.extra.weight" in _error(good)


def test_config_with_more_layers_than_checkpoint(good, no_tensor_reads):
    _edit_config(good, lambda hf: hf.update(num_hidden_layers=3))
    msg = _error(good)
    assert "missing key(s): model.layers.2." in msg


def test_shape_mismatch_names_key_and_shapes(good, no_tensor_reads):
    _edit_tensors(good, lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)}))
    msg = _error(good)
    assert "shape mismatch for model.layers.0.self_attn.q_proj.weight" in msg
    assert "expected (128, 64), got (64, 64)" in msg  # HF [out, in] layout


def test_non_float_tensor(good, no_tensor_reads):
    _edit_tensors(good, lambda t: t.update(
        {"model.norm.weight": np.zeros(64, np.int32)}))
    assert "model.norm.weight has dtype I32" in _error(good)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_malformed_safetensors(good, damage, no_tensor_reads):
    path = good / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100] if damage == "truncated" else b"\x07" * 64)
    msg = _error(good)
    assert "malformed or truncated safetensors file" in msg and "model.safetensors" in msg


def test_no_weights(good):
    (good / "model.safetensors").unlink()
    assert "no model.safetensors" in _error(good)


def test_index_naming_missing_shard(tmp_path, no_tensor_reads):
    save_hf(random_params(QWEN3, jnp.float32), QWEN3, tmp_path, max_shard_bytes=SHARD_BYTES)
    second = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    second.unlink()
    msg = _error(tmp_path)
    assert "missing shard" in msg and second.name in msg


def test_index_disagreeing_with_shard(tmp_path, no_tensor_reads):
    save_hf(random_params(QWEN3, jnp.float32), QWEN3, tmp_path, max_shard_bytes=SHARD_BYTES)
    index = json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())
    first = sorted(tmp_path.glob("model-*-of-*.safetensors"))[0].name
    key = "model.layers.1.mlp.down_proj.weight"
    assert index["weight_map"][key] != first
    index["weight_map"][key] = first
    (tmp_path / checkpoint.INDEX_FILE).write_text(json.dumps(index))
    assert "index disagrees with shard" in _error(tmp_path)
    (tmp_path / checkpoint.INDEX_FILE).write_text("{")
    assert "malformed index" in _error(tmp_path)


def _sharded_with(tmp_path, rename):
    """A sharded checkpoint whose index names `rename(first shard's name)` for the first shard's keys."""
    root = tmp_path / "ckpt"
    save_hf(random_params(QWEN3, jnp.float32), QWEN3, root, max_shard_bytes=SHARD_BYTES)
    index = json.loads((root / checkpoint.INDEX_FILE).read_text())
    first = sorted(root.glob("model-*-of-*.safetensors"))[0]
    name = rename(first)
    index["weight_map"] = {k: name if v == first.name else v for k, v in index["weight_map"].items()}
    (root / checkpoint.INDEX_FILE).write_text(json.dumps(index))
    return root, first


def test_index_may_not_name_files_outside_the_folder(tmp_path, no_tensor_reads):
    def up_one(first):
        first.rename(tmp_path / "outside.safetensors")
        return "../outside.safetensors"

    root, _ = _sharded_with(tmp_path, up_one)
    msg = _error(root)
    assert "outside the checkpoint folder" in msg and "../outside.safetensors" in msg
    root, _ = _sharded_with(tmp_path / "abs", lambda first: str(first.rename(tmp_path / "abs.safetensors")))
    assert "outside the checkpoint folder" in _error(root)


def test_index_may_not_name_a_link_that_leaves_the_folder(tmp_path, no_tensor_reads):
    def link_out(first):
        target = first.rename(tmp_path / "elsewhere.safetensors")
        first.symlink_to(target)
        return first.name

    root, _ = _sharded_with(tmp_path, link_out)
    msg = _error(root)
    assert "a link to" in msg and "elsewhere.safetensors" in msg


def test_a_hub_snapshot_linking_into_its_blobs_loads(tmp_path):
    """The Hugging Face hub cache's layout: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    params = random_params(QWEN3, jnp.float32)
    built = tmp_path / "built"
    save_hf(params, QWEN3, built, max_shard_bytes=SHARD_BYTES)
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(built.iterdir())):
        f.rename(blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    loaded, _ = load_hf(snapshot, dtype=None)
    assert_bit_equal(loaded, params)


def test_shards_without_index(tmp_path):
    save_hf(random_params(QWEN3, jnp.float32), QWEN3, tmp_path, max_shard_bytes=SHARD_BYTES)
    (tmp_path / checkpoint.INDEX_FILE).unlink()
    assert "neither model.safetensors nor" in _error(tmp_path)


def test_save_rejects_params_that_do_not_match_config(tmp_path):
    params = random_params(QWEN3, jnp.float32)
    other = dataclasses.replace(QWEN3, hidden_size=32)
    with pytest.raises(CheckpointError, match="expected shape"):
        save_hf(params, other, tmp_path)
    with pytest.raises(CheckpointError, match="layers"):
        save_hf({**params, "layers": params["layers"][:1]}, QWEN3, tmp_path)
    assert not (tmp_path / "config.json").exists()  # nothing written for bad params


def test_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


# ------------------------------------------------------------------------------------------------
# Training checkpoints


def test_a_damaged_training_step_is_removed_and_the_older_one_resumed(tmp_path):
    state = {"w": jnp.arange(64.0), "step": jnp.zeros((), jnp.int32)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {"seed": 0})
        ckpt.save(2, {"w": state["w"] + 1, "step": state["step"] + 2}, {"seed": 0})
    for f in (tmp_path / "2" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:10])  # the array data cut short after orbax committed the step
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="different settings"):  # another experiment: never discarded
            ckpt.restore_latest(abstract_of(state), {"seed": 1})
        with pytest.warns(atomic_io.CacheRebuildWarning, match="step 2 .* is unreadable"):
            step, restored, saved = ckpt.restore_latest(abstract_of(state), {"seed": 0})
        assert step == 1 and saved == {"seed": 0} and ckpt.latest_step() == 1
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert int(restored["step"]) == 0


def test_saved_checkpoints_are_readable_by_all(good, tmp_path):
    # safetensors writes owner-only; a sandboxed candidate runs as a uid of its own and must read them
    save_hf(random_params(QWEN3, jnp.float32), QWEN3, tmp_path / "sharded", max_shard_bytes=SHARD_BYTES)
    for folder in (good, tmp_path / "sharded"):
        files = [f for f in folder.iterdir() if f.is_file()]
        assert any(f.suffix == ".safetensors" for f in files)
        assert all(f.stat().st_mode & 0o044 == 0o044 for f in files), folder
