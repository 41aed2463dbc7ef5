"""Dense decoder (Qwen3, Llama) as pure functions over a parameter pytree, and the target protocol every
target follows: `init_state` and `forward(params, cfg, tokens, positions, state, mask) -> (logits, taps,
state)` serve prefill, decode, chain and tree verification and commit nothing; `Target` bundles them
as one hashable value. Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from specpilot import sharding
from specpilot import state as st
from specpilot.models.config import ModelConfig
from specpilot.models.layers import apply_rope, cache_attention, chain_counts, linear, rms_norm, rope_tables
from specpilot.state import AttentionState, TargetState

Params = dict


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    shapes = {
        "attn_norm": (h,), "mlp_norm": (h,),
        "q": (h, cfg.q_size), "k": (h, cfg.kv_size), "v": (h, cfg.kv_size), "o": (cfg.q_size, h),
        "gate": (h, cfg.intermediate_size), "up": (h, cfg.intermediate_size),
        "down": (cfg.intermediate_size, h),
    }
    if cfg.qk_norm:
        shapes["q_norm"] = (cfg.head_dim,)
        shapes["k_norm"] = (cfg.head_dim,)
    if cfg.attention_bias:
        shapes.update(q_bias=(cfg.q_size,), k_bias=(cfg.kv_size,), v_bias=(cfg.kv_size,), o_bias=(h,))
    if cfg.mlp_bias:
        shapes.update(gate_bias=(cfg.intermediate_size,), up_bias=(cfg.intermediate_size,),
                      down_bias=(h,))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """The full params pytree as shapes (the abstract model; `init` and checkpoint I/O derive from it)."""
    top = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
           "layers": tuple(layer_shapes(cfg) for _ in range(cfg.num_layers))}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return top


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


def init(key: jax.Array, cfg: ModelConfig, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights: N(0, std) for matrices and embeddings, ones for norms, zeros for biases."""
    shapes = param_shapes(cfg)
    keys = iter(jax.random.split(key, 2 + cfg.num_layers * len(shapes["layers"][0]) + 1))

    def make(name, shape):
        if _is_norm(name):
            return jnp.ones(shape, dtype)
        if name.endswith("bias"):
            return jnp.zeros(shape, dtype)
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    params = {"embed": make("embed", shapes["embed"]), "final_norm": make("final_norm", (cfg.hidden_size,))}
    params["layers"] = tuple({n: make(n, s) for n, s in layer.items()} for layer in shapes["layers"])
    if "lm_head" in shapes:
        params["lm_head"] = make("lm_head", shapes["lm_head"])
    return params


def wide_margin_out_std(std: float, num_layers: int) -> float:
    """The std of a wide-margin init's residual writes: the layers together move the stream by a
    fraction of its norm."""
    return std / (3.0 * (2.0 * num_layers) ** 0.5)


def wide_margin_embeddings(k_embed: jax.Array, k_perm: jax.Array, vocab_size: int, hidden: int, tied: bool,
                           dtype) -> dict:
    """`embed` ~ N(0, 1) and (untied) `lm_head[:, v] = embed[pi(v)] / sqrt(H)` for a random permutation pi
    (`init_wide_margin`)."""
    embed = jax.random.normal(k_embed, (vocab_size, hidden), jnp.float32)
    out = {"embed": embed.astype(dtype)}
    if not tied:
        perm = jax.random.permutation(k_perm, vocab_size)
        out["lm_head"] = (embed[perm].T / np.sqrt(hidden)).astype(dtype)
    return out


