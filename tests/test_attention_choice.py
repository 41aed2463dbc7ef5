"""The plan's `kernels.attention` choice: chain attention (decode, chain verification, prefill) through
the ragged kernel (interpreted on the CPU) gives the tokens of the masked attention, on a dense target's
AR and stock plans and in a hybrid's gated attention layers; the lengths and counts read off the state's
masks describe those masks exactly; the kernel's refusals fall through to XLA; bad names are refused.

Written tolerance (hybrid logits): KERNEL_ATOL = KERNEL_RTOL = 2e-5, the ragged kernel's own against its
reference (tests/test_ragged_attention.py): both form the same float32 products, the kernel adds the
softmax block by block with an online rescale (a few ulps per layer). A wrong kernel (a row reading
another row's slots, a count off by one) moves logits by O(0.1). Greedy tokens are compared exactly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pallas_kernels import dispatch
from pallas_kernels import ragged_attention as ra
from specpilot import plan as plan_mod
from specpilot import state as st
from specpilot.agent.space import build_space
from specpilot.decoding import ar, spec
from specpilot.harness import config_schema, deploy
from specpilot.harness.config_schema import build_plans, typed, validate
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.models.drafter import replay_reference
from specpilot.models.layers import chain_counts
from specpilot.models.oracle import OracleDrafter
from tests.test_gated_delta_rule_kernel import CONF

KERNEL_ATOL = 2e-5
KERNEL_RTOL = 2e-5
CACHE_LEN = 64  # a multiple of the kernel's block_s below, so the kernel takes every forward
KERNEL = ["decoding.plans.{}.kernels.attention.implementation=[triton,xla]",
          "+decoding.plans.{}.kernels.attention.config.interpret=true",
          "+decoding.plans.{}.kernels.attention.config.block_s=16"]
config_schema.register()


def _compose(target, overrides):
    base = [f"target={target}", "drafter.num_layers=1", "drafter.num_taps=2", "drafter.block_size=4",
            "decoding=stock", "bench=default", "gpu=cpu"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=[*base, *overrides]))


def _kernel_overrides(plan: str) -> list[str]:
    return [o.format(plan) for o in KERNEL]


def _with_xla_attention(plan: plan_mod.Plan) -> plan_mod.Plan:
    return dataclasses.replace(plan, kernels=dataclasses.replace(plan.kernels, attention=dispatch.OpChoice(("xla",))))


def _runs_kernel(target, params, t: int) -> bool:
    """Whether a chain forward of t tokens over a CACHE_LEN cache traces a pallas_call."""
    def fn(p, s):
        return st.chain_forward(target, p, jnp.zeros((2, t), jnp.int32), s)
    return "pallas_call" in str(jax.make_jaxpr(fn)(params, target.init_state(2, CACHE_LEN)))


# --------------------------------------------------------------------------------------------------
# lengths and counts from the state's masks


@pytest.mark.parametrize("t", [1, 4, 9])
def test_counts_describe_the_chain_and_prompt_masks(t):
    rng = np.random.default_rng(t)
    state = st.TargetState((st.init_attention_state(3, 32, 1, 8, jnp.float32),),
                           jnp.asarray([0, 5, 32 - t], jnp.int32))
    positions = st.chain_positions(state, t)
    causal = st.causal_mask(state, positions)
    counts = chain_counts(causal, state.lengths)
    np.testing.assert_array_equal(np.asarray(counts), [t, t, t])
    np.testing.assert_array_equal(np.asarray(ra.visible_mask(state.lengths, counts, t, 32)), np.asarray(causal))
    prompt_lengths = jnp.asarray(rng.integers(0, t + 1, size=3), jnp.int32)
    prompt = st.prompt_mask(state, positions, prompt_lengths)
    counts = chain_counts(prompt, state.lengths)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(prompt_lengths))
    np.testing.assert_array_equal(np.asarray(ra.visible_mask(state.lengths, counts, t, 32)), np.asarray(prompt))


# --------------------------------------------------------------------------------------------------
# the op


def _inputs(s=64, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, 4, 4, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, s, d)), jnp.float32) for _ in range(2))  # [B, KVH, S, D]
    return q, k, v, jnp.asarray([3, 40], jnp.int32), jnp.asarray([4, 2], jnp.int32)


def _traces_kernel(choice, *x) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(lambda *a: dispatch.attention(*a, choice=choice))(*x))


def test_dispatch_falls_through_where_the_kernel_refuses():
    x = _inputs()
    want = ra.ragged_attention_reference(*x)
    np.testing.assert_allclose(np.asarray(dispatch.attention(*x)), np.asarray(want), rtol=1e-6, atol=1e-6)
    kernel = dispatch.choice("attention", ["triton", "xla"], {"interpret": True, "block_s": 16})
    assert kernel.config == ra.RaggedAttentionConfig(block_s=16, interpret=True)
    assert _traces_kernel(kernel, *x)
    np.testing.assert_allclose(np.asarray(dispatch.attention(*x, choice=kernel)), np.asarray(want),
                               rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
    refusals = [(dispatch.choice("attention", ["triton", "xla"]), _inputs()),  # the CPU, not interpreted
                (kernel, _inputs(s=72)),  # block_s 16 does not divide 72 slots
                (kernel, _inputs(d=24))]  # head_dim not a power of two
    for choice, args in refusals:
        assert not _traces_kernel(choice, *args)
        np.testing.assert_array_equal(np.asarray(dispatch.attention(*args, choice=choice)),
                                      np.asarray(dispatch.attention(*args)))
    with pytest.raises(NotImplementedError, match=r"no attention implementation of \('triton',\).*runs on GPUs"):
        dispatch.attention(*x, choice=dispatch.choice("attention", "triton"))
    with pytest.raises(ValueError, match="unknown key.*'block_k'.*attention 'triton' config"):
        dispatch.choice("attention", "triton", {"block_k": 2})


def test_the_xla_choice_is_the_masked_attention_bit_for_bit():
    """A target whose cfg.attention is [xla] computes exactly what it computed with no choice (the
    mask rebuilt from lengths and counts is the mask it was given), prompt and chain forwards."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    params = dense.init(jax.random.key(3), cfg, jnp.float32, std=0.3)
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, 64, size=(2, 8)), jnp.int32)
    outs = []
    for choice in (None, dispatch.OpChoice(("xla",))):
        target = dense.target(dataclasses.replace(cfg, attention=choice), jnp.float32)

        def fn(p, s, target=target):
            first, _, s = st.prompt_forward(target, p, prompt, jnp.asarray([8, 3], jnp.int32), s)
            return first, st.chain_forward(target, p, prompt[:, :3], s)[0]
        outs.append(jax.jit(fn)(params, target.init_state(2, 32)))
    for got, want in zip(*outs):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --------------------------------------------------------------------------------------------------
