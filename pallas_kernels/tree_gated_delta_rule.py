"""The gated delta rule over a token tree (tree verification of a Gated DeltaNet layer), Pallas Triton
backend, and its jnp reference.

Node i's state comes from its parent's (`parents[b, i]`, an earlier node, or -1: the initial state):
  S_i = e^{g_i} S_p + beta_i k_i (v_i - (e^{g_i} S_p)^T k_i)^T,   o_i = S_i^T q_i,
returning o [B, T, H, DV] and every node's state [B, T, H, DK, DV]: which node's state is committed is
known only after acceptance (the accepted path's last node, `TargetState.gather_path`), so all are kept.
A chain (parents i - 1) is the token-by-token rule (`gated_delta_rule`).

Design choices:
- The token-by-token kernel's layout (`gated_delta_rule.py`): one program per (batch x head, block of
  `block_v` value columns), since the columns of S are independent; a fori_loop over the nodes in
  index (topological) order, each node's [DK, block_v] float32 slice stored straight into the
  [B, T, H, DK, DV] output that the layer keeps as snapshots.
- The parent's state is read back from that output (the program wrote it at the parent's step): a
  tree needs random access to earlier states, which registers cannot give. The read hits L1/L2 (the
  slice was just written by the same program). A barrier after each node's store makes the stored
  slice visible to every thread of the program before a child reads it (the load's thread layout need
  not match the store's). When the parent is the previous node (chains, a tree's first child), the
  carried registers are used instead of the read-back value.
- Numerics: the products and sums of the token-by-token kernel (exact float32, sums in another order
  than XLA's), so kernel and reference agree to float32 rounding.
- What the kernel cannot take (non-power-of-two DK or DV, non-float32 inputs, a CPU backend when not
  interpreting) raises NotImplementedError, so `dispatch.tree_gated_delta_rule` falls through to the
  reference. Inconsistent shapes are a ValueError. Settings: `GatedDeltaRuleTritonConfig` (the same
  block_v, warps, stages and interpret as the token-by-token kernel's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import gated_delta_rule as gdr
from pallas_kernels.common import pow2
from pallas_kernels.gated_delta_rule import GatedDeltaRuleTritonConfig

_einsum = gdr._einsum  # full float32 products (no TF32), as the token-by-token reference


def tree_gated_delta_rule_reference(q, k, v, g, beta, initial_state, parents):
    """The rule over a token tree in jnp (a `lax.scan` over nodes in index order): the arguments of
    `gated_delta_rule_reference` plus parents [B, T] int32 (-1: fed from `initial_state`, else an earlier
    node) -> (o [B, T, H, DV], every node's state [B, T, H, DK, DV])."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    rows = jnp.arange(b)

    def step(states, inputs):
        i, q_t, k_t, v_t, g_t, b_t, par = inputs  # par [B]
        s = jnp.where((par < 0)[:, None, None, None], initial_state, states[rows, jnp.maximum(par, 0)])
        s = s * jnp.exp(g_t)[..., None, None]
        predicted = _einsum("bhkv,bhk->bhv", s, k_t)
        s = s + _einsum("bhk,bhv->bhkv", k_t, (v_t - predicted) * b_t[..., None])
        return states.at[:, i].set(s), _einsum("bhkv,bhk->bhv", s, q_t)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, parents)]
    states0 = jnp.zeros((b, t, h, dk, dv), initial_state.dtype)
    states, o = jax.lax.scan(step, states0, (jnp.arange(t), *time_major))
    return jnp.moveaxis(o, 0, 1), states


# ---- the kernel ----------------------------------------------------------------------------------------

