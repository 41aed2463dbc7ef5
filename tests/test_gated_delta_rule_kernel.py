"""The gated delta rule's Pallas kernel (interpret mode on the CPU) against its jnp reference and a float64
brute force, its fall-through, its lowering for CUDA, and the plan's choice reaching a hybrid target.

Written tolerance: KERNEL_ATOL = 1e-5 absolute (plus KERNEL_RTOL = 1e-5 relative) on outputs and states of
unit scale. Both sides form the same float32 products; the kernel sums each reduction over DK (<= 128
here) in another order than XLA's dot, which changes a sum by a few ulps of its largest partial sums
(~1e-6 at magnitudes ~ a few), and a state's error carries on through T <= 16 tokens while e^g <= 1 and
the delta update (I - beta k k^T, a contraction for |k| = 1) shrink it. A wrong kernel (a lost decay, a
missing token, a swapped axis) is off by O(1).
"""

import csv
import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pallas_kernels import dispatch
from pallas_kernels import gated_delta_rule as gdr
from specpilot import state as st
from specpilot.harness import config_schema, deploy
from specpilot.harness.config_schema import ConfigValueError, build_plans, typed, validate

KERNEL_ATOL = 1e-5
KERNEL_RTOL = 1e-5
INTERPRET = gdr.GatedDeltaRuleTritonConfig(interpret=True)
CONF = Path(__file__).resolve().parents[1] / "conf"
config_schema.register()


