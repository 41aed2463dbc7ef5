"""Gated DeltaNet layer (Qwen3.5's linear attention) and its forms of the gated delta rule: recurrent
(every per-token state, for decode and verification, through `dispatch.gated_delta_rule`), chunked
(prefill) and over a tree (each node from its parent, through `dispatch.tree_gated_delta_rule`).
Design notes: docs/design/models.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.gated_delta_rule import gated_delta_rule_reference
from pallas_kernels.tree_gated_delta_rule import tree_gated_delta_rule_reference
from jax.sharding import PartitionSpec as P

from specpilot import sharding
from specpilot.models.layers import linear
from specpilot.state import RecurrentState, init_recurrent_state

L2_EPS = 1e-6  # transformers' and fla's l2norm epsilon
CHUNK_SIZE = 64


def _einsum(spec: str, *operands):
    # Full float32 products: a GPU's default would round them to TF32, and the state accumulates.
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)


def layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The token mixer's params (a HybridConfig)."""
    h, nv = cfg.hidden_size, cfg.linear_num_value_heads
    return {"qkv": (h, cfg.conv_dim), "z": (h, cfg.value_dim), "b": (h, nv), "a": (h, nv),
            "conv": (cfg.linear_conv_kernel_dim, cfg.conv_dim), "A_log": (nv,), "dt_bias": (nv,),
            "out_norm": (cfg.linear_value_head_dim,), "out": (cfg.value_dim, h)}


def init_state(cfg, batch_size: int, max_snapshots: int, dtype) -> RecurrentState:
    """Zero conv state (dtype) and matrix state (float32), `max_snapshots` per-token snapshots."""
    return init_recurrent_state(batch_size, cfg.linear_conv_kernel_dim, cfg.conv_dim,
                                cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                cfg.linear_value_head_dim, max_snapshots, dtype)


# --------------------------------------------------------------------------------------------------
# The gated delta rule


