"""Step counts against brute force: the jaxprs of the real phase functions of tiny dense and hybrid targets.

For each stage, `costmodel_bruteforce` walks the jaxpr of the phase the decoding loop jits
(`spec.draft_phase`, `verify_phase`, `accept_phase`; `ar.ar_step` for AR) and sums 2*M*N*K over every
dot_general (weight products apart from attention / recurrence products) and the bytes of every weight
leaf it reads. The counts must equal them exactly.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import costmodel_bruteforce as bf
from specpilot.decoding import ar, spec
from specpilot.decoding.sampling import GREEDY
from specpilot.costmodel.counts import Shape, step_counts
from specpilot.models import dense, drafter as dr, hybrid
from specpilot.models.config import ModelConfig
from specpilot.models.hybrid_config import HybridConfig
from specpilot.models.oracle import OracleDrafter
from specpilot.plan import Plan

DENSE = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, qk_norm=True, tap_layers=(0, 2))
HYBRID = HybridConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, partial_rotary_factor=0.5,
                      layer_types=("linear_attention", "full_attention", "linear_attention"),
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=12, tap_layers=(0, 2))
B, S, CTX = 2, 40, 11


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _setup(cfg, dtype, block, fused=False, oracle=False, tied=False, width=None):
    cfg = dataclasses.replace(cfg, tie_word_embeddings=tied)
    key = jax.random.key(0)
    if isinstance(cfg, HybridConfig):
        tgt = hybrid.target(cfg, dtype, max_block_size=8)
        tparams = jax.eval_shape(functools.partial(hybrid.init, cfg=cfg, dtype=dtype), key)
    else:
        tgt = dense.target(cfg, dtype)
        tparams = jax.eval_shape(functools.partial(dense.init, cfg=cfg, dtype=dtype), key)
        if fused:
            tparams = jax.eval_shape(dense.fuse_projections, tparams)
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=2, block_size=block)
    drafter = dr.BlockDrafter(dcfg, cfg, draft_width=width)
    dparams = jax.eval_shape(functools.partial(dr.init, cfg=dcfg, dtype=dtype), key)
    if oracle:
        drafter = OracleDrafter(drafter, tuple([0.5] * (block - 1)))
        dparams = {"inner": dparams, "reference": jax.ShapeDtypeStruct((B, S), jnp.int32),
                   "key": jax.ShapeDtypeStruct((2,), jnp.uint32)}
    setup = spec.ChainSetup(tgt, drafter, block, max_new_tokens=16)
    tstate = jax.eval_shape(lambda: tgt.init_state(B, S))
    dstate = jax.eval_shape(lambda: drafter.init_state(dparams, B, S, dtype))
    budget = jax.ShapeDtypeStruct((B,), jnp.int32)
    req = GREEDY.for_requests(B)
    first = jax.ShapeDtypeStruct((B,), jnp.int32)
    state = jax.eval_shape(functools.partial(spec._initial_state, setup), first, tstate, dstate,
                           jax.random.key(0), budget, req)
    shape = Shape(cfg, dcfg, batch=B, context=CTX, cache_len=S, dtype_bytes=jnp.dtype(dtype).itemsize,
                  oracle=oracle, fused=fused, max_block=8, draft_width=width or 0)
    return setup, tparams, dparams, state, shape


def _compare(counts, measured, weight_bytes):
    weight_dot = sum(k.flops for k in counts.kernels if k.dot and k.cls in ("matmul", "lm_head"))
    other_dot = sum(k.flops for k in counts.kernels if k.dot and k.cls not in ("matmul", "lm_head"))
    assert weight_dot == measured.weight_dot_flops
    assert other_dot == measured.other_dot_flops
    assert counts.total("weight_bytes") == weight_bytes


CASES = [(DENSE, jnp.float32, False, False, False), (DENSE, jnp.bfloat16, True, False, True),
         (DENSE, jnp.float32, False, True, False), (HYBRID, jnp.float32, False, False, False),
         (HYBRID, jnp.bfloat16, False, True, True)]


@pytest.mark.parametrize("cfg,dtype,fused,oracle,tied", CASES,
                         ids=["dense", "dense-bf16-fused-tied", "dense-oracle", "hybrid", "hybrid-bf16-oracle-tied"])
def test_chain_step_counts_match_the_jaxpr(cfg, dtype, fused, oracle, tied):
    block = 4
    setup, tp, dp, state, shape = _setup(cfg, dtype, block, fused, oracle, tied)
    counts = step_counts(Plan("stock", verify="chain", block_size=block), shape)

    s1, blk, dlog = jax.eval_shape(functools.partial(spec.draft_phase, setup), tp, dp, state)
    m, wb = bf.count(lambda w, st: spec.draft_phase(setup, w[0], w[1], st), (tp, dp), state)
    _compare(counts.select("draft"), m, wb)

    s2, tlog, taps = jax.eval_shape(functools.partial(spec.verify_phase, setup), tp, s1, blk)
    m, wb = bf.count(lambda w, st, b: spec.verify_phase(setup, w, st, b), tp, s1, blk)
    _compare(counts.select("verify"), m, wb)

    m, wb = bf.count(lambda w, st, b, dl, tl, tx: spec.accept_phase(setup, w[0], w[1], st, b, dl, tl, tx),
                     (tp, dp), s2, blk, dlog, tlog, taps)
    _compare(counts.select("accept"), m, wb)


@pytest.mark.parametrize("cfg", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_ar_step_counts_match_the_jaxpr(cfg):
    setup, tp, _, state, shape = _setup(cfg, jnp.float32, 4)
    counts = step_counts(Plan("ar", verify="ar", block_size=1), shape)
    tokens = jax.ShapeDtypeStruct((B,), jnp.int32)
    m, wb = bf.count(lambda w, t, st: ar.ar_step(setup.target, w, GREEDY.for_requests(B), t, st,
                                                  jax.random.key(0)), tp, tokens, state.target_state)
    _compare(counts, m, wb)
    assert {k.stage for k in counts.kernels} == {"verify", "accept"}


def test_state_bytes_our_step_reads_are_the_whole_state():
    """What our verification reads of the state (attention's K/V over every slot, each recurrent layer's
    matrix and conv state) is the size of the state pytree jax builds."""
    setup, tp, _, state, shape = _setup(HYBRID, jnp.float32, 4)
    counts = step_counts(Plan("stock", verify="chain", block_size=4), shape)
    tstate = state.target_state
    kv = sum(l.k.size * 4 + l.v.size * 4 for l in tstate.layers if hasattr(l, "k"))
    rec = sum(l.matrix.size * 4 for l in tstate.layers if hasattr(l, "matrix"))
    b, t = B, 4
    attn = counts.select("verify", "attention").kernels[0]
    kv_model = attn.count * 2 * b * S * HYBRID.num_kv_heads * HYBRID.head_dim * 4
    assert kv_model == kv
    rule = [k for k in counts.kernels if k.name == "target.delta_rule"][0]
    state_bytes = rule.floor_bytes / 2  # read once, one written
    assert state_bytes == rec
    # a verification of T tokens writes T of the state's 8 per-token conv snapshots
    conv_snaps = sum(l.conv_snapshots.size * 4 for l in tstate.layers if hasattr(l, "matrix"))
    written = [k for k in counts.kernels if k.name == "target.conv_snapshots"][0].bytes
    assert written == conv_snaps * t / 8


def test_w12_plan_stores_the_linear_matrices_at_12_bits():
    _, _, _, _, shape = _setup(DENSE, jnp.bfloat16, 4)
    bf16 = step_counts(Plan("stock", verify="chain", block_size=4), shape)
    w12 = step_counts(Plan("w12", verify="chain", block_size=4, weights="w12"), shape)
    for a, b in zip(bf16.kernels, w12.kernels):
        if a.cls in ("matmul", "lm_head"):
            assert b.weight_bytes == pytest.approx(0.75 * a.weight_bytes)
        else:
            assert b.weight_bytes == a.weight_bytes


def test_a_w12_plan_of_some_matrix_classes_stores_only_those_at_12_bits():
    _, _, _, _, shape = _setup(DENSE, jnp.bfloat16, 4)
    bf16 = step_counts(Plan("stock", verify="chain", block_size=4), shape)
    mlp = step_counts(Plan("w12", verify="chain", block_size=4, weights="w12", w12_matrices=("gate_up", "down")),
                      shape)
    roles = set()
    for a, b in zip(bf16.kernels, mlp.kernels):
        mlp_product = a.cls == "matmul" and any(r in a.name for r in ("gate_up", "gate", "up", "down"))
        roles.add(mlp_product)
        assert b.weight_bytes == pytest.approx((0.75 if mlp_product else 1.0) * a.weight_bytes), a.name
    assert roles == {True, False}  # both kinds of product were counted


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="Shape.batch"):
        Shape(DENSE, batch=0)
    with pytest.raises(ValueError, match="no drafter"):
        step_counts(Plan("stock", verify="chain", block_size=4), Shape(DENSE))
    with pytest.raises(ValueError, match="max_block"):
        step_counts(Plan("stock", verify="chain", block_size=16), Shape(HYBRID, batch=1, max_block=8,
                                                                         drafter=object()))


def test_qwen3_8b_stock_step_matches_hand_counts():
    q8 = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                     tap_layers=(1, 9, 17, 25, 33))
    dcfg = dr.DrafterConfig.for_target(q8, num_layers=5, block_size=16)
    shape = Shape(q8, dcfg, batch=1, context=512, cache_len=1024, dtype_bytes=2, fused=True)
    c = step_counts(Plan("stock", verify="chain", block_size=16), shape)
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 12288  # q,k,v,o + gate,up,down
    norms = 2 * 4096 + 2 * 128  # attn/mlp norm, q/k norm
    head = 151936 * 4096
    verify = c.select("verify")
    assert verify.select(cls=("matmul", "lm_head")).total("weight_bytes") == 2 * (36 * layer + head)
    assert verify.total("weight_bytes") == 2 * (36 * (layer + norms) + 4096 + head + 16 * 4096)
    assert verify.select(cls="attention").total("floor_bytes") == 36 * 2 * 512 * 1024 * 2
    assert verify.select(cls="attention").total("bytes") > 36 * 2 * 1024 * 1024 * 2  # every slot read
    # the draft: 5 layers, the target's head on 15 rows; the accept: fc over 5 taps, 5 x k/v
    draft = c.select("draft", ("matmul", "lm_head"))
    assert draft.total("weight_bytes") == 2 * (5 * layer + head)
    assert draft.total("flops") == 2 * 16 * 5 * layer + 2 * 15 * head
    extend = c.select("accept", "matmul")
    assert extend.total("weight_bytes") == 2 * (5 * 4096 * 4096 + 5 * 2 * 4096 * 1024)


@pytest.mark.parametrize("impl", ["triton", "triton_block"])
def test_a_chain_attention_kernel_reads_each_rows_keys_and_keeps_scores_on_chip(impl):
    """Hand counts at the Qwen3-8B shape, 16 rows: the Pallas chain attention reads the committed keys and
    the block's (not every cache slot) and writes no scores or mask; XLA's reads every slot and moves its
    scores (float32 and bf16, written and read) and mask through memory. The drafter's attention is not
    the target's kernel and stays as counted."""
    from specpilot.plan import Kernels, OpChoice

    q8 = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6,
                     tap_layers=(1, 9, 17, 25, 33))
    dcfg = dr.DrafterConfig.for_target(q8, num_layers=5, block_size=16)
    b, ctx, cache, t = 16, 1088, 1152, 16
    shape = Shape(q8, dcfg, batch=b, context=ctx, cache_len=cache, dtype_bytes=2, fused=True)
    xla = step_counts(Plan("stock", verify="chain", block_size=t), shape)
    kern = step_counts(Plan("k", verify="chain", block_size=t,
                            kernels=Kernels(attention=OpChoice((impl, "xla")))), shape)
    qo = 2 * b * t * 32 * 128 * 2
    kv = lambda slots: 2 * b * slots * 8 * 128 * 2  # noqa: E731
    scores = b * 32 * t * cache
    assert xla.select("verify", "attention").total("bytes") == 36 * (kv(cache) + qo + scores * 12 + b * t * cache)
    assert kern.select("verify", "attention").total("bytes") == 36 * (kv(ctx + t) + qo)
    assert kern.select("verify", "attention").total("floor_bytes") == xla.select("verify", "attention").total("floor_bytes")
    assert kern.select("draft", "attention").total("bytes") == xla.select("draft", "attention").total("bytes")
    assert kern.select("verify", "matmul").total("bytes") == xla.select("verify", "matmul").total("bytes")


