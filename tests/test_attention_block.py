"""The fused attention block (`pallas_kernels.attention_block`): its reference equals the model's own path bit
for bit, the kernel (interpreted on the CPU) matches the reference, writes only the T new slots, never reads
past a row's length, falls through where it does not apply, and lowers for CUDA at the Qwen3-8B shape.

Written tolerances (attention output against the reference; q, k, v of unit scale):
- float32: ATOL = RTOL = 1e-5. Both sides form the same float32 products (no TF32); the kernel adds the
  softmax's terms block by block and split by split with rescaling by exp(m_split - m) where the reference
  adds them in one reduce: a few ulps (~1e-7 relative at <= 100 keys). A wrong kernel (a lost split, a mask
  off by one, a swapped head) is off by O(0.01) or more.
- bfloat16: |kernel - ref| <= 2^-7 (max|v| + |ref|) + 1e-5 max|v|. Both sides round probabilities to bf16
  before the PV product (unit roundoff u = 2^-8), but the reference rounds the normalised p_j and the kernel
  exp(s_j - m_split): each side's weighted sum is within u sum_j p_j |v_j| <= u max|v| of the exact one, so
  they differ by <= 2u max|v| before the output's own bf16 rounding, which adds <= u |x| per side; float32
  noise is the last term. Logic errors are caught by the float32 cases, which run the same code paths.
- K written to the cache: norm and RoPE are elementwise per row, and the kernel rounds each bf16 op as
  the reference does, so bf16 K is bit-identical without qk-norm. With qk-norm the norm's mean is a float32
  reduction in another order (and another rsqrt) than XLA's: its factor can differ by an ulp, which bf16
  rounding absorbs except at a rounding boundary (then 1 bf16 ulp). In float32 those ulps show, and XLA
  may contract RoPE's x * cos + r * sin into one FMA (bf16 products are rounded first, so not there):
  rtol = atol = 1e-6. V is a copy: bit-identical always.
"""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_block as ab
from pallas_kernels import ragged_attention as ra
from specpilot import state as st
from specpilot.models import layers

ATOL = RTOL = 1e-5
EPS = 1e-6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (B, T, H, KVH, D, S, lengths, counts, qk-norm, splits, block_s)
CASES = [
    (2, 16, 8, 2, 32, 64, [5, 40], [16, 7], True, 2, 16),  # verification at 4 heads per KV head, split in two
    (5, 4, 4, 4, 32, 64, [3, 0, 9, 30, 60], [0, 1, 2, 3, 4], False, 1, 16),  # counts 0..T, no combine, no norm
    (2, 1, 8, 2, 64, 128, [70, 3], [0, 1], True, 0, 16),  # decode, automatic splits (8), rows padded to 16
    (1, 16, 4, 4, 32, 128, [37], [16], True, 3, 16),  # a split count that does not divide the blocks
]


def make_inputs(b, t, h, kvh, d, s, lengths, qk, dtype, cache_dtype=None, seed=0):
    """(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths) with the model's RoPE tables."""
    rng = np.random.default_rng(seed)
    cache_dtype = cache_dtype or dtype
    qkv = jnp.asarray(rng.standard_normal((b, t, (h + 2 * kvh) * d)), dtype)
    norms = [jnp.asarray(1 + 0.2 * rng.standard_normal(d), dtype) if qk else None for _ in range(2)]
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cos, sin = layers.rope_tables(positions, 1.0 / (10000.0 ** (np.arange(0, d, 2) / d)))
    caches = [jnp.asarray(rng.standard_normal((b, kvh, s, d)), cache_dtype) for _ in range(2)]
    return (qkv, *norms, cos, sin, *caches, lengths)


def model_path(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, *, num_heads, num_kv_heads,
               head_dim, eps):
    """`dense.decoder_layer` between the qkv and o products, from the model's own functions."""
    b, t, _ = qkv.shape
    q, k, v = jnp.split(qkv, [num_heads * head_dim, (num_heads + num_kv_heads) * head_dim], axis=-1)
    q = q.reshape(b, t, num_heads, head_dim)
    k, v = (x.reshape(b, t, num_kv_heads, head_dim) for x in (k, v))
    if q_norm is not None:
        q, k = layers.rms_norm(q, q_norm, eps), layers.rms_norm(k, k_norm, eps)
    q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    kv = st.AttentionState(k_cache, v_cache).write(k, v, lengths)
    mask = ra.visible_mask(lengths, counts, t, k_cache.shape[2])
    attn = layers.cache_attention(q, kv, lengths, mask)
    return attn.reshape(b, t, num_heads * head_dim), kv.k, kv.v


def dims(h, kvh, d):
    return dict(num_heads=h, num_kv_heads=kvh, head_dim=d, eps=EPS)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("qk, dtype", [(True, jnp.bfloat16), (False, jnp.bfloat16), (True, jnp.float32)])