def init_wide_margin(key: jax.Array, cfg: ModelConfig, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights whose greedy choices have wide logit margins (random-weight speed work).

    With N(0, std) everywhere a real-shape target's top-2 logits differ by ~0.01-0.1, below the
    rounding differences between programs that compute the same step with different kernels (a
    1-token step and a 16-token verification, say): greedy outputs then depend on the kernel, a
    replayed reference (the oracle drafter's) stops matching after a few tokens, and forcing reports
    near-tie flips. Here the residual stream stays close to the input token's embedding and the head
    reads it back through a fixed permutation:
    - `embed` ~ N(0, 1); each layer's residual writes (`o`, `down`) get std / (3 sqrt(2 L)), so the
      layers together move the stream by a fraction of its norm; other matrices N(0, std);
    - `lm_head[:, v] = embed[pi(v)] / sqrt(H)` for a random permutation pi: the top logit is ~sqrt(H)
      (64 at H = 4096), the others ~N(0, 1), so the margin is ~sqrt(H) - 5. A tied head reads `embed`
      itself, so its top choice is the input token, by a margin of ~H - 5 sqrt(H).
    Shapes, dtypes and therefore every timing are those of `init`; only the values differ.
    """
    h = cfg.hidden_size
    k_embed, k_perm, k_layers = jax.random.split(key, 3)
    out_std = wide_margin_out_std(std, cfg.num_layers)
    params = {**wide_margin_embeddings(k_embed, k_perm, cfg.vocab_size, h, cfg.tie_word_embeddings, dtype),
              "final_norm": jnp.ones((h,), dtype)}
    layers = []
    for i, shapes in enumerate(param_shapes(cfg)["layers"]):
        keys = iter(jax.random.split(jax.random.fold_in(k_layers, i), len(shapes)))
        layer = {}
        for name, shape in shapes.items():
            k = next(keys)
            if _is_norm(name):
                layer[name] = jnp.ones(shape, dtype)
            elif name.endswith("bias"):
                layer[name] = jnp.zeros(shape, dtype)
            else:
                s = out_std if name in ("o", "down") else std
                layer[name] = (s * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        layers.append(layer)
    params["layers"] = tuple(layers)
    return params


INITS = {"normal": init, "wide_margin": init_wide_margin}


_FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def fuse_projections(params: Params) -> Params:
    """Params with q/k/v and gate/up concatenated on the output axis (`qkv`, `gate_up`), layer by layer
    on the device; the forward pass accepts either layout. Biases are fused alike."""
    @jax.jit
    def fuse(p):
        out = dict(p)
        for fused, parts in _FUSED.items():
            for suffix in ("", "_bias"):
                if all(n + suffix in p for n in parts):
                    out[fused + suffix] = jnp.concatenate([out.pop(n + suffix) for n in parts], axis=-1)
        return out

    return {**params, "layers": tuple(fuse(p) for p in params["layers"])}


def _projections(p: dict, cfg: ModelConfig, h: jax.Array, fused: str, sizes: tuple[int, ...], y=None):
    """The outputs of _FUSED[fused]'s matrices for h, from the fused matrix when present (y: its product,
    already computed)."""
    if fused in p:
        if y is None:
            y = linear(h, p[fused], p.get(fused + "_bias"), choice=cfg.matmul, role=fused)
        return jnp.split(y, list(np.cumsum(sizes)[:-1]), axis=-1)
    return [linear(h, p[n], p.get(n + "_bias"), choice=cfg.matmul, role=n) for n in _FUSED[fused]]


def _attention_block(p: dict, cfg: ModelConfig, qkv: jax.Array, cos, sin, kv, start, mask, parents):
    """(attn [B, T, q_size], kv) from the fused attention-block kernel when the plan's chain attention names
    it (`dispatch.attention_block`) and it takes this forward, else None (the unfused path runs)."""
    choice = cfg.attention
    if (choice is None or choice.implementation[0] != "triton_block" or parents is not None or start is None
            or not isinstance(kv, AttentionState)):
        return None
    norms = (p["q_norm"], p["k_norm"]) if cfg.qk_norm else (None, None)
    try:
        attn, k_cache, v_cache = dispatch.attention_block(
            qkv, *norms, cos, sin, kv.k, kv.v, start, chain_counts(mask, start), num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, choice=choice)
    except NotImplementedError:
        return None
    return attn, AttentionState(k_cache, v_cache)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)  # [B, T, H]


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden states [..., H] -> float32 logits [..., V]."""
    if cfg.tie_word_embeddings:
        if "tied_head" in params:  # the embedding's transpose laid out for a kernel (dispatch.prepare_params)
            return dispatch.matmul(x, params["tied_head"], choice=cfg.matmul, role="lm_head", out_dtype=jnp.float32)
        return jnp.einsum("...h,vh->...v", x, params["embed"], preferred_element_type=jnp.float32)
    return dispatch.matmul(x, params["lm_head"], choice=cfg.matmul, role="lm_head", out_dtype=jnp.float32)


def _attention(p: dict, cfg: ModelConfig, h: jax.Array, qkv, cos, sin, kv: AttentionState, start, mask, parents):
    """The unfused attention block: projections (qkv: the fused product, if computed), q/k norms, RoPE, the
    K/V write and attention as the plan's choices say -> (attn [B, T, q_size], kv)."""
    b, t, _ = h.shape
    q, k, v = _projections(p, cfg, h, "qkv", (cfg.q_size, cfg.kv_size, cfg.kv_size), qkv)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv = kv.write(k, v, start)
    attn = cache_attention(q, kv, start, mask, parents, tree=cfg.tree_attention, chain=cfg.attention)
    return attn.reshape(b, t, cfg.q_size), kv


def _fuses_residual_norm(cfg: ModelConfig) -> bool:
    choice = cfg.residual_norm
    return choice is not None and choice.implementation[0] == "triton"


def _add_norm(cfg: ModelConfig, x: jax.Array, delta: jax.Array, weight: jax.Array):
    """(x + delta, its RMSNorm by weight): through `dispatch.residual_norm` when the plan's residual_norm
    names the fused kernel first, else XLA's add and norm as the model always computed them."""
    if _fuses_residual_norm(cfg):
        return dispatch.residual_norm(x, delta, weight, cfg.rms_norm_eps, choice=cfg.residual_norm)
    x = x + delta
    return x, rms_norm(x, weight, cfg.rms_norm_eps)


def decoder_layer(p: dict, cfg: ModelConfig, x: jax.Array, cos, sin, kv: AttentionState,
                  start: jax.Array, mask: jax.Array, parents: jax.Array | None = None):
    """One pre-norm decoder layer. x: [B, T, H]; K/V written at slots start[b] + i; returns (x, kv).
    parents (a tree's): attention goes through cfg.tree_attention when set; without parents (a chain's),
    through cfg.attention when set (`layers.cache_attention`)."""
    x, kv, _ = _layer(p, cfg, x, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), cos, sin, kv, start, mask,
                      parents)
    return x, kv


