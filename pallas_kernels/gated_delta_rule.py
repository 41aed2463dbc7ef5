"""The gated delta rule token by token (decode and verification) on Pallas' Triton backend, its jnp
reference, and what the tree kernel (`tree_gated_delta_rule`) shares with it: the per-token update, the
launch and the settings. Per value head, with state S [DK, DV]:
  S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - (e^{g_t} S_{t-1})^T k_t)^T,   o_t = S_t^T q_t.
Design notes: docs/design/kernels.md.
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


def reference_update(s, q_t, k_t, v_t, g_t, b_t):
    """One token of the rule in jnp: state s [B, H, DK, DV] before it, q_t, k_t [B, H, DK], v_t
    [B, H, DV], g_t, b_t [B, H] -> (the state after it, o_t [B, H, DV])."""
    s = s * jnp.exp(g_t)[..., None, None]
    predicted = _einsum("bhkv,bhk->bhv", s, k_t)
    s = s + _einsum("bhk,bhv->bhkv", k_t, (v_t - predicted) * b_t[..., None])
    return s, _einsum("bhkv,bhk->bhv", s, q_t)


def gated_delta_rule_reference(q, k, v, g, beta, initial_state):
    """Token by token in jnp (a `lax.scan` over T). q, k [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H],
    initial_state [B, H, DK, DV], all float32 -> (o [B, T, H, DV], states [B, T, H, DK, DV]: after each
    token)."""

    def step(s, inputs):  # inputs: q_t, k_t, v_t [B, H, D*], g_t, b_t [B, H]
        s, o_t = reference_update(s, *inputs)
        return s, (o_t, s)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    _, (o, states) = jax.lax.scan(step, initial_state, time_major)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


# ---- the kernel ----------------------------------------------------------------------------------------

def update_slice(t, s, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, states_ref):
    """One token of the rule on a program's [DK, BV] float32 state slice `s` (the state before token t):
    stores o and the new slice at row t and returns the slice."""
    k_t = k_ref[t, :][:, None]  # [DK, 1]
    s = s * jnp.exp(g_ref[t])
    predicted = jnp.sum(s * k_t, axis=0)  # [BV]
    s = s + k_t * (beta_ref[t] * (v_ref[t, :] - predicted))[None, :]
    o_ref[t, :] = jnp.sum(s * q_ref[t, :][:, None], axis=0)
    states_ref[t, :, :] = s
    return s


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, states_ref):
    # q_ref, k_ref: [T, DK]; v_ref: [T, BV]; g_ref, beta_ref: [T]; s0_ref: [DK, BV]
    # o_ref: [T, BV]; states_ref: [T, DK, BV] (this program's head and value columns, every token)
    def step(t, s):  # s: [DK, BV] float32, the state slice after token t-1
        return update_slice(t, s, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, states_ref)

    jax.lax.fori_loop(0, q_ref.shape[0], step, s0_ref[...])


def launch(kernel, q, k, v, g, beta, initial_state, parents=None, *, block_v: int, num_warps: int,
           num_stages: int, interpret: bool, name: str | None = None):
    """The pallas_call of either kernel: grid (batch x head, block of `block_v` value columns), each block
    spanning the whole T axis of its array. With `parents` [B, T] (the tree kernel), they are the
    kernel's first operand. Returns (o [B, T, H, DV], states [B, T, H, DK, DV])."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    bv = min(block_v, dv)
    if dv % bv:
        raise NotImplementedError(f"block_v {bv} does not divide DV {dv}")

    def per_token(width, block):  # a [B, T, H, width] array: one head's every token
        return pl.BlockSpec((None, t, None, width), lambda i, j: (i // h, 0, i % h, block(j)))

    keys, values = per_token(dk, lambda j: 0), per_token(bv, lambda j: j)
    scalars = pl.BlockSpec((None, t, None), lambda i, j: (i // h, 0, i % h))
    in_specs = [keys, keys, values, scalars, scalars,
                pl.BlockSpec((None, None, dk, bv), lambda i, j: (i // h, i % h, 0, j))]
    operands = [q, k, v, g, beta, initial_state]
    if parents is not None:
        in_specs.insert(0, pl.BlockSpec((None, t), lambda i, j: (i // h, 0)))
        operands.insert(0, parents.astype(jnp.int32))
    return pl.pallas_call(
        kernel,
        grid=(b * h, dv // bv),
        in_specs=in_specs,
        out_specs=[values,
                   pl.BlockSpec((None, t, None, dk, bv), lambda i, j: (i // h, 0, i % h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*operands)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def gated_delta_rule_pallas(q, k, v, g, beta, initial_state, *, block_v: int = 32, num_warps: int = 4,
                            num_stages: int = 1, interpret: bool = False):
    """The pallas_call, on any backend the caller asks for (no checks beyond the block's divisibility):
    same arguments and results as `gated_delta_rule_reference`."""
    return launch(_kernel, q, k, v, g, beta, initial_state, block_v=block_v, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret)


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


def require_kernel_inputs(k, v, arrays, config: GatedDeltaRuleTritonConfig) -> None:
    """NotImplementedError where the kernels do not apply: non-power-of-two head dims, inputs other than
    float32 (`arrays`), or a backend other than a GPU unless interpreting."""
    dk, dv = k.shape[-1], v.shape[-1]
    if not (pow2(dk) and pow2(dv)):
        raise NotImplementedError(f"the kernel tiles power-of-two head dims, got DK {dk}, DV {dv}")
    dtypes = {x.dtype for x in arrays}
    if dtypes != {jnp.dtype(jnp.float32)}:
        raise NotImplementedError(f"the kernel takes float32 inputs, got {sorted(map(str, dtypes))}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")


def gated_delta_rule(q, k, v, g, beta, initial_state,
                     config: GatedDeltaRuleTritonConfig = GatedDeltaRuleTritonConfig()):
    """The rule through the kernel (same arguments and results as `gated_delta_rule_reference`). Raises
    NotImplementedError where the kernel does not apply (shape, dtype or backend)."""
    check_shapes(q, k, v, g, beta, initial_state)
    require_kernel_inputs(k, v, (q, k, v, g, beta, initial_state), config)
    return gated_delta_rule_pallas(q, k, v, g, beta, initial_state, block_v=config.block_v,
                                   num_warps=config.num_warps, num_stages=config.num_stages,
                                   interpret=config.interpret)