# plans and config


def test_plan_field_gpu_default_and_bad_names():
    plans = build_plans(_compose("tiny_random", ["drafter=random"]))
    assert {p.kernels.attention for p in plans} == {dispatch.OpChoice(("xla",))}
    assert "attention" in plan_mod.KERNEL_OPS
    cfg = _compose("tiny_random", ["drafter=random", *_kernel_overrides("stock")])
    validate(cfg)
    [stock] = [p for p in build_plans(cfg) if p.name == "stock"]
    assert stock.kernels.attention == dispatch.OpChoice(("triton", "xla"), ra.RaggedAttentionConfig(16, interpret=True))
    assert stock.describe()["kernels"]["attention"]["config"]["block_s"] == 16
    for override, match in (("decoding.plans.stock.kernels.attention.implementation=[cuda]",
                             "decoding.plans.stock.kernels.attention: unknown attention implementation.*'cuda'"),
                            ("+decoding.plans.stock.kernels.attention.config.block_k=16",
                             "decoding.plans.stock.kernels.attention: unknown key.*'block_k'"),
                            ("gpu.attention=[mosaic]", "gpu.attention: 'mosaic' is not")):
        with pytest.raises(config_schema.ConfigValueError, match=match):
            validate(_compose("tiny_random", ["drafter=random", override]))


def test_the_rewrite_space_lists_the_op():
    cfg = _compose("tiny_random", ["drafter=random"])
    cpu = {c.field: c for c in build_space(cfg, platform="cpu").choices}
    gpu = {c.field: c for c in build_space(cfg, platform="gpu").choices}
    assert "kernels.attention.implementation" not in cpu  # the kernel runs on GPUs: XLA alone on a CPU
    assert gpu["kernels.attention.implementation"].values == (("xla",), ("triton", "xla"), ("triton_block", "xla"))
    assert gpu["kernels.attention.implementation"].targets == ("attention",)
    # a config field both kernels have (same values) applies under either
    block_s = gpu["kernels.attention.config.block_s"]
    assert block_s.when == ("kernels.attention.implementation", ("triton", "triton_block"))
    assert block_s.applies({"kernels": {"attention": {"implementation": ["triton_block", "xla"]}}})
    assert not block_s.applies({"kernels": {"attention": {"implementation": ["xla"]}}})


