"""The tree-attention Pallas kernel (interpret mode on the CPU) against its reference and a float64 brute
force, its fall-through, its lowering for CUDA, and the plan's choice reaching the dense and hybrid
targets' tree forwards.

Written tolerances (unit-scale q, k, v):
- float32: KERNEL_ATOL = KERNEL_RTOL = 1e-5. Both sides form the same float32 products (no TF32); the
  kernel adds the softmax's terms split by split and rescales by exp(m_split - m) where the reference
  adds them in one reduce, which moves a sum by a few ulps (~1e-7 relative at <= 300 keys). A wrong
  kernel (a lost split, an ancestor mask off by one, a swapped head) is off by O(0.1).
- bfloat16: BF16_ATOL = 3e-2. The probabilities are rounded to bf16 before the PV product on both
  sides, but the kernel rounds exp(s - m_running) (unnormalised) and the reference the normalised
  probability: each weight then differs by up to 2^-8 relative, and the output (|v| <= ~4) by up to
  ~4 * 2^-8 = 1.6e-2, plus its own bf16 rounding (2^-8 * |o| <= ~4e-3).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import tree_attention as ta
from specpilot import state as st
from specpilot.models import dense, hybrid
from specpilot.models.config import ModelConfig
from specpilot.models.hybrid_config import HybridConfig

KERNEL_ATOL = 1e-5
KERNEL_RTOL = 1e-5
BF16_ATOL = 3e-2
INTERPRET = ta.TreeAttentionTritonConfig(interpret=True)


def random_parents(rng, b: int, n: int) -> np.ndarray:
    """[B, N] topologically ordered parents: -1 for the root, node i's parent uniform in [0, i)."""
    parents = np.full((b, n), -1, np.int32)
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, size=b)
    return parents


def ancestors_of(parents: np.ndarray) -> np.ndarray:
    """[B, N, N] bool: j is on i's root path (i included), by walking the parents."""
    b, n = parents.shape
    anc = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                anc[r, i, j] = True
                j = parents[r, j]
    return anc