def _layer(p: dict, cfg: ModelConfig, x: jax.Array, h: jax.Array, cos, sin, kv: AttentionState, start, mask,
           parents, next_norm: jax.Array | None = None):
    """`decoder_layer` given h, the input's norm (the layer before may have computed it with its residual
    add), -> (x, kv, the RMSNorm of x by `next_norm`: that of the next layer's input, or the final norm;
    None without next_norm). Each residual add and the norm after it go through `_add_norm`."""
    b, t, _ = x.shape
    qkv = linear(h, p["qkv"], p.get("qkv_bias"), choice=cfg.matmul, role="qkv") if "qkv" in p else None
    block = None if qkv is None else _attention_block(p, cfg, qkv, cos, sin, kv, start, mask, parents)
    if block is not None:
        attn, kv = block
    else:
        attn, kv = _attention(p, cfg, h, qkv, cos, sin, kv, start, mask, parents)
    o = linear(attn.reshape(b, t, cfg.q_size), p["o"], p.get("o_bias"), choice=cfg.matmul, role="o")
    x, h = _add_norm(cfg, x, o, p["mlp_norm"])
    g, u = _projections(p, cfg, h, "gate_up", (cfg.intermediate_size, cfg.intermediate_size))
    down = linear(jax.nn.silu(g) * u, p["down"], p.get("down_bias"), choice=cfg.matmul, role="down")
    if next_norm is None:
        return x + down, kv, None
    x, h_next = _add_norm(cfg, x, down, next_norm)
    return x, kv, h_next


def init_state(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> TargetState:
    """Empty state: one `AttentionState` per layer, nothing committed. dtype is required (the params'
    activation dtype); None raises rather than guess."""
    layers = tuple(st.init_attention_state(batch_size, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)
                   for _ in range(cfg.num_layers))
    return TargetState(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))