def _kernel(parents_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, states_ref, *, barrier: bool):
    # parents_ref: [T] int32; q_ref, k_ref: [T, DK]; v_ref: [T, BV]; g_ref, beta_ref: [T]; s0_ref: [DK, BV]
    # o_ref: [T, BV]; states_ref: [T, DK, BV] (this program's head and value columns, every node)
    s0 = s0_ref[...]

    def step(t, previous):  # previous: [DK, BV] float32, node t-1's state slice
        par = parents_ref[t]
        stored = states_ref[jnp.maximum(par, 0), :, :]
        s = jnp.where(par < 0, s0, jnp.where(par == t - 1, previous, stored))
        k_t = k_ref[t, :][:, None]  # [DK, 1]
        s = s * jnp.exp(g_ref[t])
        predicted = jnp.sum(s * k_t, axis=0)  # [BV]
        s = s + k_t * (beta_ref[t] * (v_ref[t, :] - predicted))[None, :]
        o_ref[t, :] = jnp.sum(s * q_ref[t, :][:, None], axis=0)
        states_ref[t, :, :] = s
        if barrier:
            plt.debug_barrier()  # node t's slice visible to all threads before a child reads it
        return s

    jax.lax.fori_loop(0, q_ref.shape[0], step, s0)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def tree_gated_delta_rule_pallas(q, k, v, g, beta, initial_state, parents, *, block_v: int = 32,
                                 num_warps: int = 4, num_stages: int = 1, interpret: bool = False):
    """The pallas_call, on any backend the caller asks for: same arguments and results as
    `tree_gated_delta_rule_reference`."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    bv = min(block_v, dv)
    if dv % bv:
        raise NotImplementedError(f"block_v {bv} does not divide DV {dv}")

    def per_node(width, block):  # a [B, T, H, width] array: one head's every node
        return pl.BlockSpec((None, t, None, width), lambda i, j: (i // h, 0, i % h, block(j)))

    keys, values = per_node(dk, lambda j: 0), per_node(bv, lambda j: j)
    scalars = pl.BlockSpec((None, t, None), lambda i, j: (i // h, 0, i % h))
    return pl.pallas_call(
        functools.partial(_kernel, barrier=not interpret),
        grid=(b * h, dv // bv),
        in_specs=[pl.BlockSpec((None, t), lambda i, j: (i // h, 0)), keys, keys, values, scalars, scalars,
                  pl.BlockSpec((None, None, dk, bv), lambda i, j: (i // h, i % h, 0, j))],
        out_specs=[values,
                   pl.BlockSpec((None, t, None, dk, bv), lambda i, j: (i // h, 0, i % h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_gated_delta_rule",
    )(parents.astype(jnp.int32), q, k, v, g, beta, initial_state)


# ---- public API ----------------------------------------------------------------------------------------

def check_shapes(q, k, v, g, beta, initial_state, parents) -> None:
    """ValueError unless the arrays have the rule's consistent shapes (see the reference)."""
    gdr.check_shapes(q, k, v, g, beta, initial_state)
    if parents.shape != k.shape[:2]:
        raise ValueError(f"parents {parents.shape} must be [B, T] = {k.shape[:2]}")


def tree_gated_delta_rule(q, k, v, g, beta, initial_state, parents,
                          config: GatedDeltaRuleTritonConfig = GatedDeltaRuleTritonConfig()):
    """The tree rule through the kernel (same arguments and results as `tree_gated_delta_rule_reference`).
    Raises NotImplementedError where the kernel does not apply (shape, dtype or backend)."""
    check_shapes(q, k, v, g, beta, initial_state, parents)
    dk, dv = k.shape[-1], v.shape[-1]
    if not (pow2(dk) and pow2(dv)):
        raise NotImplementedError(f"the kernel tiles power-of-two head dims, got DK {dk}, DV {dv}")
    dtypes = {x.dtype for x in (q, k, v, g, beta, initial_state)}
    if dtypes != {jnp.dtype(jnp.float32)}:
        raise NotImplementedError(f"the kernel takes float32 inputs, got {sorted(map(str, dtypes))}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    return tree_gated_delta_rule_pallas(q, k, v, g, beta, initial_state, parents, block_v=config.block_v,
                                        num_warps=config.num_warps, num_stages=config.num_stages,
                                        interpret=config.interpret)
