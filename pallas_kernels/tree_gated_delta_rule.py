"""The gated delta rule over a token tree (tree verification of a Gated DeltaNet layer) on Pallas'
Triton backend, and its jnp reference: node i's state comes from its parent's (`parents[b, i]`, an
earlier node, or -1: the initial state), and every node's state is returned, since which one is committed
is known only after acceptance. The per-token update, launch and settings are `gated_delta_rule`'s.
Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels import gated_delta_rule as gdr
from pallas_kernels.gated_delta_rule import GatedDeltaRuleTritonConfig


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
        s, o_t = gdr.reference_update(s, q_t, k_t, v_t, g_t, b_t)
        return states.at[:, i].set(s), o_t

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
        s = gdr.update_slice(t, s, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, states_ref)
        if barrier:
            plt.debug_barrier()  # node t's slice visible to all threads before a child reads it
        return s

    jax.lax.fori_loop(0, q_ref.shape[0], step, s0)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"))
def tree_gated_delta_rule_pallas(q, k, v, g, beta, initial_state, parents, *, block_v: int = 32,
                                 num_warps: int = 4, num_stages: int = 1, interpret: bool = False):
    """The pallas_call, on any backend the caller asks for: same arguments and results as
    `tree_gated_delta_rule_reference`."""
    return gdr.launch(functools.partial(_kernel, barrier=not interpret), q, k, v, g, beta, initial_state,
                      parents, block_v=block_v, num_warps=num_warps, num_stages=num_stages,
                      interpret=interpret, name="tree_gated_delta_rule")


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
    gdr.require_kernel_inputs(k, v, (q, k, v, g, beta, initial_state), config)
    return tree_gated_delta_rule_pallas(q, k, v, g, beta, initial_state, parents, block_v=config.block_v,
                                        num_warps=config.num_warps, num_stages=config.num_stages,
                                        interpret=config.interpret)
