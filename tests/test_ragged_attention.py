"""Ragged attention: the reference equals the models' masked attention under the state's chain and
prompt masks and a NumPy softmax row by row; the Pallas kernel (interpreted on the CPU) equals the
reference, reading only each row's own blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_attention as ra
from specpilot import state as st
from specpilot.models.layers import attention

CASES = [  # (B, T, H, KVH, D, S, lengths, counts)
    (3, 1, 4, 2, 16, 64, [0, 17, 63], [1, 1, 1]),  # decode, GQA groups of 2, a row at the last slot
    (2, 4, 6, 2, 32, 128, [5, 120], [4, 2]),  # a verified block and a right-padded prompt chunk
    (2, 8, 9, 3, 64, 64, [0, 30], [8, 5]),  # SmolLM2's 9 / 3 heads (groups of 3) and head_dim 64
]


def arrays(b, t, h, kvh, d, s, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, t, h, d), (b, kvh, s, d), (b, kvh, s, d)))
    return q, k, v


def numpy_attention(q, k, v, lengths, counts):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(t):
            end = lengths[r] + min(i + 1, counts[r])
            for j in range(h):
                scores = k[r, j // group, :end] @ q[r, i, j] / np.sqrt(d)
                p = np.exp(scores - scores.max())
                out[r, i, j] = (p / p.sum()) @ v[r, j // group, :end]
    return out


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_masked_attention_and_numpy(case):
    b, t, h, kvh, d, s, lengths, counts = case
    q, k, v = arrays(b, t, h, kvh, d, s)
    lengths, counts = jnp.asarray(lengths, jnp.int32), jnp.asarray(counts, jnp.int32)
    got = ra.ragged_attention_reference(q, k, v, lengths, counts)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, np.asarray(lengths), np.asarray(counts)),
                               rtol=1e-5, atol=1e-5)
    # the models' attention under the state's masks: causal for chains, prompt_mask for chunks
    state = st.TargetState((st.init_attention_state(b, s, kvh, d, jnp.float32),), lengths)
    positions = st.chain_positions(state, t)
    mask = jnp.where((counts == t)[:, None, None], st.causal_mask(state, positions),
                     st.prompt_mask(state, positions, counts))
    np.testing.assert_allclose(got, attention(q, k, v, mask), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_s", [16, 64])
def test_kernel_interpreted_equals_reference(case, block_s):
    b, t, h, kvh, d, s, lengths, counts = case
    q, k, v = arrays(b, t, h, kvh, d, s, seed=1)
    lengths, counts = jnp.asarray(lengths, jnp.int32), jnp.asarray(counts, jnp.int32)
    config = ra.RaggedAttentionConfig(block_s=block_s, interpret=True)
    got = ra.ragged_attention(q, k, v, lengths, counts, config)
    np.testing.assert_allclose(got, ra.ragged_attention_reference(q, k, v, lengths, counts), rtol=2e-5, atol=2e-5)


def test_kernel_reads_only_the_rows_own_blocks():
    # NaN past each row's end: the kernel never loads those blocks (the reference's masked
    # einsum would carry 0 * NaN = NaN there, so this is the kernel's own property)
    b, t, h, kvh, d, s = 2, 2, 4, 2, 16, 64
    q, k, v = arrays(b, t, h, kvh, d, s, seed=2)
    lengths, counts = jnp.asarray([3, 20], jnp.int32), jnp.asarray([2, 2], jnp.int32)
    ends = np.asarray(lengths + counts)
    block = 16
    blocks_end = -(-ends // block) * block  # the first slot of the first block a row does not read
    poison = np.arange(s)[None, None, :, None] >= blocks_end[:, None, None, None]  # [B, KVH, S, D]
    k_bad, v_bad = (jnp.where(poison, jnp.nan, x) for x in (k, v))
    got = ra.ragged_attention(q, k_bad, v_bad, lengths, counts, ra.RaggedAttentionConfig(block_s=block, interpret=True))
    np.testing.assert_allclose(got, ra.ragged_attention_reference(q, k, v, lengths, counts), rtol=2e-5, atol=2e-5)


def test_unsupported_falls_through_and_bad_shapes_refused():
    q, k, v = arrays(1, 1, 4, 2, 16, 48)
    one = jnp.ones((1,), jnp.int32)
    with pytest.raises(NotImplementedError, match="block_s 32 does not divide"):
        ra.ragged_attention(q, k, v, one, one, ra.RaggedAttentionConfig(block_s=32, interpret=True))
    chunk, ck, cv = arrays(1, 130, 4, 2, 16, 256)  # a prompt chunk: 130 tokens x 2 heads per KV head
    with pytest.raises(NotImplementedError, match="query rows"):
        ra.ragged_attention(chunk, ck, cv, one, one, ra.RaggedAttentionConfig(block_s=16, interpret=True))
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="GPUs"):
            ra.ragged_attention(q, k, v, one, one, ra.RaggedAttentionConfig(block_s=16))
    with pytest.raises(ValueError, match="lengths"):
        ra.ragged_attention_reference(q, k, v, jnp.ones((2,), jnp.int32), one)
    with pytest.raises(ValueError, match="block_s must be a power of two"):
        ra.RaggedAttentionConfig(block_s=48)


@pytest.mark.parametrize("splits,merge", [(1, "xla"), (3, "xla"), (3, "kernel")])
@pytest.mark.parametrize("heads", [(4, 9, 3), (16, 32, 8)])  # (T, H, KVH): SmolLM2's groups of 3; Qwen3-8B's
def test_kernel_lowers_for_cuda(heads, splits, merge):
    # GPU-free check that every op of the kernels (and the combine kernel's) has a Triton lowering (bf16 cache)
    t, h, kvh = heads
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in
            (((2, t, h, 64), jnp.bfloat16), ((2, kvh, 128, 64), jnp.bfloat16), ((2, kvh, 128, 64), jnp.bfloat16),
             ((2,), jnp.int32), ((2,), jnp.int32))]
    lowered = jax.jit(lambda *a: ra.ragged_attention_pallas(*a, block_s=64, splits=splits, merge=merge)).trace(
        *args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    combine_kernel = splits > 1 and merge == "kernel"
    assert text.count("stablehlo.custom_call") == (2 if combine_kernel else 1)  # the kernel (and the combine's)
    assert ("ragged_attention_combine" in text) == combine_kernel


# ---- the split over the cache ---------------------------------------------------------------------------

def kernel_vs_reference(b, t, h, kvh, d, s, lengths, counts, *, block_s, splits, seed=3, merge="xla"):
    q, k, v = arrays(b, t, h, kvh, d, s, seed=seed)
    lengths, counts = jnp.asarray(lengths, jnp.int32), jnp.asarray(counts, jnp.int32)
    config = ra.RaggedAttentionConfig(block_s=block_s, splits=splits, merge=merge, interpret=True)
    got = ra.ragged_attention(q, k, v, lengths, counts, config)
    np.testing.assert_allclose(got, ra.ragged_attention_reference(q, k, v, lengths, counts), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits,merge", [(1, "xla"), (2, "xla"), (4, "xla"), (0, "xla"), (4, "kernel")])
def test_splits_with_row_ends_inside_and_at_split_edges(splits, merge):
    # 8 blocks of 16 slots; a row's blocks are shared out by its own end (lengths + counts): 32 ends at a
    # block edge, 33 one slot into the next block, 50 inside one, 128 is the full cache, 5 leaves most
    # splits past the row's end (their neutral partials must not count)
    kernel_vs_reference(5, 4, 8, 2, 16, 128, [28, 29, 46, 124, 1], [4, 4, 4, 4, 4], block_s=16, splits=splits,
                        merge=merge)


@pytest.mark.parametrize("splits", [1, 3, 0])
def test_counts_zero_to_t_per_row(splits):
    # row r feeds r new tokens (0: its queries see the committed slots alone), different lengths per row
    t = 4
    kernel_vs_reference(t + 1, t, 4, 2, 16, 64, [7, 16, 30, 1, 59], list(range(t + 1)), block_s=16, splits=splits)


@pytest.mark.parametrize("case,merge", [((3, 4, 2), "xla"), ((2, 6, 2), "kernel"), ((5, 9, 3), "xla")])
def test_split_padded_layout(case, merge):  # (T, H, KVH): the padded-rows layout
    t, h, kvh = case
    kernel_vs_reference(2, t, h, kvh, 16, 64, [0, 40], [t, max(1, t - 1)], block_s=16, splits=0, merge=merge)


def test_natural_layout_has_no_layout_pass():
    # T and G powers of two: q and the output are blocks of [B, T, H, D] itself (no transpose or pad
    # around the call); otherwise the queries are gathered into padded rows first
    def ops(t, h, kvh, splits):
        q, k, v = arrays(2, t, h, kvh, 16, 64)
        one = jnp.ones((2,), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda *a: ra.ragged_attention_pallas(*a, block_s=16, splits=splits, interpret=True))
        return str(jaxpr(q, k, v, one, one))
    for splits in (1, 4):
        natural = ops(8, 8, 2, splits)
        assert "transpose" not in natural and " pad " not in natural and "pad[" not in natural
    assert "transpose" in ops(3, 6, 2, 1)


def test_auto_splits_rule():
    assert ra.auto_splits(1, 8, 1024, 64, sms=132) == 16  # 33 wanted, one block per split at most
    assert ra.auto_splits(1, 8, 1024, 16, sms=132) == 33  # ~2 programs per SM
    assert ra.auto_splits(16, 8, 1024, 64, sms=132) == 3
    assert ra.auto_splits(64, 8, 1024, 64, sms=132) == 1
    assert ra.auto_splits(1, 2, 32, 16, sms=132) == 2  # a 2-block cache: 2 splits
    with pytest.raises(ValueError, match="splits must be a non-negative integer"):
        ra.RaggedAttentionConfig(splits=-1)
    with pytest.raises(ValueError, match="block_s must be >= 16"):
        ra.RaggedAttentionConfig(block_s=8)
    with pytest.raises(ValueError, match="merge must be one of"):
        ra.RaggedAttentionConfig(merge="cuda")


def test_split_kernel_reads_only_the_rows_own_blocks():
    b, t, h, kvh, d, s = 2, 2, 4, 2, 16, 128
    q, k, v = arrays(b, t, h, kvh, d, s, seed=4)
    lengths, counts = jnp.asarray([3, 50], jnp.int32), jnp.asarray([2, 2], jnp.int32)
    blocks_end = -(-np.asarray(lengths + counts) // 16) * 16
    poison = np.arange(s)[None, None, :, None] >= blocks_end[:, None, None, None]
    k_bad, v_bad = (jnp.where(poison, jnp.nan, x) for x in (k, v))
    config = ra.RaggedAttentionConfig(block_s=16, splits=4, interpret=True)
    got = ra.ragged_attention(q, k_bad, v_bad, lengths, counts, config)
    np.testing.assert_allclose(got, ra.ragged_attention_reference(q, k, v, lengths, counts), rtol=2e-5, atol=2e-5)
