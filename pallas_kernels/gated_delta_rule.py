"""The gated delta rule token by token (decode and verification), Pallas Triton backend, and its jnp reference.

Per value head, with state S [DK, DV]:
  S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - (e^{g_t} S_{t-1})^T k_t)^T,   o_t = S_t^T q_t,
returning o [B, T, H, DV] and every per-token state [B, T, H, DK, DV] (accepting n drafted tokens takes
state n-1, so verification needs all of them).

Design choices:
- One program per (batch x head, block of `block_v` value columns): the columns of S are independent
  (each column's update reads only k_t, q_t, its own v_t entries and itself), so a [DK, block_v] float32
  slice of the state is the whole of a program's work. It is read once, stays in registers through a
  `fori_loop` over the T tokens, and each token's slice is stored straight into the [B, T, H, DK, DV]
  output (the layout `RecurrentState.matrix_snapshots` keeps): no transpose or copy of the big output.
  Splitting DV gives B*H*DV/block_v programs (48 heads at DV = 128, block_v = 32: 192 per row of the
  batch, above the H200's 132 SMs even at B = 1); splitting T is impossible (the recurrence is serial).
- Bytes moved: S0 read once (4 DK DV per head), T states written (4 T DK DV per head), plus the small
  q, k, v, g, beta, o (4 T (2 DK + 2 DV + 2) per head, k and q re-read by each of the DV/block_v
  programs of a head, from L2). At DK = DV = 128, T = 16 the state writes are 91% of the traffic and
  the S0 read 6%: the kernel should be bound by the write bandwidth, so its figure of merit is GB/s
  against the card's copy bandwidth (experiments/bench/bench_gated_delta_rule.py).
- Elementwise products and reductions only (no `tl.dot`): per token 4 DK block_v multiply-adds,
  nothing a tensor core would help with at one token. Float32 throughout; the products are exact float32
  (the reference asks XLA for HIGHEST precision so that a GPU does not round them to TF32). The sums run
  in another order than XLA's, so the two agree to float32 rounding, not bit for bit.
- No padding of T: each block spans the whole T axis of its arrays and the kernel loads and stores one
  token's row at a time ([DK] or [block_v] vectors, powers of two), so T itself need not be a power of two
  and the states output is exactly T long. DK and block_v must be powers of two (Triton tensor shapes).
- What the kernel cannot take (non-power-of-two DK or DV, non-float32 inputs, a CPU backend when not
  interpreting, a backend other than a GPU) raises NotImplementedError, so `dispatch.gated_delta_rule`
  falls through to the reference. Inconsistent shapes are a ValueError (a caller's bug, not a fallback).
- Settings: one frozen `GatedDeltaRuleTritonConfig` (block_v, num_warps, num_stages, interpret), static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import pow2


def _einsum(spec: str, *operands):
    # Full float32 products: a GPU's default would round them to TF32, and the state accumulates.
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)


def gated_delta_rule_reference(q, k, v, g, beta, initial_state):
    """Token by token in jnp (a `lax.scan` over T). q, k [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H],
    initial_state [B, H, DK, DV], all float32 -> (o [B, T, H, DV], states [B, T, H, DK, DV]: after each
    token)."""

    def step(s, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs  # [B, H, D*], [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = _einsum("bhkv,bhk->bhv", s, k_t)
        s = s + _einsum("bhk,bhv->bhkv", k_t, (v_t - predicted) * b_t[..., None])
        return s, (_einsum("bhkv,bhk->bhv", s, q_t), s)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    _, (o, states) = jax.lax.scan(step, initial_state, time_major)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


# ---- the kernel ----------------------------------------------------------------------------------------

def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, states_ref):
    # q_ref, k_ref: [T, DK]; v_ref: [T, BV]; g_ref, beta_ref: [T]; s0_ref: [DK, BV]
    # o_ref: [T, BV]; states_ref: [T, DK, BV] (this program's head and value columns, every token)
    def step(t, s):  # s: [DK, BV] float32, the state slice after token t-1
        k_t = k_ref[t, :][:, None]  # [DK, 1]
        s = s * jnp.exp(g_ref[t])
        predicted = jnp.sum(s * k_t, axis=0)  # [BV]
        s = s + k_t * (beta_ref[t] * (v_ref[t, :] - predicted))[None, :]
        o_ref[t, :] = jnp.sum(s * q_ref[t, :][:, None], axis=0)
        states_ref[t, :, :] = s
        return s

    jax.lax.fori_loop(0, q_ref.shape[0], step, s0_ref[...])


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def gated_delta_rule_pallas(q, k, v, g, beta, initial_state, *, block_v: int = 32, num_warps: int = 4,
                            num_stages: int = 1, interpret: bool = False):
    """The pallas_call, on any backend the caller asks for (no checks beyond the block's divisibility):
    same arguments and results as `gated_delta_rule_reference`."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    bv = min(block_v, dv)
    if dv % bv:
        raise NotImplementedError(f"block_v {bv} does not divide DV {dv}")

    # grid (i, j) = (batch x head, value block); each block spans the whole T axis of its array
    def per_token(width, block):  # a [B, T, H, width] array: one head's every token
        return pl.BlockSpec((None, t, None, width), lambda i, j: (i // h, 0, i % h, block(j)))

    keys, values = per_token(dk, lambda j: 0), per_token(bv, lambda j: j)
    scalars = pl.BlockSpec((None, t, None), lambda i, j: (i // h, 0, i % h))
    return pl.pallas_call(
        _kernel,
        grid=(b * h, dv // bv),
        in_specs=[keys, keys, values, scalars, scalars,
                  pl.BlockSpec((None, None, dk, bv), lambda i, j: (i // h, i % h, 0, j))],
        out_specs=[values,
                   pl.BlockSpec((None, t, None, dk, bv), lambda i, j: (i // h, 0, i % h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(q, k, v, g, beta, initial_state)


# ---- public API ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GatedDeltaRuleTritonConfig:
    """The Triton-backend kernel's settings: value columns per program (`block_v`, a power of two, capped
    at DV), the launch's warps and pipeline stages, and interpret (run the kernel in Pallas' interpreter:
    CPU tests; False on a CPU backend falls through to the reference)."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1
    interpret: bool = False

    def __post_init__(self):
        if not (isinstance(self.block_v, int) and pow2(self.block_v)):
            raise ValueError(f"block_v must be a power of two, got {self.block_v!r}")
        if not (isinstance(self.num_warps, int) and pow2(self.num_warps)):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"num_stages must be a positive integer, got {self.num_stages!r}")


def check_shapes(q, k, v, g, beta, initial_state) -> None:
    """ValueError unless the six arrays have the rule's consistent shapes (see the reference)."""
    if k.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [B, T, H, DK]")
    b, t, h, dk = k.shape
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v {v.shape} must be [B, T, H, DV] with B, T, H = {(b, t, h)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, h):
            raise ValueError(f"{name} {x.shape} must be [B, T, H] = {(b, t, h)}")
    if initial_state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(f"initial_state {initial_state.shape} must be [B, H, DK, DV] = {(b, h, dk, v.shape[-1])}")


def gated_delta_rule(q, k, v, g, beta, initial_state,
                     config: GatedDeltaRuleTritonConfig = GatedDeltaRuleTritonConfig()):
    """The rule through the kernel (same arguments and results as `gated_delta_rule_reference`). Raises
    NotImplementedError where the kernel does not apply (shape, dtype or backend)."""
    check_shapes(q, k, v, g, beta, initial_state)
    dk, dv = k.shape[-1], v.shape[-1]
    if not (pow2(dk) and pow2(dv)):
        raise NotImplementedError(f"the kernel tiles power-of-two head dims, got DK {dk}, DV {dv}")
    dtypes = {x.dtype for x in (q, k, v, g, beta, initial_state)}
    if dtypes != {jnp.dtype(jnp.float32)}:
        raise NotImplementedError(f"the kernel takes float32 inputs, got {sorted(map(str, dtypes))}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    return gated_delta_rule_pallas(q, k, v, g, beta, initial_state, block_v=config.block_v,
                                   num_warps=config.num_warps, num_stages=config.num_stages,
                                   interpret=config.interpret)
