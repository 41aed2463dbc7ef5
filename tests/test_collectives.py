"""The collectives a sharded step performs: counted by the cost model, read out of XLA's compiled HLO.

Sharded forwards of tiny dense and hybrid targets are compiled on simulated CPU devices (conftest: 4);
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute of the HLO is listed, and
the cost model's list must match it in kind, count and size (no tolerance: these are integers).
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from helpers import random_params
from specpilot import sharding
from specpilot import state as st
from specpilot.costmodel import collectives, counts
from specpilot.costmodel.roofline import Hardware
from specpilot.costmodel.prediction import Setting, predict
from specpilot.costmodel.rates import Rates
from specpilot.models import dense, hybrid
from specpilot.plan import build
from test_sharding import CFG, HYBRID

OP = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                r"(?:-start)?\(")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2}


def hlo_collectives(target, params, batch, tokens) -> collections.Counter:
    """(kind, bytes) -> count over the compiled HLO of one chain forward."""
    state = target.init_state(batch, 32)
    fn = jax.jit(lambda p, tok, s: st.chain_forward(target, p, tok, s)[0])
    text = fn.lower(params, jnp.zeros((batch, tokens), jnp.int32), state).compile().as_text()
    out = collections.Counter()
    for dtype, dims, kind in OP.findall(text):
        size = BYTES[dtype]
        for d in filter(None, dims.split(",")):
            size *= int(d)
        out[(kind, size)] += 1
    return out


def model_collectives(cfg, mesh, batch, tokens) -> collections.Counter:
    out = collections.Counter()
    for c in collectives.forward_collectives(cfg, mesh, batch, tokens, act_bytes=4, argmax=False):
        out[(c.kind, c.bytes_each)] += c.count
    return out


@pytest.mark.parametrize("data,tensor,tokens", [(1, 2, 4), (1, 4, 1), (2, 2, 3), (2, 1, 4)])
def test_dense_forward_collectives_match_the_hlo(data, tensor, tokens):
    shape = sharding.MeshShape(data=data, tensor=tensor)
    mesh = sharding.make_mesh(shape)
    cfg = dataclasses.replace(CFG, num_kv_heads=4) if tensor == 4 else CFG  # 4 devices need 4 KV heads
    params = sharding.shard_params(random_params(dense.param_shapes(cfg), 0.5, 0), mesh)
    got = hlo_collectives(dense.target(cfg, jnp.float32, mesh), params, 2, tokens)
    assert got == model_collectives(cfg, shape, 2, tokens)


def test_hybrid_forward_collectives_match_the_hlo():
    shape = sharding.MeshShape(tensor=2)
    mesh = sharding.make_mesh(shape)
    params = sharding.shard_params(hybrid.init(jax.random.key(0), HYBRID, jnp.float32), mesh)
    got = hlo_collectives(hybrid.target(HYBRID, jnp.float32, mesh=mesh), params, 2, 4)
    want = model_collectives(HYBRID, shape, 2, 4)
    assert want == {("all-reduce", 2 * 4 * 64 * 4): 1 + 2 * HYBRID.num_layers}
    assert got == want  # no permutes or gathers: the Gated DeltaNet's sharding hints hold


def test_ring_volume_and_time():
    c = collectives.Collective("x", "all-reduce", 3, 1000, 4)
    assert c.ring_bytes_per_device == pytest.approx(3 * 2 * 0.75 * 1000)
    assert collectives.interconnect_s([c], 1.0, 10.0) == pytest.approx(4500 / 1e9 + 30e-6)
    assert collectives.Collective("x", "all-reduce", 3, 1000, 1).ring_bytes_per_device == 0


def test_per_device_share_splits_weights_and_keeps_replicated_ones():
    plan = build("s", {"verify": "ar", "mesh": {"tensor": 2}}, drafter_block_size=None, default_matmul={"bf16": ["xla"]})
    shape = counts.Shape(target=HYBRID, batch=2, context=8, cache_len=32, dtype_bytes=4, fused=False)
    whole = counts.step_counts(plan, shape)
    share = collectives.per_device(whole, plan.mesh, hybrid=True)
    by_name = lambda c: {k.name: k for k in c.kernels}  # noqa: E731
    w, s = by_name(whole), by_name(share)
    assert s["target.out"].weight_bytes == w["target.out"].weight_bytes / 2 and s["target.out"].k == w["target.out"].k // 2
    assert s["target.gate"].n == w["target.gate"].n // 2
    assert s["target.in_proj_qkv"].weight_bytes == w["target.in_proj_qkv"].weight_bytes  # replicated
    assert s["target.delta_rule"].bytes == w["target.delta_rule"].bytes / 2
    assert s["target.conv"].bytes == w["target.conv"].bytes
    total_w = sum(k.weight_bytes for k in whole.kernels)
    assert sum(k.weight_bytes for k in share.kernels) < 0.75 * total_w


def test_sharded_prediction_adds_the_interconnect_and_needs_its_bandwidth():
    from omegaconf import OmegaConf

    plan = build("s", {"verify": "ar", "mesh": {"tensor": 2}}, drafter_block_size=None, default_matmul={"bf16": ["xla"]})
    shape = counts.Shape(target=dataclasses.replace(CFG, tap_layers=()), batch=1, context=8, cache_len=32, dtype_bytes=4)
    rates = Rates.datasheet(OmegaConf.create({"name": "nowhere", "memory_bandwidth_gbs": 50.0, "matmul_tflops_bf16": 1.0}))
    p = predict(plan, Setting(shape, rates, Hardware(50.0, 1.0, interconnect_gbs=4.0, collective_latency_us=10.0)))
    links = collectives.step_collectives(plan, shape)["verify"]
    assert p.classes["verify"]["interconnect"] == pytest.approx(collectives.interconnect_s(links, 4.0, 10.0))
    one = predict(dataclasses.replace(plan, mesh=sharding.MeshShape()), Setting(shape, rates, Hardware(50.0, 1.0)))
    assert "interconnect" not in one.classes["verify"]
    with pytest.raises(ValueError, match="interconnect_gbs"):
        predict(plan, Setting(shape, rates, Hardware(50.0, 1.0)))