# The recurrent form is the kernels' reference; the layer computes it through `dispatch.gated_delta_rule`
# (a plan's kernels.gated_delta_rule: this reference or the Pallas kernel).
recurrent_gated_delta_rule = gated_delta_rule_reference
# The per-node tree recurrence likewise (`dispatch.tree_gated_delta_rule`, a plan's
# kernels.tree_gated_delta_rule: this reference or the Pallas kernel).
tree_gated_delta_rule = tree_gated_delta_rule_reference


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size: int = CHUNK_SIZE):
    """Chunk by chunk (same arguments as `recurrent_gated_delta_rule`) -> (o [B, T, H, DV], final
    state [B, H, DK, DV]). T is zero-padded to a multiple of chunk_size (beta = g = 0: no update)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk_size
    n = (t + pad) // chunk_size

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n, chunk_size) + x.shape[2:])  # [B, N, C, H, ...]
        return jnp.swapaxes(jnp.moveaxis(x, 1, 0), 2, 3)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))  # [N, B, H, C(, D)]
    cum = jnp.cumsum(gc, axis=-1)  # [N, B, H, C] log decay from the chunk start to each token
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    # decay[i, j] = exp(G_i - G_j) for j <= i (the decay between tokens j and i), else 0
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    # UT transform: (I + strictly_lower(beta k k^T * decay)) [u | w] = [beta v | beta k e^G]
    system = _einsum("...ik,...jk->...ij", k_beta, kc) * decay
    system = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk_size, dtype=system.dtype)
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    u, w = solved[..., :dv], solved[..., dv:]  # [N, B, H, C, DV], [N, B, H, C, DK]
    intra = _einsum("...ik,...jk->...ij", qc, kc) * decay  # [N, B, H, C, C]
    q_decayed = qc * jnp.exp(cum)[..., None]
    k_to_end = kc * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, B, H, 1, 1]

    def step(s, inputs):
        u_c, w_c, q_c, k_c, intra_c, decay_c = inputs
        v_new = u_c - _einsum("bhck,bhkv->bhcv", w_c, s)  # what the state does not predict yet
        o = _einsum("bhck,bhkv->bhcv", q_c, s) + _einsum("bhij,bhjv->bhiv", intra_c, v_new)
        s = s * decay_c + _einsum("bhck,bhcv->bhkv", k_c, v_new)
        return s, o

    final, o = jax.lax.scan(step, initial_state, (u, w, q_decayed, k_to_end, intra, chunk_decay))
    o = jnp.moveaxis(o, 0, 1)  # [B, N, H, C, DV]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n * chunk_size, h, dv)[:, :t]
    return o, final


def _tree_conv(x: jax.Array, weight: jax.Array, conv_state: jax.Array, parents: jax.Array):
    """The causal depthwise conv + SiLU along each node's ancestor chain. x [B, T, C], weight [W, C],
    conv_state [B, W-1, C] (the inputs before the root), parents [B, T] -> (y [B, T, C], every node's
    conv state [B, T, W-1, C])."""
    width, t = weight.shape[0], x.shape[1]
    ext = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    # the input before each entry of ext: the previous conv-state row, a node's parent, the state's end
    before_state = jnp.broadcast_to(jnp.maximum(jnp.arange(width - 1, dtype=jnp.int32) - 1, 0),
                                    (x.shape[0], width - 1))
    before_node = jnp.where(parents < 0, width - 2, width - 1 + parents)
    before = jnp.concatenate([before_state, before_node], axis=1)  # [B, W-1+T]
    idx = [jnp.broadcast_to(width - 1 + jnp.arange(t, dtype=jnp.int32), parents.shape)]  # the nodes
    for _ in range(width - 1):
        idx.append(jnp.take_along_axis(before, jnp.maximum(idx[-1], 0), axis=1))
    idx = jnp.stack(idx[::-1], axis=2)  # [B, T, W]: oldest input first, the node last
    window = jax.vmap(lambda e, i: e[i])(ext, idx)  # [B, T, W, C]
    wf = window.astype(jnp.float32)
    y = sum(wf[:, :, j] * weight[j].astype(jnp.float32) for j in range(width))
    return jax.nn.silu(y).astype(x.dtype), window[:, :, 1:]


# --------------------------------------------------------------------------------------------------
# The layer


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """w * RMSNorm(x) * silu(gate) over the last axis (plain weight, not 1 + w)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * xf.astype(dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


def fed_tokens(mask: jax.Array, start: jax.Array) -> jax.Array:
    """[B] int32: how many of the forward's T tokens (at slots start[b] + i) its last query sees.

    A chain's causal mask gives T; a prompt mask (`state.prompt_mask`) gives the prompt's length,
    so right padding is skipped. Recurrent layers read chains only: a tree mask has no such prefix.
    """
    t = mask.shape[1]
    slots = jnp.arange(mask.shape[2], dtype=jnp.int32)[None, :]
    own = (slots >= start[:, None]) & (slots < start[:, None] + t)
    return jnp.sum(mask[:, -1, :] & own, axis=-1).astype(jnp.int32)


def _short_conv(x: jax.Array, weight: jax.Array, conv_state: jax.Array):
    """Causal depthwise conv + SiLU. x [B, T, C], weight [W, C], conv_state [B, W-1, C] (the inputs
    before x) -> (y [B, T, C] in x's dtype, window [B, W-1+T, C] the state followed by x)."""
    width, t = weight.shape[0], x.shape[1]
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    wf = window.astype(jnp.float32)
    y = sum(wf[:, j:j + t] * weight[j].astype(jnp.float32) for j in range(width))
    return jax.nn.silu(y).astype(x.dtype), window


def _conv_states_after(window: jax.Array, ends: jax.Array, width: int) -> jax.Array:
    """window [B, W-1+T, C], ends [B, K] (tokens consumed) -> the conv state after each [B, K, W-1, C]."""
    idx = ends[:, :, None] + jnp.arange(width - 1, dtype=jnp.int32)[None, None, :]  # [B, K, W-1]
    return jax.vmap(lambda w, i: w[i])(window, idx)


def gated_deltanet(p: dict, cfg, x: jax.Array, layer_state: RecurrentState, mask: jax.Array,
                   start: jax.Array, parents: jax.Array | None = None):
    """The token mixer of a linear-attention layer. x [B, T, H] (input-normed), mask [B, T, S],
    start [B] (committed length), parents [B, T] for a tree's nodes (None: a chain or a prompt)
    -> (out [B, T, H], state with snapshots written, uncommitted)."""
    b, t, _ = x.shape
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, width = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    if parents is not None and t > layer_state.max_snapshots:
        raise ValueError(f"a tree of {t} nodes needs {t} recurrent snapshots, the state holds "
                         f"{layer_state.max_snapshots} (the target's max_block_size)")
    fed = jnp.full((b,), t, jnp.int32) if parents is not None else fed_tokens(mask, start)  # [B]
    live = jnp.arange(t, dtype=jnp.int32)[None, :] < fed[:, None]  # [B, T]

    projected = linear(x, p["qkv"], choice=cfg.matmul, role="in_proj_qkv")
    if parents is not None:
        mixed, node_conv = _tree_conv(projected, p["conv"], layer_state.conv, parents)
    else:
        mixed, window = _short_conv(projected, p["conv"], layer_state.conv)
    q, k, v = jnp.split(mixed, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    # [q | k | v] is not grouped by head: replicated until the heads are split below
    q, k, v = (sharding.hint(x, P("data", None, None)) for x in (q, k, v))
    rep = nv // nk  # key head j serves value heads j*rep .. j*rep+rep-1
    q = jnp.repeat(q.reshape(b, t, nk, dk), rep, axis=2).astype(jnp.float32)
    k = jnp.repeat(k.reshape(b, t, nk, dk), rep, axis=2).astype(jnp.float32)
    v = v.reshape(b, t, nv, dv).astype(jnp.float32)
    heads = P("data", None, "tensor", None)  # the recurrence splits over value heads (a local slice)
    q, k, v = (sharding.hint(x, heads) for x in (q, k, v))
    q = l2_normalize(q) * (dk ** -0.5)
    k = l2_normalize(k)
    beta = jax.nn.sigmoid(linear(x, p["b"], choice=cfg.matmul, role="b")).astype(jnp.float32)  # [B, T, HV]
    a = linear(x, p["a"], choice=cfg.matmul, role="a").astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    beta = jnp.where(live[..., None], beta, 0.0)
    g = jnp.where(live[..., None], g, 0.0)

    k_snap = layer_state.max_snapshots
    if parents is not None:  # tree verification: every node's state from its parent's
        o, states = dispatch.tree_gated_delta_rule(q, k, v, g, beta, layer_state.matrix, parents,
                                                   choice=cfg.tree_gated_delta_rule)
        layer_state = layer_state.write_snapshots(node_conv, states)
    elif t <= k_snap:  # decode / verification: every per-token state
        o, states = dispatch.gated_delta_rule(q, k, v, g, beta, layer_state.matrix, choice=cfg.gated_delta_rule)
        ends = jnp.minimum(jnp.arange(1, t + 1, dtype=jnp.int32)[None, :], fed[:, None])  # [B, T]
        layer_state = layer_state.write_snapshots(_conv_states_after(window, ends, width), states)
    else:  # prefill: chunked, the final state in every snapshot
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, layer_state.matrix)
        conv = _conv_states_after(window, fed[:, None], width)  # [B, 1, W-1, C]
        layer_state = layer_state.write_snapshots(
            jnp.broadcast_to(conv, (b, k_snap) + conv.shape[2:]),
            jnp.broadcast_to(final[:, None], (b, k_snap) + final.shape[1:]))

    o = o.astype(x.dtype)  # [B, T, HV, DV]
    z = linear(x, p["z"], choice=cfg.matmul, role="z").reshape(b, t, nv, dv)
    o = gated_rms_norm(o, z, p["out_norm"], cfg.rms_norm_eps)
    return linear(o.reshape(b, t, cfg.value_dim), p["out"], choice=cfg.matmul, role="out"), layer_state
