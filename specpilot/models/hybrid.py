"""Hybrid recurrent target (Qwen3.5 text model) as pure functions over a parameter pytree, on the dense
model's layout and target protocol: each layer's token mixer is a Gated DeltaNet layer or gated softmax
attention, with per-token recurrent snapshots so verification commits the state after any accepted
token (or tree node). Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import sharding as mesh_sharding
from specpilot import state as st
from specpilot.models import dense
from specpilot.models import gated_deltanet as gdn
from specpilot.models.hybrid_config import HybridConfig
from specpilot.models.layers import apply_rope, cache_attention, linear, rope_tables
from specpilot.state import AttentionState, TargetState

Params = dict
DEFAULT_MAX_BLOCK = 16  # DFlash's block size
OFFSET_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")  # (1 + w) norms


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5's RMSNorm: norm(x) * (1 + w) in float32, cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def attention_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    shapes = {"q": (h, 2 * cfg.q_size), "k": (h, cfg.kv_size), "v": (h, cfg.kv_size),
              "o": (cfg.q_size, h), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    if cfg.attention_bias:
        shapes.update(q_bias=(2 * cfg.q_size,), k_bias=(cfg.kv_size,), v_bias=(cfg.kv_size,),
                      o_bias=(h,))
    return shapes


def layer_shapes(cfg: HybridConfig, layer: int) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    mixer = gdn.layer_shapes(cfg) if cfg.is_linear(layer) else attention_shapes(cfg)
    return {"attn_norm": (h,), "mlp_norm": (h,), **mixer, "gate": (h, i), "up": (h, i), "down": (i, h)}


def param_shapes(cfg: HybridConfig) -> dict:
    top = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
           "layers": tuple(layer_shapes(cfg, i) for i in range(cfg.num_layers))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return top


def init(key: jax.Array, cfg: HybridConfig, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights: N(0, std) matrices, (1 + w) norms at w = 0, the gated norm at 1, zero biases,
    dt_bias 1 and A = exp(A_log) ~ U(1, 16) (transformers' initialisation of the decay)."""
    shapes = param_shapes(cfg)
    counter = iter(range(10**9))

    def make(name, shape):
        k = jax.random.fold_in(key, next(counter))
        if name in OFFSET_NORMS or name.endswith("bias") and name != "dt_bias":
            return jnp.zeros(shape, dtype)
        if name in ("out_norm", "dt_bias"):
            return jnp.ones(shape, dtype)
        if name == "A_log":
            return jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0)).astype(dtype)
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    params = {name: make(name, s) for name, s in shapes.items() if name != "layers"}
    params["layers"] = tuple({n: make(n, s) for n, s in layer.items()} for layer in shapes["layers"])
    return params


RESIDUAL_WRITES = ("o", "out", "down")  # the matrices whose outputs are added to the residual stream