@pytest.mark.parametrize("order, head", [(("cpu_rows", "xla"), "cpu_rows/f32"), (("xla", "cpu_rows"), "xla-tied/f32"),
                                         (("xla",), "xla-tied/f32")])
def test_a_tied_head_is_priced_on_the_kernel_that_multiplies_it(order, head):
    """dispatch.prepare_params lays the embedding's transpose out for the CPU rows kernel (`tied_head`) only
    when the kernel comes before XLA in float32; the cost model prices the head as that kernel's product."""
    from specpilot.plan import Kernels, OpChoice

    cfg = dataclasses.replace(DENSE, tie_word_embeddings=True)
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    plan = Plan("stock", verify="chain", block_size=4, kernels=Kernels(matmul=OpChoice(order)))
    shape = Shape(target=cfg, drafter=dcfg, batch=1, context=CTX, dtype_bytes=4)
    heads = [k for k in step_counts(plan, shape).kernels if k.name.endswith(".lm_head")]
    assert heads and {k.impl for k in heads} == {head}
    layers = {k.impl for k in step_counts(plan, shape).kernels if k.name == "target.o"}
    assert layers == {"cpu_rows/f32" if order[0] == "cpu_rows" else "xla/f32"}
    assert {k.impl for k in step_counts(plan, dataclasses.replace(shape, dtype_bytes=2)).kernels
            if k.name.endswith(".lm_head")} == {"xla-tied/bf16"}


@pytest.mark.parametrize("oracle", [False, True], ids=["drafter", "oracle"])
def test_a_draft_wider_than_the_block_is_counted_as_drafted(oracle):
    """draft_width 8 at block 4: every draft layer over 8 rows, 4 of them written, 4 extra keys attended to."""
    block, width = 4, 8
    setup, tp, dp, state, shape = _setup(DENSE, jnp.float32, block, oracle=oracle, width=width)
    counts = step_counts(Plan("stock", verify="chain", block_size=block), shape)
    m, wb = bf.count(lambda w, st: spec.draft_phase(setup, w[0], w[1], st), (tp, dp), state)
    _compare(counts.select("draft"), m, wb)
    narrow = step_counts(Plan("stock", verify="chain", block_size=block), dataclasses.replace(shape, draft_width=0))
    assert counts.select("draft").total("flops") > 1.5 * narrow.select("draft").total("flops")