# --------------------------------------------------------------------------------------------------
# the targets


def test_dense_ar_and_stock_with_the_kernel_give_the_xla_tokens():
    """Through the deployment (`cfg_for`, `target_for`): the tiny dense target's AR and stock plans with
    the ragged kernel emit the XLA AR plan's tokens, prompts of different lengths in one batch; the
    oracle drafter (replaying the XLA AR tokens) makes verification accept several tokens per step."""
    cfg = _compose("tiny_random", ["drafter=oracle", "drafter.tau=2.5", *_kernel_overrides("stock")])
    plans = {p.name: p for p in build_plans(cfg)}
    kernel_choice = plans["stock"].kernels.attention
    plans["ar_ragged"] = dataclasses.replace(plans["ar"], name="ar_ragged", kernels=dataclasses.replace(
        plans["ar"].kernels, attention=kernel_choice))
    dep = deploy.build(cfg, list(plans.values()))
    assert dep.cfg_for(plans["stock"]).attention == dep.cfg_for(plans["ar_ragged"]).attention == kernel_choice
    assert dep.cfg_for(plans["ar"]).attention == dispatch.OpChoice(("xla",))
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 11, 12], [30, 31, 32]]
    new = 10
    kernel_ar, xla_ar = dep.target_for(plans["ar_ragged"]), dep.target_for(plans["ar"])
    params = dep.params_for(plans["ar"])
    assert _runs_kernel(kernel_ar, params, 1) and not _runs_kernel(xla_ar, params, 1)
    want = ar.generate(xla_ar, params, prompts, new, cache_len=CACHE_LEN).as_lists()
    got = ar.generate(kernel_ar, params, prompts, new, cache_len=CACHE_LEN).as_lists()
    assert got == want

    drafter, base = dep.drafter_for(plans["stock"])
    assert isinstance(drafter, OracleDrafter)
    dparams = OracleDrafter.make_params(base, replay_reference(prompts, want), seed=0)
    target = dep.target_for(plans["stock"])
    assert _runs_kernel(target, params, plans["stock"].block_size)
    result = spec.generate(target, params, drafter, dparams, prompts, new, cache_len=CACHE_LEN)
    # stock through XLA emits AR's tokens (lossless, tests/test_spec.py); the kernel's must be those too
    assert result.as_lists() == want
    assert result.stats.tau > 1.5  # several tokens committed per verification


def test_hybrid_gated_attention_takes_the_choice():
    """The tiny hybrid's full-attention layers go through the kernel in prefill and chain verification;
    logits (a right-padded prompt, then a chained block) within the kernel's tolerance of the XLA path."""
    cfg = _compose("tiny_hybrid", ["drafter=random", *_kernel_overrides("stock")])
    plans = {p.name: p for p in build_plans(cfg)}
    dep = deploy.build(cfg, list(plans.values()))
    assert dep.cfg_for(plans["stock"]).attention == plans["stock"].kernels.attention
    kernel, xla = dep.target_for(plans["stock"]), dep.target_for(_with_xla_attention(plans["stock"]))
    params = dep.params_for(plans["stock"])
    assert _runs_kernel(kernel, params, 4) and not _runs_kernel(xla, params, 4)
    rng = np.random.default_rng(7)
    prompt = jnp.asarray(rng.integers(0, 128, size=(2, 16)), jnp.int32)
    lengths = jnp.asarray([16, 9], jnp.int32)
    block = jnp.asarray(rng.integers(0, 128, size=(2, 4)), jnp.int32)

    def run(target):
        def fn(p, s):
            first, _, s = st.prompt_forward(target, p, prompt, lengths, s)
            logits, _, _ = st.chain_forward(target, p, block, s)
            return first, logits
        return jax.jit(fn)(params, target.init_state(2, CACHE_LEN))

    for got, want in zip(run(kernel), run(xla)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=KERNEL_RTOL, atol=KERNEL_ATOL)