def hidden_forward(params: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                   state: TargetState, mask: jax.Array, parents: jax.Array | None = None,
                   exit_layer: int | None = None):
    """Decoder stack over input embeddings x [B, T, H] at rotary positions [B, T], K/V written at
    slots state.lengths[b] + i, attention over the slots mask [B, T, S] allows. exit_layer: run only
    the first that many layers (an early exit; the later layers' state is returned unchanged).

    Returns (final-normed hidden [B, T, H], taps [B, T, n_taps*H], state with K/V written, uncommitted).
    """
    cos, sin = rope_tables(positions, cfg.inv_freq())
    lengths = state.lengths
    if _fuses_residual_norm(cfg):
        return _fused_hidden_forward(params, cfg, x, cos, sin, state, mask, parents, exit_layer)
    x, taps, state = run_layers(
        params, cfg, x, state, exit_layer,
        lambda i, p, x, kv: decoder_layer(p, cfg, x, cos, sin, kv, lengths, mask, parents))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), taps, state


def _fused_hidden_forward(params: Params, cfg: ModelConfig, x: jax.Array, cos, sin, state: TargetState, mask,
                          parents, exit_layer: int | None):
    """`hidden_forward` with each layer's last residual add fused with the norm that reads it: the next
    layer's input norm, or after the last run layer the final norm (`_add_norm`)."""
    layers = params["layers"][:exit_layer]
    norms = [p["attn_norm"] for p in layers[1:]] + [params["final_norm"]]
    # normed[i]: layer i's input norm, which layer i - 1 computes with its add (the layer loop is unrolled
    # at trace time, so the next call finds it here)
    normed = {0: rms_norm(x, norms[0] if not layers else layers[0]["attn_norm"], cfg.rms_norm_eps)}

    def layer(i, p, x, kv):
        x, kv, normed[i + 1] = _layer(p, cfg, x, normed.pop(i), cos, sin, kv, state.lengths, mask, parents,
                                      norms[i])
        return x, kv

    _, taps, state = run_layers(params, cfg, x, state, exit_layer, layer)
    return normed.pop(len(layers)), taps, state


def run_layers(params: Params, cfg, x: jax.Array, state: TargetState, exit_layer: int | None, layer):
    """The layer loop every target runs: x [B, T, H] through `params["layers"][:exit_layer]`, layer i by
    `layer(i, params_i, x, state_i) -> (x, new state_i)`, the outputs of `cfg.tap_layers` kept.
    Returns (x before the final norm, taps [B, T, n_taps*H], state with the run layers' new states and
    the later layers' unchanged, nothing committed)."""
    b, t, _ = x.shape
    layers, taps = [], []
    for i, p in enumerate(params["layers"][:exit_layer]):
        x, layer_state = layer(i, p, x, state.layers[i])
        layers.append(layer_state)
        if i in cfg.tap_layers:
            taps.append(x)
    taps_arr = jnp.concatenate(taps, axis=-1) if taps else jnp.zeros((b, t, 0), x.dtype)
    layers = tuple(layers) + tuple(state.layers[len(layers):])
    return x, taps_arr, TargetState(layers=layers, lengths=state.lengths)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            state: TargetState, mask: jax.Array, parents: jax.Array | None = None,
            exit_layer: int | None = None, logits_at: jax.Array | None = None):
    """tokens [B, T], positions [B, T] int32, mask [B, T, S] bool (True: query t sees slot s)
    -> (logits [B, T, V] float32, taps [B, T, n_taps*H], state with K/V written at slots
    lengths[b] .. lengths[b]+T-1). Nothing is committed (see `TargetState.commit`). parents [B, T]
    marks a tree forward: attention then runs as cfg.tree_attention chooses (the tree is in the mask);
    otherwise as cfg.attention chooses (lengths and counts read off the chain or prompt mask).
    exit_layer: the final norm and head read the output of that many layers (`hidden_forward`).
    logits_at [B] int32: the head reads only that position of each row -> logits [B, 1, V] (a prompt's
    last token: the head over every position of a long prefill is most of its memory)."""
    x, taps, state = hidden_forward(params, cfg, embed(params, tokens), positions, state, mask, parents,
                                    exit_layer)
    return lm_head(params, cfg, at_positions(x, logits_at)), taps, state


def at_positions(x: jax.Array, at: jax.Array | None) -> jax.Array:
    """x [B, T, ...] at position at[b] of each row -> [B, 1, ...]; x itself where `at` is None."""
    if at is None:
        return x
    index = at.astype(jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)


def chain_forward(params: Params, cfg: ModelConfig, tokens: jax.Array, state: TargetState):
    """`forward` over T chained tokens right after the committed prefix (causal mask)."""
    positions = st.chain_positions(state, tokens.shape[1])
    return forward(params, cfg, tokens, positions, state, st.causal_mask(state, positions))