def _inputs(b, t, h, dk, dv, seed, g_range=(0.0, 0.5), beta=None):
    """Normalised q (scaled) and k as the layer feeds them, unit-scale v and initial state."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.normal(size=(b, t, h, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(b, t, h, dk)))
    v = rng.normal(size=(b, t, h, dv))
    g = -rng.uniform(*g_range, size=(b, t, h))
    beta = rng.uniform(0.0, 1.0, size=(b, t, h)) if beta is None else beta(rng, (b, t, h))
    s0 = rng.normal(size=(b, h, dk, dv))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0))


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=KERNEL_ATOL, rtol=KERNEL_RTOL)


CASES = [  # (B, T, H, DK, DV, block_v)
    (2, 1, 3, 16, 32, 16),  # one token (decode)
    (2, 3, 2, 16, 32, 32),  # T not a power of two
    (1, 8, 2, 32, 16, 16),  # DK > DV
    (2, 16, 2, 16, 64, 16),  # four value blocks per head
    (1, 5, 4, 64, 32, 8),
]


@pytest.mark.parametrize("b, t, h, dk, dv, block_v", CASES)
def test_kernel_equals_reference(b, t, h, dk, dv, block_v):
    x = _inputs(b, t, h, dk, dv, seed=t)
    o, states = gdr.gated_delta_rule(*x, dataclasses.replace(INTERPRET, block_v=block_v))
    assert o.shape == (b, t, h, dv) and states.shape == (b, t, h, dk, dv)  # exactly T tokens, no padding
    o_ref, states_ref = gdr.gated_delta_rule_reference(*x)
    _close(o, o_ref)
    _close(states, states_ref)


def test_kernel_is_the_rule_as_written():
    """Brute force in float64 numpy, strong decay (e^g down to e^-30) and beta exactly 0 or 1."""
    x = _inputs(2, 6, 2, 8, 16, seed=3, g_range=(0.0, 30.0),
                beta=lambda rng, shape: rng.integers(0, 2, size=shape).astype(np.float64))
    assert set(np.unique(np.asarray(x[4]))) == {0.0, 1.0}
    o, states = gdr.gated_delta_rule(*x, dataclasses.replace(INTERPRET, block_v=8))
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in x)
    for t in range(6):
        decayed = np.exp(g[:, t])[..., None, None] * s  # [B, H, DK, DV]
        predicted = np.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        s = decayed + np.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t][..., None] * (v[:, t] - predicted))
        _close(states[:, t], s)
        _close(o[:, t], np.einsum("bhkv,bhk->bhv", s, q[:, t]))


def test_skipped_tokens_leave_the_state_unchanged():
    """g = beta = 0 (how the layer skips padding) is the identity on S in the kernel too."""
    q, k, v, g, beta, s0 = _inputs(1, 7, 2, 16, 16, seed=4)
    live = (jnp.arange(7) < 3)[None, :, None]
    _, states = gdr.gated_delta_rule(q, k, v, jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0), s0,
                                     INTERPRET)
    for t in range(3, 7):
        np.testing.assert_array_equal(np.asarray(states[:, t]), np.asarray(states[:, 2]))


def test_what_the_kernel_cannot_take_raises_not_implemented():
    x = _inputs(1, 2, 2, 16, 16, seed=5)
    q, k, v, g, beta, s0 = x
    odd_k = _inputs(1, 2, 2, 24, 16, seed=5)
    with pytest.raises(NotImplementedError, match="power-of-two head dims, got DK 24"):
        gdr.gated_delta_rule(*odd_k, INTERPRET)
    with pytest.raises(NotImplementedError, match="DV 48"):
        gdr.gated_delta_rule(*_inputs(1, 2, 2, 16, 48, seed=5), INTERPRET)
    with pytest.raises(NotImplementedError, match="float32 inputs, got.*bfloat16"):
        gdr.gated_delta_rule(q, k, v.astype(jnp.bfloat16), g, beta, s0, INTERPRET)
    with pytest.raises(NotImplementedError, match="runs on GPUs .*not 'cpu'"):
        gdr.gated_delta_rule(*x)  # interpret=False on a CPU backend
    with pytest.raises(ValueError, match=r"initial_state \(1, 2, 16, 8\) must be"):
        gdr.gated_delta_rule(q, k, v, g, beta, s0[..., :8], INTERPRET)
    with pytest.raises(ValueError, match="block_v must be a power of two, got 24"):
        gdr.GatedDeltaRuleTritonConfig(block_v=24)


def _has_pallas_call(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_tries_the_choice_in_order_and_falls_through():
    x = _inputs(2, 4, 2, 16, 32, seed=6)
    want = gdr.gated_delta_rule_reference(*x)
    # on the CPU without interpret the kernel refuses: [triton, xla] runs the reference, exactly
    fallback = dispatch.choice("gated_delta_rule", ["triton", "xla"])
    got = dispatch.gated_delta_rule(*x, choice=fallback)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not _has_pallas_call(lambda *a: dispatch.gated_delta_rule(*a, choice=fallback), *x)
    with pytest.raises(NotImplementedError, match=r"no gated_delta_rule implementation of \('triton',\).*triton: "):
        dispatch.gated_delta_rule(*x, choice=dispatch.choice("gated_delta_rule", "triton"))
    # interpreted, the kernel takes it
    kernel = dispatch.choice("gated_delta_rule", ["triton", "xla"], {"interpret": True, "block_v": 16})
    assert kernel.config == gdr.GatedDeltaRuleTritonConfig(block_v=16, interpret=True)
    assert _has_pallas_call(lambda *a: dispatch.gated_delta_rule(*a, choice=kernel), *x)
    for a, b in zip(dispatch.gated_delta_rule(*x, choice=kernel), want):
        _close(a, b)
    # no choice: the reference
    assert not _has_pallas_call(lambda *a: dispatch.gated_delta_rule(*a), *x)
    with pytest.raises(ValueError, match="unknown gated_delta_rule implementation.*'mosaic'.*known: triton, xla"):
        dispatch.choice("gated_delta_rule", ["mosaic"])
    with pytest.raises(ValueError, match="unknown key.*'block_n'.*gated_delta_rule 'triton' config"):
        dispatch.choice("gated_delta_rule", "triton", {"block_n": 16})


def _lower_for_cuda(b, t, h, dk, dv):
    f32 = jnp.float32
    shapes = [(b, t, h, dk), (b, t, h, dk), (b, t, h, dv), (b, t, h), (b, t, h), (b, h, dk, dv)]
    return jax.jit(lambda *a: gdr.gated_delta_rule_pallas(*a, block_v=32)).trace(
        *(jax.ShapeDtypeStruct(s, f32) for s in shapes)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("b, t", [(1, 16), (8, 3)])
def test_real_shape_lowers_for_cuda(b, t):
    """Qwen3.5-27B's linear layers (48 value heads, DK = DV = 128) lower to Triton IR from this CPU machine:
    every tensor shape and op of the kernel is one the Triton backend takes (T = 3: no power of two)."""
    assert "triton" in _lower_for_cuda(b, t, 48, 128, 128).as_text()
    # the Triton lowering checks tensor shapes itself (a non-power-of-two DK fails there), so it can fail
    with pytest.raises(ValueError, match="power of 2"):
        _lower_for_cuda(b, t, 48, 96, 128)


# --------------------------------------------------------------------------------------------------
# The plan's choice reaches the model


def _compose(overrides):
    base = ["target=tiny_hybrid", "drafter=random", "drafter.num_layers=1", "drafter.num_taps=2",
            "decoding=stock", "bench=default"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=[*base, *overrides]))


def test_gpu_defaults_and_plan_overrides():
    # a gpu's default reaches every plan that names none (the H200's is the kernel, timed there; the other
    # GPUs keep the recurrence until it is timed on them)
    on_h200 = build_plans(_compose(["gpu=h200"]))
    assert {p.kernels.gated_delta_rule.implementation for p in on_h200} == {("triton", "xla")}
    assert {p.kernels.gated_delta_rule.implementation for p in build_plans(_compose(["gpu=h100"]))} == {("xla",)}
    on_h200_xla = build_plans(_compose(["gpu=h200", "gpu.gated_delta_rule=[xla]"]))
    assert {p.kernels.gated_delta_rule.implementation for p in on_h200_xla} == {("xla",)}
    assert {p.kernels.gated_delta_rule.implementation for p in build_plans(_compose(["gpu=cpu"]))} == {("xla",)}
    cfg = _compose(["gpu=cpu",
                    "decoding.plans.stock.kernels.gated_delta_rule.implementation=[triton,xla]",
                    "+decoding.plans.stock.kernels.gated_delta_rule.config.block_v=8"])
    validate(cfg)
    [plan] = [p for p in build_plans(cfg) if p.name == "stock"]
    assert plan.kernels.gated_delta_rule == dispatch.OpChoice(("triton", "xla"),
                                                              gdr.GatedDeltaRuleTritonConfig(block_v=8))
    assert plan.describe()["kernels"]["gated_delta_rule"] == {
        "implementation": ["triton", "xla"],
        "config": {"block_v": 8, "num_warps": 4, "num_stages": 1, "interpret": False}}


@pytest.mark.parametrize("override,match", [
    ("decoding.plans.stock.kernels.gated_delta_rule.implementation=[cuda]",
     "decoding.plans.stock.kernels.gated_delta_rule: unknown gated_delta_rule implementation.*'cuda'"),
    ("decoding.plans.stock.kernels.gated_delta_rule.implementation=[]",
     "decoding.plans.stock.kernels.gated_delta_rule: .*name at least one implementation"),
    ("+decoding.plans.stock.kernels.gated_delta_rule.config.block_k=8",
     "decoding.plans.stock.kernels.gated_delta_rule: unknown key.*'block_k'"),
    ("gpu.gated_delta_rule=[mosaic]", "gpu.gated_delta_rule: 'mosaic' is not one of"),
])
def test_impossible_choices_fail_naming_the_field(override, match):
    with pytest.raises(ConfigValueError, match=match):
        validate(_compose(["gpu=cpu", override]))


def test_the_plans_kernel_runs_in_the_hybrid_forward():
    """Through the deployment (`cfg_for`, `target_for`): a verification-sized chain forward of the tiny
    hybrid with the kernel (interpreted) equals the one with the reference, and the kernel ran."""
    cfg = _compose(["gpu=cpu",
                    "decoding.plans.stock.kernels.gated_delta_rule.implementation=[triton,xla]",
                    "+decoding.plans.stock.kernels.gated_delta_rule.config.interpret=true"])
    plans = {p.name: p for p in build_plans(cfg)}
    dep = deploy.build(cfg, list(plans.values()))
    assert dep.cfg_for(plans["stock"]).gated_delta_rule == plans["stock"].kernels.gated_delta_rule
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, dep.cfg.vocab_size, size=(2, 5)), jnp.int32)

    def run(plan, trace=False):
        target, params = dep.target_for(plan), dep.params_for(plan)
        fn = jax.jit(lambda p, x, s: st.chain_forward(target, p, x, s))
        state = target.init_state(2, 32)
        if trace:
            return "pallas_call" in str(jax.make_jaxpr(fn)(params, tokens, state))
        return fn(params, tokens, state)

    assert run(plans["stock"], trace=True) and not run(plans["ar"], trace=True)
    (logits, _, state), (want_logits, _, want_state) = run(plans["stock"]), run(plans["ar"])
    _close(logits, want_logits)
    linear = [i for i, kind in enumerate(dep.cfg.layer_types) if kind == "linear_attention"]
    for i in linear:
        _close(state.layers[i].matrix_snapshots[:, :5], want_state.layers[i].matrix_snapshots[:, :5])


def test_bench_smoke_writes_checked_rows(tmp_path):
    """experiments/bench/bench_gated_delta_rule.py --smoke: a reference row and a row per config, each kernel row
    checked against the reference on the device, the bytes counted as the docstring says."""
    spec = importlib.util.spec_from_file_location(
        "bench_gated_delta_rule", Path(__file__).resolve().parents[1] / "experiments" / "bench" / "bench_gated_delta_rule.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gdr.csv"
    bench.main(["--smoke", "--batch", "2", "--tokens", "3", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["impl"], r["block_v"]) for r in rows] == [("xla", ""), ("triton", "16"), ("triton", "32")]
    b, t, h, dk, dv = 2, 3, 2, 16, 32
    state_floats = b * h * dk * dv * (1 + t)  # S0 read, T states written
    small_floats = b * t * h * (dk + dk + dv + 1 + 1) + b * t * h * dv  # q k v g beta read, o written
    assert {int(r["bytes"]) for r in rows} == {4 * (state_floats + small_floats)}
    for r in rows[1:]:
        assert float(r["max_abs_err_o"]) < KERNEL_ATOL and float(r["max_abs_err_states"]) < KERNEL_ATOL
        assert float(r["us_per_call"]) > 0
