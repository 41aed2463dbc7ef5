"""Tensor- and data-parallel decoding on simulated CPU devices (conftest sets 4).

Every check compares a sharded run with the same computation on one device: greedy tokens must be
identical (float32 tiny models with peaked logits, so summation-order differences of the all-reduces
cannot flip a choice), and shardings are inspected directly, not inferred from outputs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import random_params
from specpilot import sharding
from specpilot.decoding import ar, spec
from specpilot.models import checkpoint, dense, hybrid
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.models.hybrid_config import HybridConfig
from specpilot.plan import PlanError, build
from specpilot.state import AttentionState, RecurrentState

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
HYBRID = HybridConfig.from_hf_dict(dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=128, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    full_attention_interval=2, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}))
HYBRID = dataclasses.replace(HYBRID, tap_layers=(1, 3))
PROMPTS = [[1, 2, 3, 9, 4], [5, 9, 11, 40, 7, 3]]
N = 12


def _mesh(data, tensor):
    return sharding.make_mesh(sharding.MeshShape(data=data, tensor=tensor))


@pytest.fixture(scope="module")
def dense_params():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def dense_ar(dense_params):
    return ar.generate(dense.target(CFG, jnp.float32), dense_params, PROMPTS, N + 10).tokens


def _spec(d):
    return jax.tree.map(lambda x: x.sharding.spec, d)


def test_params_are_split_megatron_style(dense_params):
    mesh = _mesh(1, 2)
    placed = sharding.shard_params(dense_params, mesh)
    layer = placed["layers"][0]
    assert layer["q"].sharding.spec == P(None, "tensor") and layer["gate"].sharding.spec == P(None, "tensor")
    assert layer["o"].sharding.spec == P("tensor", None) and layer["down"].sharding.spec == P("tensor", None)
    assert placed["embed"].sharding.spec == P("tensor", None)  # the (tied) head over the vocabulary
    assert layer["attn_norm"].sharding.spec == P() and layer["q_norm"].sharding.spec == P()
    # each device holds its half: q's columns are heads 0-1 on one device and 2-3 on the other
    shards = sorted(layer["q"].addressable_shards, key=lambda s: s.device.id)
    assert [s.data.shape for s in shards] == [(64, 32), (64, 32)]
    np.testing.assert_array_equal(np.asarray(shards[1].data), np.asarray(dense_params["layers"][0]["q"])[:, 32:])


def test_unfuse_inverts_fuse(dense_params):
    fused = dense.fuse_projections(dense_params)
    assert "qkv" in fused["layers"][0] and "q" not in fused["layers"][0]
    back = sharding.unfuse_projections(fused, CFG)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(dense_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("data,tensor", [(1, 2), (2, 1), (2, 2)])
def test_sharded_ar_equals_one_device(dense_params, dense_ar, data, tensor):
    mesh = _mesh(data, tensor)
    target = dense.target(CFG, jnp.float32, mesh)
    state = target.init_state(len(PROMPTS), 64)
    assert state.layers[0].k.sharding.spec == P("data", "tensor", None, None)  # [B, KVH, S, D]
    assert state.lengths.sharding.spec == P("data")
    res = ar.generate(target, sharding.shard_params(dense_params, mesh), PROMPTS, N)
    np.testing.assert_array_equal(res.tokens, dense_ar[:, :N])


def test_sharded_chain_equals_ar(dense_params, dense_ar):
    mesh = _mesh(2, 2)
    target = dense.target(CFG, jnp.float32, mesh)
    params = sharding.shard_params(dense_params, mesh)
    reference = jnp.asarray(dr.replay_reference(PROMPTS, dense_ar.tolist()))
    replay = dr.ReplayDrafter(CFG.vocab_size, 8, shift=1, wrong_every=3).with_mesh(mesh)
    res = spec.generate(target, params, replay, reference, PROMPTS, N, block_size=4)
    np.testing.assert_array_equal(res.tokens, dense_ar[:, :N])
    assert 1.0 < res.stats.tau < 4  # partial acceptances: the commit path runs sharded
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=4)
    dparams = random_params(dr.param_shapes(dcfg), 0.5, 1)
    block = dr.BlockDrafter(dcfg, CFG).with_mesh(mesh)
    assert block.init_state(dparams, 2, 64).layers[0].k.sharding.spec == P("data", "tensor", None, None)  # [B, KVH, S, D]
    res = spec.generate(target, params, block, sharding.shard_params(dparams, mesh), PROMPTS, N, block_size=4)
    np.testing.assert_array_equal(res.tokens, dense_ar[:, :N])


@pytest.mark.slow
def test_sharded_hybrid_ar_and_chain_equal_one_device():
    params = hybrid.init_wide_margin(jax.random.key(0), HYBRID, dtype=jnp.float32)
    want = ar.generate(hybrid.target(HYBRID, jnp.float32), params, PROMPTS, N + 10).tokens
    mesh = _mesh(1, 2)
    target = hybrid.target(HYBRID, jnp.float32, mesh=mesh)
    state = target.init_state(len(PROMPTS), 64)
    recurrent = [layer for layer in state.layers if isinstance(layer, RecurrentState)][0]
    assert recurrent.matrix.sharding.spec == P("data", "tensor", None, None)
    assert recurrent.matrix_snapshots.sharding.spec == P("data", None, "tensor", None, None)
    placed = sharding.shard_params(params, mesh)
    assert placed["layers"][0]["out"].sharding.spec == P("tensor", None)
    assert placed["layers"][0]["qkv"].sharding.spec == P()  # [q | k | v] is not grouped by head
    np.testing.assert_array_equal(ar.generate(target, placed, PROMPTS, N).tokens, want[:, :N])
    reference = jnp.asarray(dr.replay_reference(PROMPTS, want.tolist()))
    replay = dr.ReplayDrafter(HYBRID.vocab_size, 8, shift=1, wrong_every=3)
    res = spec.generate(target, placed, replay, reference, PROMPTS, N, block_size=4)
    np.testing.assert_array_equal(res.tokens, want[:, :N])


def test_checkpoint_loads_straight_into_shardings(tmp_path, dense_params):
    cfg = dataclasses.replace(CFG, tap_layers=())
    path = checkpoint.save_hf(dense_params, cfg, tmp_path / "ckpt")
    plain, _ = checkpoint.load_hf(path, jnp.float32)
    mesh = _mesh(1, 4)
    loaded, _ = checkpoint.load_hf(path, jnp.float32, mesh=mesh)
    for name in ("q", "o", "attn_norm"):
        arr = loaded["layers"][1][name]
        assert arr.sharding == NamedSharding(mesh, sharding.param_spec(name, arr.ndim))
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(plain["layers"][1][name]))
    q = loaded["layers"][1]["q"]
    assert {s.data.shape for s in q.addressable_shards} == {(64, 16)}  # each device got a quarter
    assert loaded["embed"].sharding.spec == P("tensor", None)


@pytest.mark.parametrize("shape,field", [(sharding.MeshShape(tensor=3), "num_heads"),
                                         (sharding.MeshShape(tensor=4), "num_kv_heads"),
                                         (sharding.MeshShape(data=4), "batch size")])
def test_meshes_that_do_not_divide_fail_naming_what(shape, field):
    with pytest.raises(sharding.MeshError, match=field):
        sharding.check_mesh(shape, CFG, batch_size=2, where="decoding.plans.x.mesh")


def test_bad_meshes_and_plans_fail_clearly():
    with pytest.raises(sharding.MeshError, match="needs 8 devices; jax sees 4"):
        _mesh(2, 4)
    with pytest.raises(sharding.MeshError, match="positive integer"):
        sharding.MeshShape(tensor=0)
    with pytest.raises(PlanError, match=r"decoding.plans.s.mesh: .*bf16"):
        build("s", {"verify": "ar", "weights": "w12", "mesh": {"tensor": 2}}, drafter_block_size=None,
              default_matmul={"w12": ["xla"]})
    with pytest.raises(PlanError, match=r"decoding.plans.s.mesh: unknown key"):
        build("s", {"verify": "ar", "mesh": {"pipeline": 2}}, drafter_block_size=None, default_matmul={"bf16": ["xla"]})
    plan = build("s", {"verify": "ar", "mesh": {"tensor": 2}}, drafter_block_size=None,
                 default_matmul={"bf16": ["mosaic", "xla"]})
    assert plan.kernels.matmul.implementation == ("xla",) and plan.mesh.describe() == "1x2"
    assert plan.describe()["mesh"] == {"data": 1, "tensor": 2}


def test_state_specs_cover_every_state_array():
    state = hybrid.target(HYBRID, jnp.float32).init_state(2, 32)
    specs = sharding.state_specs(state)
    for layer, spec in zip(state.layers, specs.layers):
        for array, p in zip(jax.tree.leaves(layer), jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, P))):
            assert len(p) == array.ndim  # every axis named (None or a mesh axis)
        assert isinstance(spec, type(layer)) and isinstance(layer, (AttentionState, RecurrentState))


def test_device_groups_are_disjoint_and_make_meshes():
    groups = sharding.device_groups(sharding.MeshShape(tensor=2))
    assert [len(g) for g in groups] == [2, 2]
    assert not set(map(id, groups[0])) & set(map(id, groups[1]))
    mesh = sharding.make_mesh(sharding.MeshShape(tensor=2), devices=groups[1])
    assert list(mesh.devices.flat) == groups[1]
    assert len(sharding.device_groups(sharding.MeshShape(data=3))) == 1  # the fourth device is left over
    with pytest.raises(sharding.MeshError, match="needs 8 devices"):
        sharding.device_groups(sharding.MeshShape(tensor=8))