@dataclasses.dataclass(frozen=True)
class Target:
    """A dense target as one hashable value (a jit static argument; params travel apart).

    `dtype` is the activation dtype, which the state takes (that of the params' embedding)."""

    cfg: ModelConfig
    dtype: str
    mesh: Any = None  # a jax.sharding.Mesh: the state it creates is sharded over it (specpilot.sharding)
    builder: ClassVar[str] = "dense.target"  # what error messages tell a user to build it with

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_positions(self) -> int:
        return self.cfg.max_position_embeddings

    def check_params(self, params: Params) -> None:
        """A clear error when params do not run at this target's dtype."""
        got = jnp.dtype(params["embed"].dtype).name
        if got != self.dtype:
            raise ValueError(f"the target was built for {self.dtype} activations but the params' "
                             f"embedding is {got}; build it with {self.builder}(cfg, {got!r})")

    def init_state(self, batch_size: int, max_len: int, dtype=None) -> TargetState:
        return sharding.constrain_state(init_state(self.cfg, batch_size, max_len, dtype or self.dtype), self.mesh)

    def with_mesh(self, mesh) -> "Target":
        """This target with its state sharded over `mesh` (None: one device)."""
        return dataclasses.replace(self, mesh=mesh)

    def forward(self, params: Params, tokens: jax.Array, positions: jax.Array, state: TargetState,
                mask: jax.Array, parents: jax.Array | None = None, exit_layer: int | None = None,
                logits_at: jax.Array | None = None):
        """`forward` with the state's mesh constraints. parents [B, T] (a tree's, `decoding.tree`):
        attention layers read the tree from the mask; parents only mark the forward as a tree's, which
        `cfg.tree_attention` computes. exit_layer: logits from the first that many layers (an early
        exit, `decoding.two_level`). logits_at [B]: logits at that position of each row only, [B, 1, V]."""
        with sharding.active(self.mesh):
            logits, taps, state = forward(params, self.cfg, tokens, positions, state, mask, parents,
                                          exit_layer, logits_at)
        return logits, taps, sharding.constrain_state(state, self.mesh)

    def exit_hidden(self, params: Params, tokens: jax.Array, positions: jax.Array, state: TargetState,
                    mask: jax.Array, parents: jax.Array | None = None, exit_layer: int | None = None):
        """`forward` up to the head: (final-normed hidden [B, T, H] after the first `exit_layer` layers,
        state) -- what a trained exit head reads (`models.exit_head`)."""
        with sharding.active(self.mesh):
            x, _, state = hidden_forward(params, self.cfg, embed(params, tokens), positions, state, mask, parents,
                                         exit_layer)
        return x, sharding.constrain_state(state, self.mesh)


def target(cfg: ModelConfig, dtype, mesh=None) -> Target:
    """The dense target for cfg with state and activations in dtype (e.g. params['embed'].dtype), its
    state sharded over `mesh` if given (params are placed apart: `sharding.shard_params`)."""
    return Target(cfg, dtype, mesh)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def step(params: Params, cfg: ModelConfig, tokens: jax.Array, state: TargetState):
    """Jitted chain forward with the state donated: AR decode (T = 1) and block verification (T = k)."""
    return chain_forward(params, cfg, tokens, state)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, prompt_lengths: jax.Array,
            state: TargetState):
    """Prompt pass. tokens [B, T] right-padded, prompt_lengths [B] (1 <= len <= T).

    Returns (logits at each prompt's last token [B, V], taps [B, T, n_taps*H], state committed by
    prompt_lengths). Padding positions are written but never committed, so later steps overwrite them.
    """
    positions = st.chain_positions(state, tokens.shape[1])
    logits, taps, state = forward(params, cfg, tokens, positions, state, st.causal_mask(state, positions),
                                  logits_at=prompt_lengths - 1)
    return logits[:, 0], taps, state.commit(prompt_lengths)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, state: TargetState):
    """AR step: tokens [B] -> (logits [B, V], taps [B, 1, n_taps*H], state committed by one)."""
    logits, taps, state = chain_forward(params, cfg, tokens[:, None], state)
    return logits[:, 0], taps, state.commit(1)
