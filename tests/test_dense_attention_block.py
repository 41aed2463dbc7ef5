"""The fused attention-block kernel inside the dense model: a plan naming `triton_block` for chain attention
runs it (interpreted here) in place of the unfused q/k norm, RoPE, K/V write and attention, and falls back
to the unfused path (and the choice's next implementation) where the kernel does not take a forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from specpilot import plan as plan_mod
from specpilot.models import dense
from specpilot.models.config import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, qk_norm=True)
BLOCK = dispatch.choice("attention", ["triton_block", "xla"], {"interpret": True})
# Logits of a bf16 model whose attention sums in another order: each layer's bf16 activations may differ by
# an ulp (2^-8 relative) where the order changes a rounding; two layers and the head keep the logits
# (|logit| < 4 here) within 0.05 of each other. The kernel's own tolerance is in test_attention_block.py.
LOGITS_ATOL = 5e-2


@pytest.fixture(scope="module")
def params():
    return dense.fuse_projections(dense.init(jax.random.PRNGKey(0), CFG))


def _run(params, cfg, tokens, lengths, verify_tokens):
    state = dense.init_state(cfg, tokens.shape[0], 64, jnp.bfloat16)
    _, _, state = dense.prefill(params, cfg, tokens, lengths, state)
    logits, _, state = dense.step(params, cfg, verify_tokens, state)
    return logits, state


def _inputs(t: int):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, CFG.vocab_size)
    verify = jax.random.randint(jax.random.PRNGKey(2), (2, t), 0, CFG.vocab_size)
    return tokens, jnp.array([8, 5], jnp.int32), verify


def test_block_matches_unfused_chain_forward(params):
    tokens, lengths, verify = _inputs(4)
    ref_logits, ref_state = _run(params, CFG, tokens, lengths, verify)
    logits, state = _run(params, dataclasses.replace(CFG, attention=BLOCK), tokens, lengths, verify)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=LOGITS_ATOL)
    assert (np.asarray(logits).argmax(-1) == np.asarray(ref_logits).argmax(-1)).all()
    # the first layer sees identical inputs: its K/V (norm and RoPE are per row) are written bit for bit
    np.testing.assert_array_equal(np.asarray(state.layers[0].k), np.asarray(ref_state.layers[0].k))
    np.testing.assert_array_equal(np.asarray(state.layers[0].v), np.asarray(ref_state.layers[0].v))
    assert (np.asarray(state.lengths) == np.asarray(ref_state.lengths)).all()


def test_forward_the_kernel_refuses_runs_unfused(params):
    # 3 tokens (not a power of two) at verification: the kernel refuses, the unfused path and the choice's
    # next implementation (xla) run, so the results are the unfused ones bit for bit
    tokens, lengths, verify = _inputs(3)
    cfg = dataclasses.replace(CFG, attention=BLOCK)
    with pytest.raises(NotImplementedError):
        dispatch.attention_block(
            jnp.zeros((2, 3, CFG.q_size + 2 * CFG.kv_size), jnp.bfloat16), None, None,
            jnp.zeros((2, 3, CFG.head_dim)), jnp.zeros((2, 3, CFG.head_dim)),
            jnp.zeros((2, CFG.num_kv_heads, 64, CFG.head_dim), jnp.bfloat16),
            jnp.zeros((2, CFG.num_kv_heads, 64, CFG.head_dim), jnp.bfloat16), jnp.array([8, 5]), jnp.array([3, 3]),
            num_heads=CFG.num_heads, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, eps=CFG.rms_norm_eps,
            choice=BLOCK)
    # the same prefilled state, then the 3-token verification with and without the block choice
    state = dense.init_state(CFG, 2, 64, jnp.bfloat16)
    _, _, state = dense.prefill(params, CFG, tokens, lengths, state)
    ref, _, _ = dense.step(params, CFG, verify, jax.tree.map(jnp.copy, state))
    got, _, _ = dense.step(params, cfg, verify, state)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_attention_alone_falls_through_to_the_next_implementation():
    b, t, h, kvh, d, s = 1, 2, 4, 2, 32, 64
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, kvh, s, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, kvh, s, d), jnp.bfloat16)
    lengths, counts = jnp.array([5], jnp.int32), jnp.array([2], jnp.int32)
    got = dispatch.attention(q, k, v, lengths, counts, choice=BLOCK)
    ref = dispatch.attention(q, k, v, lengths, counts, choice=dispatch.choice("attention", ["xla"]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_plan_names_the_block_kernel():
    p = plan_mod.build("stock_block", {"verify": "chain", "kernels": {"attention": {
        "implementation": ["triton_block", "xla"], "config": {"block_s": 32}}}}, drafter_block_size=4,
        default_matmul={"bf16": ["xla"]})
    assert p.kernels.attention.implementation == ("triton_block", "xla")
    assert p.kernels.attention.config.block_s == 32