def inputs(b, n, h, kvh, d, s, lengths, seed, dtype=jnp.float32):
    """q [B, N, H, D], a cache [B, KVH, S, D] (the nodes' K/V at slots lengths[b] + j, like every other
    slot random), lengths, ancestors of a random tree."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, n, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, kvh, s, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, kvh, s, d)), dtype)
    anc = jnp.asarray(ancestors_of(random_parents(rng, b, n)))
    return q, k, v, jnp.asarray(lengths, jnp.int32), anc


CASES = [  # (B, N, H, KVH, D, S, lengths, config overrides)
    (1, 1, 4, 1, 32, 64, [37], dict(block_k=16, splits=2)),  # one node (AR), MQA
    (2, 16, 4, 2, 32, 128, [40, 100], dict(block_k=16, splits=3)),  # GQA 2, ragged, splits past the length
    (2, 16, 8, 2, 16, 256, [0, 201], dict(block_k=32, splits=4)),  # no prefix in row 0, GQA 4
    (1, 64, 2, 2, 32, 192, [128], dict(block_k=64, splits=1, block_m=32)),  # MHA, 64 nodes, 2 row blocks
    (2, 64, 8, 2, 16, 320, [5, 250], dict(block_k=64, splits=2, block_m=128)),  # 64 x 4 rows, S = 5 blocks
]


def _close(got, want, atol=KERNEL_ATOL, rtol=KERNEL_RTOL):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=rtol)


# interpreted on any backend; compiled (Triton) where jax has a GPU (`-m gpu`)
MODES = [True, pytest.param(False, marks=pytest.mark.gpu)]


def _reference(*x):
    with jax.default_matmul_precision("highest"):  # a GPU's default would round float32 products to TF32
        return ta.tree_attention_reference(*x)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("b, n, h, kvh, d, s, lengths, overrides", CASES)
def test_kernel_equals_reference(b, n, h, kvh, d, s, lengths, overrides, interpret):
    x = inputs(b, n, h, kvh, d, s, lengths, seed=n + s)
    got = ta.tree_attention(*x, dataclasses.replace(INTERPRET, interpret=interpret, **overrides))
    assert got.shape == (b, n, h, d) and got.dtype == jnp.float32
    _close(got, _reference(*x))


@pytest.mark.parametrize("interpret", MODES)
def test_bf16_kernel_equals_reference(interpret):
    x = inputs(2, 16, 8, 2, 32, 128, [3, 90], seed=5, dtype=jnp.bfloat16)
    got = ta.tree_attention(*x, dataclasses.replace(INTERPRET, block_k=32, splits=2, interpret=interpret))
    assert got.dtype == jnp.bfloat16
    _close(got, _reference(*x), atol=BF16_ATOL, rtol=0)


def test_kernel_is_tree_attention_as_written():
    """Brute force in float64 numpy, node by node: softmax over the committed slots and the node's
    ancestors' slots (found by walking the parents), the KV head of query head h being h // G."""
    b, n, h, kvh, d, s = 2, 9, 6, 3, 16, 64
    rng = np.random.default_rng(11)
    parents = random_parents(rng, b, n)
    q, k, v, lengths, _ = inputs(b, n, h, kvh, d, s, [17, 40], seed=12)
    anc = jnp.asarray(ancestors_of(parents))
    got = np.asarray(ta.tree_attention(q, k, v, lengths, anc, dataclasses.replace(INTERPRET, block_k=16, splits=3)))
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    for r in range(b):
        length = int(lengths[r])
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.append(length + j)
                j = parents[r, j]
            slots = list(range(length)) + sorted(path)
            for head in range(h):
                scores = kn[r, head // (h // kvh), slots] @ qn[r, i, head] / np.sqrt(d)
                p = np.exp(scores - scores.max())
                want = (p / p.sum()) @ vn[r, head // (h // kvh), slots]
                _close(got[r, i, head], want)


def test_a_chain_is_the_causal_mask():
    """Lower-triangular ancestors: the kernel equals the model's attention under `state.causal_mask`."""
    b, n, s = 2, 5, 64
    q, k, v, lengths, _ = inputs(b, n, 4, 2, 16, s, [9, 30], seed=13)
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    state = st.TargetState(layers=(st.AttentionState(k, v),), lengths=lengths)
    mask = st.causal_mask(state, st.chain_positions(state, n))
    got = ta.tree_attention(q, k, v, lengths, chain, dataclasses.replace(INTERPRET, block_k=16))
    _close(got, ta.cache_attention(q, k, v, mask))


def test_what_the_kernel_cannot_take():
    q, k, v, lengths, anc = inputs(1, 4, 4, 2, 16, 64, [10], seed=14)
    with pytest.raises(NotImplementedError, match="power-of-two head dims, got D 24"):
        ta.tree_attention(*inputs(1, 4, 4, 2, 24, 64, [10], seed=14), INTERPRET)
    with pytest.raises(NotImplementedError, match="cache length 72 has no power-of-two divisor >= 16"):
        ta.tree_attention(*inputs(1, 4, 4, 2, 16, 72, [10], seed=14), INTERPRET)
    with pytest.raises(NotImplementedError, match="runs on GPUs .*not 'cpu'"):
        ta.tree_attention(q, k, v, lengths, anc)
    with pytest.raises(ValueError, match="ancestors .* must be \\[B, N, N\\]"):
        ta.tree_attention(q, k, v, lengths, anc[:, :3], INTERPRET)
    with pytest.raises(ValueError, match="lengths \\(2,\\) must be \\[B\\]"):
        ta.tree_attention(q, k, v, jnp.zeros((2,), jnp.int32), anc, INTERPRET)
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 KV heads"):
        ta.tree_attention(q, *(jnp.zeros((1, 3, 64, 16)),) * 2, lengths, anc, INTERPRET)
    with pytest.raises(ValueError, match="block_k must be a power of two, got 48"):
        ta.TreeAttentionTritonConfig(block_k=48)
    with pytest.raises(ValueError, match="splits must be a positive integer, got 0"):
        ta.TreeAttentionTritonConfig(splits=0)


def _has_pallas_call(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_tries_the_choice_in_order_and_falls_through():
    x = inputs(2, 4, 4, 2, 16, 64, [10, 33], seed=15)
    want = ta.tree_attention_reference(*x)
    fallback = dispatch.choice("tree_attention", ["triton", "xla"])  # no interpret on the CPU: the reference
    np.testing.assert_array_equal(np.asarray(dispatch.tree_attention(*x, choice=fallback)), np.asarray(want))
    assert not _has_pallas_call(lambda *a: dispatch.tree_attention(*a, choice=fallback), *x)
    with pytest.raises(NotImplementedError, match=r"no tree_attention implementation of \('triton',\).*triton: "):
        dispatch.tree_attention(*x, choice=dispatch.choice("tree_attention", "triton"))
    kernel = dispatch.choice("tree_attention", ["triton", "xla"], {"interpret": True, "block_k": 16})
    assert kernel.config == ta.TreeAttentionTritonConfig(block_k=16, interpret=True)
    assert _has_pallas_call(lambda *a: dispatch.tree_attention(*a, choice=kernel), *x)
    _close(dispatch.tree_attention(*x, choice=kernel), want)
    with pytest.raises(ValueError, match="unknown tree_attention implementation.*'mosaic'.*known: triton, xla"):
        dispatch.choice("tree_attention", ["mosaic"])
    with pytest.raises(ValueError, match="unknown key.*'block_v'.*tree_attention 'triton' config"):
        dispatch.choice("tree_attention", "triton", {"block_v": 16})


@pytest.mark.parametrize("n, h, kvh, d, dtype", [
    (64, 32, 8, 128, jnp.bfloat16),  # Qwen3-8B's attention
    (128, 24, 4, 256, jnp.bfloat16),  # Qwen3.5-27B's full-attention layers
    (16, 32, 8, 128, jnp.float32),
])
def test_real_shapes_lower_for_cuda(n, h, kvh, d, dtype):
    """The kernel lowers to Triton IR from this CPU machine at the real shapes (a 4096-slot cache)."""
    sds = jax.ShapeDtypeStruct
    args = [sds((1, n, h, d), dtype), sds((1, kvh, 4096, d), dtype), sds((1, kvh, 4096, d), dtype),
            sds((1,), jnp.int32), sds((1, n, n), jnp.bool_)]
    lowered = jax.jit(lambda *a: ta.tree_attention_pallas(*a)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


# --------------------------------------------------------------------------------------------------
# The op in the targets' tree forwards


def _tree_inputs(target, params, lengths, n, seed, max_len=64):
    """A state with `lengths` committed (a prompt forward) and a random n-node tree's forward inputs
    (tokens, positions, mask, parents: as `tree.verify_phase` builds them)."""
    rng = np.random.default_rng(seed)
    b, vocab = len(lengths), target.vocab_size
    prompt = jnp.asarray(rng.integers(0, vocab, size=(b, max(lengths))), jnp.int32)
    _, _, state = jax.jit(lambda p, x, s: st.prompt_forward(target, p, x, jnp.asarray(lengths, jnp.int32), s))(
        params, prompt, target.init_state(b, max_len))
    parents = random_parents(rng, b, n)
    anc = ancestors_of(parents)
    tokens = jnp.asarray(rng.integers(0, vocab, size=(b, n)), jnp.int32)
    positions = state.lengths[:, None] + jnp.asarray(anc.sum(axis=2) - 1, jnp.int32)
    return state, (tokens, positions, st.tree_mask(state, jnp.asarray(anc)), jnp.asarray(parents))


def _tree_forward(target, params, state, tree):
    """-> ((logits, taps, state) of the tree forward, whether a pallas_call ran)."""
    tokens, positions, mask, parents = tree
    fn = jax.jit(lambda p, s: target.forward(p, tokens, positions, s, mask, parents=parents))
    return fn(params, state), "pallas_call" in str(jax.make_jaxpr(fn)(params, state))


TINY_DENSE = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, qk_norm=True)


def test_dense_tree_forward_with_the_kernel_equals_the_xla_path():
    params = dense.init(jax.random.key(0), TINY_DENSE, jnp.float32, std=0.3)
    kernel = dispatch.choice("tree_attention", ["triton", "xla"], {"interpret": True, "block_k": 16, "splits": 2})
    state, tree = _tree_inputs(dense.target(TINY_DENSE, jnp.float32), params, [7, 21], n=16, seed=1)
    runs = {}
    for name, choice in (("xla", None), ("plan_xla", dispatch.choice("tree_attention", "xla")), ("kernel", kernel)):
        target = dense.target(dataclasses.replace(TINY_DENSE, tree_attention=choice), jnp.float32)
        runs[name] = _tree_forward(target, params, state, tree)
    assert runs["kernel"][1] and not runs["xla"][1] and not runs["plan_xla"][1]
    (want_logits, _, want_state), _ = runs["xla"]
    (plan_logits, _, _), _ = runs["plan_xla"]
    np.testing.assert_array_equal(np.asarray(plan_logits), np.asarray(want_logits))  # [xla]: the old path
    (logits, _, state), _ = runs["kernel"]
    _close(logits, want_logits)
    # the first layer's K/V are written as before (later ones take the earlier layers' attention outputs)
    np.testing.assert_array_equal(np.asarray(state.layers[0].k), np.asarray(want_state.layers[0].k))
    for got, want in zip(state.layers[1:], want_state.layers[1:]):
        _close(got.k, want.k)


@pytest.mark.slow  # ~20 s on two shared cores
def test_hybrid_tree_forward_with_the_kernel_equals_the_xla_path():
    cfg = HybridConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=("linear_attention", "full_attention"), partial_rotary_factor=0.5)
    params = hybrid.init(jax.random.key(1), cfg, jnp.float32, std=0.3)
    kernel = dispatch.choice("tree_attention", ["triton", "xla"], {"interpret": True, "block_k": 16})
    state, tree = _tree_inputs(hybrid.target(cfg, jnp.float32, max_block_size=8), params, [5, 12], n=8, seed=2)
    (want, _, _), traced_xla = _tree_forward(hybrid.target(cfg, jnp.float32, max_block_size=8), params, state, tree)
    (got, _, _), traced = _tree_forward(hybrid.target(dataclasses.replace(cfg, tree_attention=kernel),
                                                      jnp.float32, max_block_size=8), params, state, tree)
    assert traced and not traced_xla
    _close(got, want)