def test_reference_is_the_model_path_bit_for_bit(qk, dtype):
    b, t, h, kvh, d, s = 2, 4, 8, 2, 32, 32
    args = make_inputs(b, t, h, kvh, d, s, [3, 20], qk, dtype)
    counts = jnp.asarray([4, 2], jnp.int32)
    for run in (lambda f: f(*args, counts, **dims(h, kvh, d)),
                lambda f: jax.jit(functools.partial(f, **dims(h, kvh, d)))(*args, counts)):
        for ours, theirs in zip(run(ab.attention_block_reference), run(model_path)):
            assert same_bits(ours, theirs)
    # counts = T is the chain's causal mask over the state's positions
    state = st.TargetState((st.AttentionState(args[5], args[6]),), args[7])
    assert np.array_equal(ra.visible_mask(args[7], jnp.full((b,), t, jnp.int32), t, s),
                          st.causal_mask(state, st.chain_positions(state, t)))


def check_against_reference(got, ref, k_cache, lengths, t, qk, v_max):
    """The tolerances of the module docstring, and the cache outside [lengths, lengths + T) untouched."""
    attn, k_out, v_out = got
    a, r = np.asarray(attn, np.float32), np.asarray(ref[0], np.float32)
    assert np.isfinite(a).all()
    if attn.dtype == jnp.float32:
        np.testing.assert_allclose(a, r, atol=ATOL, rtol=RTOL)
    else:
        bound = 2.0 ** -7 * (v_max + np.abs(r)) + 1e-5 * v_max
        excess = np.abs(a - r) - bound
        assert (excess <= 0).all(), f"{(excess > 0).sum()} outputs past the bound, worst by {excess.max():.3g}"
    assert same_bits(v_out, ref[2])
    if attn.dtype == jnp.float32:  # XLA may contract RoPE's float32 x * cos + r * sin into an FMA
        np.testing.assert_allclose(k_out, ref[1], rtol=1e-6, atol=1e-6)
    elif not qk:
        assert same_bits(k_out, ref[1])
    else:
        ulps = np.abs(np.asarray(k_out, np.float32).view(np.int32) - np.asarray(ref[1], np.float32).view(np.int32))
        assert ulps.max() <= 1 << 16 and (ulps == 0).mean() > 0.99  # bf16 ulp = 2^16 float32 ulps
    slots = np.arange(k_cache.shape[2])
    for row, length in enumerate(np.asarray(lengths)):
        outside = (slots < length) | (slots >= length + t)
        assert same_bits(np.asarray(k_out)[row][:, outside], np.asarray(k_cache)[row][:, outside])


def run_case(case, dtype, cache_dtype=None, interpret=True):
    b, t, h, kvh, d, s, lengths, counts, qk, splits, block_s = case
    args = make_inputs(b, t, h, kvh, d, s, lengths, qk, dtype, cache_dtype)
    counts = jnp.asarray(counts, jnp.int32)
    config = ab.AttentionBlockConfig(block_s=block_s, splits=splits, interpret=interpret)
    got = ab.attention_block(*args, counts, **dims(h, kvh, d), config=config)
    with jax.default_matmul_precision("highest"):  # no TF32 in a GPU's float32 reference
        ref = jax.jit(functools.partial(ab.attention_block_reference, **dims(h, kvh, d)))(*args, counts)
    new_v = ab.split_heads(args[0], h, kvh, d)[2]
    v_max = max(float(jnp.abs(args[6].astype(jnp.float32)).max()), float(jnp.abs(new_v.astype(jnp.float32)).max()))
    check_against_reference(got, ref, args[5], args[7], t, qk, v_max)
    return args, counts, config, ref


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_float32(case):
    run_case(case, jnp.float32)


@pytest.mark.parametrize("case", [CASES[0], CASES[1]])
def test_kernel_matches_reference_bfloat16(case):
    run_case(case, jnp.bfloat16)


