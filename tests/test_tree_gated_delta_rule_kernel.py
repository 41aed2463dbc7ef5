"""The tree gated-delta-rule Pallas kernel (interpret mode on the CPU) against its reference, the
token-by-token rule on chains and a float64 brute force, its fall-through and lowering for CUDA, and the
plan's tree kernels reaching a hybrid target's tree forward.

Written tolerance: KERNEL_ATOL = KERNEL_RTOL = 1e-5 on outputs and states of unit scale, as for the
token-by-token kernel (tests/test_gated_delta_rule_kernel.py): the same float32 products, each sum over
DK (<= 64 here) in another order than XLA's (a few ulps), carried along a root path of <= 16 nodes by a
contraction. A wrong kernel (a node fed from the wrong parent, a lost decay) is off by O(1).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pallas_kernels import dispatch
from pallas_kernels import gated_delta_rule as gdr
from pallas_kernels import tree_attention as ta
from pallas_kernels import tree_gated_delta_rule as tgdr
from specpilot.harness import config_schema, deploy
from specpilot.harness.config_schema import build_plans, typed, validate
from tests.test_gated_delta_rule_kernel import CONF, _inputs
from tests.test_tree_attention_kernel import _tree_forward, _tree_inputs, random_parents

KERNEL_ATOL = 1e-5
KERNEL_RTOL = 1e-5
INTERPRET = gdr.GatedDeltaRuleTritonConfig(interpret=True)
config_schema.register()


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=KERNEL_ATOL, rtol=KERNEL_RTOL)


def _parents(kind: str, b: int, t: int, seed: int):
    if kind == "chain":
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) - 1, (b, t))
    if kind == "roots":  # every node fed from the committed state (siblings of depth 1 only)
        return jnp.full((b, t), -1, jnp.int32)
    return jnp.asarray(random_parents(np.random.default_rng(seed), b, t))


CASES = [  # (B, T, H, DK, DV, block_v, tree)
    (2, 1, 3, 16, 32, 16, "random"),  # the root alone
    (2, 9, 2, 16, 32, 16, "random"),  # T not a power of two, two value blocks
    (1, 16, 2, 32, 16, 16, "random"),
    (2, 12, 2, 16, 64, 32, "roots"),
    (1, 16, 4, 64, 32, 8, "chain"),
]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])  # compiled: -m gpu
@pytest.mark.parametrize("b, t, h, dk, dv, block_v, tree", CASES)
def test_kernel_equals_reference(b, t, h, dk, dv, block_v, tree, interpret):
    x = _inputs(b, t, h, dk, dv, seed=t)
    parents = _parents(tree, b, t, seed=t)
    config = dataclasses.replace(INTERPRET, block_v=block_v, interpret=interpret)
    o, states = tgdr.tree_gated_delta_rule(*x, parents, config)
    assert o.shape == (b, t, h, dv) and states.shape == (b, t, h, dk, dv)
    o_ref, states_ref = tgdr.tree_gated_delta_rule_reference(*x, parents)
    _close(o, o_ref)
    _close(states, states_ref)


def test_a_chain_is_the_token_by_token_rule():
    """parents i - 1: the kernel and the reference both give the existing token-by-token recurrence."""
    x = _inputs(2, 7, 2, 16, 32, seed=21)
    chain = _parents("chain", 2, 7, seed=0)
    want_o, want_states = gdr.gated_delta_rule_reference(*x)
    for o, states in (tgdr.tree_gated_delta_rule(*x, chain, INTERPRET), tgdr.tree_gated_delta_rule_reference(*x, chain)):
        _close(o, want_o)
        _close(states, want_states)


def test_kernel_is_the_tree_rule_as_written():
    """Brute force in float64 numpy: each node's state recomputed from the initial state along its root
    path (walked through the parents), strong decay and beta exactly 0 or 1."""
    b, t, h, dk, dv = 2, 10, 2, 8, 16
    x = _inputs(b, t, h, dk, dv, seed=22, g_range=(0.0, 30.0),
                beta=lambda rng, shape: rng.integers(0, 2, size=shape).astype(np.float64))
    parents = np.asarray(random_parents(np.random.default_rng(23), b, t))
    o, states = tgdr.tree_gated_delta_rule(*x, jnp.asarray(parents), dataclasses.replace(INTERPRET, block_v=8))
    q, k, v, g, beta, s0 = (np.asarray(a, np.float64) for a in x)
    for r in range(b):
        for i in range(t):
            path, j = [], i
            while j >= 0:
                path.insert(0, j)
                j = parents[r, j]
            s = s0[r]
            for n in path:  # [H, DK, DV]
                s = np.exp(g[r, n])[:, None, None] * s
                predicted = np.einsum("hkv,hk->hv", s, k[r, n])
                s = s + np.einsum("hk,hv->hkv", k[r, n], beta[r, n][:, None] * (v[r, n] - predicted))
            _close(states[r, i], s)
            _close(o[r, i], np.einsum("hkv,hk->hv", s, q[r, i]))


def test_what_the_kernel_cannot_take():
    x = _inputs(1, 3, 2, 16, 16, seed=24)
    parents = _parents("random", 1, 3, seed=24)
    with pytest.raises(NotImplementedError, match="power-of-two head dims, got DK 24"):
        tgdr.tree_gated_delta_rule(*_inputs(1, 3, 2, 24, 16, seed=24), parents, INTERPRET)
    with pytest.raises(NotImplementedError, match="float32 inputs"):
        tgdr.tree_gated_delta_rule(*x[:2], x[2].astype(jnp.bfloat16), *x[3:], parents, INTERPRET)
    with pytest.raises(NotImplementedError, match="runs on GPUs .*not 'cpu'"):
        tgdr.tree_gated_delta_rule(*x, parents)
    with pytest.raises(ValueError, match=r"parents \(1, 2\) must be \[B, T\] = \(1, 3\)"):
        tgdr.tree_gated_delta_rule(*x, parents[:, :2], INTERPRET)


def test_dispatch_tries_the_choice_in_order_and_falls_through():
    x = _inputs(2, 5, 2, 16, 32, seed=25)
    parents = _parents("random", 2, 5, seed=25)
    want = tgdr.tree_gated_delta_rule_reference(*x, parents)
    fallback = dispatch.choice("tree_gated_delta_rule", ["triton", "xla"])
    for a, b in zip(dispatch.tree_gated_delta_rule(*x, parents, choice=fallback), want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(NotImplementedError, match=r"no tree_gated_delta_rule implementation of \('triton',\)"):
        dispatch.tree_gated_delta_rule(*x, parents, choice=dispatch.choice("tree_gated_delta_rule", "triton"))
    kernel = dispatch.choice("tree_gated_delta_rule", ["triton", "xla"], {"interpret": True, "block_v": 16})
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: dispatch.tree_gated_delta_rule(*a, choice=kernel))(
        *x, parents))
    for a, b in zip(dispatch.tree_gated_delta_rule(*x, parents, choice=kernel), want):
        _close(a, b)


@pytest.mark.parametrize("t", [16, 128])
def test_real_shape_lowers_for_cuda(t):
    """Qwen3.5-27B's linear layers (48 value heads, DK = DV = 128) at 16 and 128 nodes, barrier included."""
    f32 = jnp.float32
    shapes = [(1, t, 48, 128)] * 3 + [(1, t, 48)] * 2 + [(1, 48, 128, 128)]
    args = [jax.ShapeDtypeStruct(s, f32) for s in shapes] + [jax.ShapeDtypeStruct((1, t), jnp.int32)]
    lowered = jax.jit(lambda *a: tgdr.tree_gated_delta_rule_pallas(*a)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


# --------------------------------------------------------------------------------------------------
# The plan's tree kernels reach the hybrid target


def _compose(overrides):
    base = ["target=tiny_hybrid", "drafter=random", "drafter.num_layers=1", "drafter.num_taps=2",
            "decoding=stock", "bench=default", "gpu=cpu"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=[*base, *overrides]))