def init_wide_margin(key: jax.Array, cfg: HybridConfig, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights whose greedy choices have wide logit margins (`dense.init_wide_margin`'s recipe):
    `init`'s values, except the residual writes (`o`, `out`, `down`) at std / (3 sqrt(2 L)), `embed`
    ~ N(0, 1) and the head reading the stream back through a fixed permutation. The final (1 + w)
    norm at w = 0 keeps the embedding's scale, so the top logit is ~sqrt(H) and the others ~N(0, 1).
    Shapes and dtypes are `init`'s."""
    k_body, k_embed, k_perm = jax.random.split(key, 3)
    params = init(k_body, cfg, dtype, std)
    scale = dense.wide_margin_out_std(std, cfg.num_layers) / std
    params["layers"] = tuple({n: (w.astype(jnp.float32) * scale).astype(dtype) if n in RESIDUAL_WRITES else w
                              for n, w in layer.items()} for layer in params["layers"])
    params.update(dense.wide_margin_embeddings(k_embed, k_perm, cfg.vocab_size, cfg.hidden_size,
                                               cfg.tie_word_embeddings, dtype))
    return params


INITS = {"normal": init, "wide_margin": init_wide_margin}


def _partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the first cos.shape[-1] channels of each head; the rest pass through."""
    r = cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)


def gated_attention(p: dict, cfg: HybridConfig, x: jax.Array, cos, sin, kv: AttentionState,
                    start: jax.Array, mask: jax.Array, parents: jax.Array | None = None):
    """x [B, T, H] (input-normed) -> (out [B, T, H], kv with K/V written at slots start[b] + i)."""
    b, t, _ = x.shape
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_gate = linear(x, p["q"], p.get("q_bias"), choice=cfg.matmul, role="q").reshape(b, t, nh, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:].reshape(b, t, nh * d)
    k = linear(x, p["k"], p.get("k_bias"), choice=cfg.matmul, role="k").reshape(b, t, nkv, d)
    v = linear(x, p["v"], p.get("v_bias"), choice=cfg.matmul, role="v").reshape(b, t, nkv, d)
    q = _partial_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = _partial_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), cos, sin)
    kv = kv.write(k, v, start)
    out = cache_attention(q, kv, start, mask, parents, tree=cfg.tree_attention, chain=cfg.attention)
    out = out.reshape(b, t, nh * d)
    return linear(out * jax.nn.sigmoid(gate), p["o"], p.get("o_bias"), choice=cfg.matmul, role="o"), kv


def decoder_layer(p: dict, cfg: HybridConfig, layer: int, x: jax.Array, cos, sin, layer_state,
                  start: jax.Array, mask: jax.Array, parents: jax.Array | None = None):
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    if cfg.is_linear(layer):
        mixed, layer_state = gdn.gated_deltanet(p, cfg, h, layer_state, mask, start, parents)
    else:
        mixed, layer_state = gated_attention(p, cfg, h, cos, sin, layer_state, start, mask, parents)
    x = x + mixed
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    g = linear(h, p["gate"], choice=cfg.matmul, role="gate")
    u = linear(h, p["up"], choice=cfg.matmul, role="up")
    x = x + linear(jax.nn.silu(g) * u, p["down"], choice=cfg.matmul, role="down")
    return x, layer_state


def init_state(cfg: HybridConfig, batch_size: int, max_len: int, dtype=None,
               max_block_size: int = DEFAULT_MAX_BLOCK) -> TargetState:
    """Empty state: an `AttentionState` per full-attention layer, a `RecurrentState` with
    `max_block_size` snapshots per linear layer. dtype is required (the activation dtype)."""
    layers = tuple(
        gdn.init_state(cfg, batch_size, max_block_size, dtype) if cfg.is_linear(i)
        else st.init_attention_state(batch_size, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)
        for i in range(cfg.num_layers))
    return TargetState(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))


def forward(params: Params, cfg: HybridConfig, tokens: jax.Array, positions: jax.Array,
            state: TargetState, mask: jax.Array, parents: jax.Array | None = None,
            exit_layer: int | None = None, logits_at: jax.Array | None = None):
    """tokens [B, T], positions [B, T] int32, mask [B, T, S] bool, parents [B, T] for a tree's nodes
    (None: a chain or prompt) -> (logits [B, T, V] float32, taps [B, T, n_taps*H], state with K/V and
    recurrent snapshots written). Nothing is committed. exit_layer: logits from the first that many
    layers (an early exit; the later layers' state is returned unchanged). logits_at [B]: logits at
    that position of each row only, [B, 1, V] (`dense.forward`)."""
    x, taps, state = hidden_forward(params, cfg, tokens, positions, state, mask, parents, exit_layer)
    return dense.lm_head(params, cfg, dense.at_positions(x, logits_at)), taps, state


def hidden_forward(params: Params, cfg: HybridConfig, tokens: jax.Array, positions: jax.Array,
                   state: TargetState, mask: jax.Array, parents: jax.Array | None = None,
                   exit_layer: int | None = None):
    """`forward` up to the head -> (final-normed hidden [B, T, H], taps, state)."""
    x = dense.embed(params, tokens)
    cos, sin = rope_tables(positions, cfg.inv_freq())  # [B, T, rotary_dim]
    lengths = state.lengths
    x, taps, state = dense.run_layers(
        params, cfg, x, state, exit_layer,
        lambda i, p, x, layer_state: decoder_layer(p, cfg, i, x, cos, sin, layer_state, lengths, mask, parents))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), taps, state


@dataclasses.dataclass(frozen=True)
class Target(dense.Target):
    """A hybrid target as one hashable value (a jit static argument; params travel apart).

    `dtype` is the activation dtype; `max_block_size` the most tokens one forward keeps per-token
    recurrent states for, i.e. the largest verification block."""

    cfg: HybridConfig
    dtype: str
    max_block_size: int = DEFAULT_MAX_BLOCK
    builder: ClassVar[str] = "hybrid.target"

    def __post_init__(self):
        super().__post_init__()
        if self.max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {self.max_block_size}")

    def check_params(self, params: Params) -> None:
        """A clear error when params do not run at this target's dtype or do not fit its config."""
        super().check_params(params)
        want = param_shapes(self.cfg)
        if len(params["layers"]) != self.cfg.num_layers:
            raise ValueError(f"params have {len(params['layers'])} layers, the config {self.cfg.num_layers}")
        for i, (layer, shapes) in enumerate(zip(params["layers"], want["layers"])):
            if set(layer) != set(shapes):
                raise ValueError(f"layer {i} ({self.cfg.layer_types[i]}) params {sorted(layer)} do not "
                                 f"match the config's {sorted(shapes)}")

    def init_state(self, batch_size: int, max_len: int, dtype=None) -> TargetState:
        state = init_state(self.cfg, batch_size, max_len, dtype or self.dtype, self.max_block_size)
        return mesh_sharding.constrain_state(state, self.mesh)

    def forward(self, params: Params, tokens: jax.Array, positions: jax.Array, state: TargetState,
                mask: jax.Array, parents: jax.Array | None = None, exit_layer: int | None = None,
                logits_at: jax.Array | None = None):
        with mesh_sharding.active(self.mesh):
            logits, taps, state = forward(params, self.cfg, tokens, positions, state, mask, parents, exit_layer,
                                          logits_at)
        return logits, taps, mesh_sharding.constrain_state(state, self.mesh)

    def exit_hidden(self, params: Params, tokens: jax.Array, positions: jax.Array, state: TargetState,
                    mask: jax.Array, parents: jax.Array | None = None, exit_layer: int | None = None):
        with mesh_sharding.active(self.mesh):
            x, _, state = hidden_forward(params, self.cfg, tokens, positions, state, mask, parents, exit_layer)
        return x, mesh_sharding.constrain_state(state, self.mesh)


def target(cfg: HybridConfig, dtype, max_block_size: int = DEFAULT_MAX_BLOCK, mesh=None) -> Target:
    """The hybrid target for cfg with activations in dtype (e.g. params['embed'].dtype), its state
    sharded over `mesh` if given."""
    return Target(cfg, dtype, mesh=mesh, max_block_size=max_block_size)


def num_params(cfg: HybridConfig) -> int:
    leaves = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
                                       and all(isinstance(i, int) for i in x))
    return int(sum(np.prod(s) for s in leaves))