def test_bfloat16_activations_over_a_float32_cache():
    # the state's dtype may differ: new K/V are written in it and read back in the activation dtype
    run_case((2, 4, 8, 4, 32, 64, [9, 33], [4, 3], True, 0, 16), jnp.bfloat16, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("b, splits", [(1, 0), (1, 1), (16, 0), (16, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_on_the_gpu_at_the_qwen3_8b_shape(b, splits, dtype):
    lengths = [512 + 37 * r for r in range(b)]
    run_case((b, 16, 32, 8, 128, 1024, lengths, [16] * b, True, splits, 64), dtype, interpret=False)


def test_kernel_never_reads_past_a_rows_length():
    # NaN in every slot at or past a row's length (the new tokens' slots included): the kernel masks its
    # loads there and takes the new tokens from registers, so its output is that of the clean cache
    case = CASES[0]
    b, t, h, kvh, d, s, lengths, counts, qk, splits, block_s = case
    args, counts, config, ref = run_case(case, jnp.float32)
    past = np.arange(s)[None, :] >= np.asarray(lengths)[:, None]  # [B, S]
    poisoned = [jnp.where(past[:, None, :, None], jnp.nan, c) for c in args[5:7]]
    got = ab.attention_block(*args[:5], *poisoned, args[7], counts, **dims(h, kvh, d), config=config)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------------
# Where the kernel does not apply


def call(b=1, t=4, h=4, kvh=2, d=32, s=64, qk=True, dtype=jnp.float32, norm_dtype=None, interpret=True, **config):
    args = list(make_inputs(b, t, h, kvh, d, s, [0] * b, qk, dtype))
    if qk and norm_dtype is not None:
        args[1], args[2] = (w.astype(norm_dtype) for w in args[1:3])
    cfg = ab.AttentionBlockConfig(interpret=interpret, **config)
    return ab.attention_block(*args, jnp.full((b,), t, jnp.int32), **dims(h, kvh, d), config=cfg)


@pytest.mark.parametrize("kwargs, match", [
    (dict(t=3), "power-of-two token counts"),
    (dict(h=6, kvh=2), "heads per KV head"),
    (dict(d=48), "head dims"),
    (dict(d=16), "head dims"),
    (dict(t=64, h=16, kvh=2), "query rows"),
    (dict(s=40), "no power-of-two divisor"),
    (dict(norm_dtype=jnp.bfloat16), "norms in one dtype"),
    (dict(interpret=False), "runs on GPUs"),
])
def test_falls_through_where_the_kernel_does_not_apply(kwargs, match):
    if "interpret" in kwargs and jax.default_backend() == "gpu":
        pytest.skip("a GPU backend runs the kernel")
    with pytest.raises(NotImplementedError, match=match):
        call(**kwargs)


def test_inconsistent_shapes_are_value_errors():
    args = list(make_inputs(1, 4, 4, 2, 32, 64, [0], True, jnp.float32))
    with pytest.raises(ValueError, match="qkv"):
        ab.attention_block(*args, jnp.full((1,), 4, jnp.int32), **dims(4, 1, 32))
    args[3] = args[3][:, :2]
    with pytest.raises(ValueError, match="cos"):
        ab.attention_block_reference(*args, jnp.full((1,), 4, jnp.int32), **dims(4, 2, 32))


@pytest.mark.parametrize("kwargs", [dict(block_s=48), dict(block_s=8), dict(splits=-1), dict(num_warps=3),
                                    dict(num_stages=0)])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        ab.AttentionBlockConfig(**kwargs)


def test_auto_splits_fill_the_device_at_batch_one():
    assert ab.auto_splits(1, 8, 1024, 64) == 16  # capped by the cache's 16 blocks
    assert ab.auto_splits(1, 8, 8192, 64) == 33  # ceil(264 / 8)
    assert ab.auto_splits(16, 8, 1024, 64) == 3
    assert ab.auto_splits(64, 8, 1024, 64) == 1


# --------------------------------------------------------------------------------------------------
# Lowering for the GPU from this CPU machine


@pytest.mark.parametrize("b, splits", [(1, 16), (16, 1), (16, 3)])
def test_qwen3_8b_shape_lowers_for_cuda(b, splits):
    """The kernel lowers to Triton IR at Qwen3-8B's attention (T = 16, 32 / 8 heads, head_dim 128, a
    1024-slot cache), with the caches aliased to the outputs when the caller donates them."""
    t, h, kvh, d, s = 16, 32, 8, 128, 1024
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = [sds((b, t, (h + 2 * kvh) * d), bf), sds((d,), bf), sds((d,), bf), sds((b, t, d), jnp.float32),
            sds((b, t, d), jnp.float32), sds((b, kvh, s, d), bf), sds((b, kvh, s, d), bf), sds((b,), jnp.int32),
            sds((b,), jnp.int32)]
    f = functools.partial(ab.attention_block_pallas, **dims(h, kvh, d), block_s=64, splits=splits)
    try:
        lowered = jax.jit(f, donate_argnums=(5, 6)).trace(*args).lower(lowering_platforms=("cuda",))
    except (AttributeError, TypeError) as e:  # the trace/lower API of jax >= 0.4.3x
        pytest.skip(f"lowering for another platform is unavailable here: {e}")
    text = lowered.as_text()
    assert "triton" in text
    assert text.count("tf.aliasing_output") == 2


@pytest.mark.slow
def test_bench_runs_on_the_tiny_shape():
    """The benchmark's CPU smoke run (interpreter): its rows agree with the reference within the bound."""
    spec = importlib.util.spec_from_file_location(
        "bench_attention_block", os.path.join(ROOT, "experiments", "bench", "bench_attention_block.py"))
    bench_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_module)
    record = bench_module.main(["--shape", "tiny", "--batch", "1", "--tokens", "4", "--splits", "1"])
    kernels = [r for r in record["rows"] if r["impl"] != "xla"]
    assert [r["impl"] for r in record["rows"]] == ["xla", "kernel splits=1 warps=4"]
    assert all(r["attn_within_bound"] and r["v_same_bits"] == 1.0 for r in kernels)