def test_plan_fields_and_gpu_defaults():
    plans = build_plans(_compose(["gpu.tree_gated_delta_rule=[triton,xla]"]))
    assert {p.kernels.tree_gated_delta_rule.implementation for p in plans} == {("triton", "xla")}
    assert {p.kernels.tree_attention.implementation for p in plans} == {("xla",)}
    cfg = _compose(["decoding.plans.stock.kernels.tree_attention.implementation=[triton,xla]",
                    "+decoding.plans.stock.kernels.tree_attention.config.splits=2"])
    validate(cfg)
    [plan] = [p for p in build_plans(cfg) if p.name == "stock"]
    assert plan.kernels.tree_attention == dispatch.OpChoice(("triton", "xla"), ta.TreeAttentionTritonConfig(splits=2))
    assert plan.describe()["kernels"]["tree_attention"]["config"]["splits"] == 2
    for override, match in (("decoding.plans.stock.kernels.tree_attention.implementation=[cuda]",
                             "kernels.tree_attention: unknown tree_attention implementation.*'cuda'"),
                            ("gpu.tree_gated_delta_rule=[mosaic]", "gpu.tree_gated_delta_rule: 'mosaic' is not")):
        with pytest.raises(config_schema.ConfigValueError, match=match):
            validate(_compose([override]))


def test_the_plans_tree_kernels_run_in_the_hybrid_tree_forward():
    """Through the deployment (`cfg_for`, `target_for`): the tiny hybrid's tree forward with both tree
    kernels (interpreted) equals the one with the references, states included, and both kernels ran."""
    cfg = _compose(["decoding.plans.stock.kernels.tree_gated_delta_rule.implementation=[triton,xla]",
                    "+decoding.plans.stock.kernels.tree_gated_delta_rule.config.interpret=true",
                    "decoding.plans.stock.kernels.tree_attention.implementation=[triton,xla]",
                    "+decoding.plans.stock.kernels.tree_attention.config.interpret=true"])
    plans = {p.name: p for p in build_plans(cfg)}
    dep = deploy.build(cfg, list(plans.values()))
    kernels = dep.cfg_for(plans["stock"])
    assert kernels.tree_gated_delta_rule == plans["stock"].kernels.tree_gated_delta_rule
    assert kernels.tree_attention == plans["stock"].kernels.tree_attention
    reference, kernel = dep.target_for(plans["ar"]), dep.target_for(plans["stock"])
    state, tree = _tree_inputs(reference, dep.params, [6, 13], n=12, seed=3)
    (want, _, want_state), traced_ref = _tree_forward(reference, dep.params, state, tree)
    (got, _, got_state), traced = _tree_forward(kernel, dep.params, state, tree)
    assert traced and not traced_ref
    _close(got, want)
    linear = [i for i, kind in enumerate(dep.cfg.layer_types) if kind == "linear_attention"]
    for i in linear:
        _close(got_state.layers[i].matrix_snapshots[:, :12], want_state.layers[i].matrix_snapshots[:, :12])
