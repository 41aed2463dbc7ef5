"""Dense decoder (Qwen3, Llama) as pure functions over a parameter pytree.

Design choices:
- Params are plain nested dicts: `{"embed", "layers": (per-layer dict, ...), "final_norm", "lm_head"?}`
  with linear weights stored `[in, out]`. Layers are a tuple of per-layer arrays and the layer loop is
  unrolled: scanning over stacked weights made XLA copy per-layer slices (29% of bandwidth vs 79%).
- One function, `forward`, serves prefill (T = prompt length), AR decode (T = 1) and block verification
  (T = k). It writes K/V at positions `lengths[b] + i` and returns the cache WITHOUT committing them:
  callers commit what they accept (`KVCache.commit`). `prefill` and `decode_step` are the committing
  wrappers most users want.
- `taps` are the outputs of the layers in `cfg.tap_layers`, concatenated on the feature axis
  `[B, T, n_taps * H]` — exactly what a DFlash-style drafter projects.
- `fuse_projections` turns a layer's q/k/v into one `qkv` matrix and gate/up into one `gate_up` matrix
  (checkpoints keep the separate names). At batch 1 on an H200 this took a Qwen3-8B-shaped step from
  7.2 to 5.1 ms/token: XLA rewrote the N=1024 k/v matmuls into multiply + reduce through f32
  temporaries and ran the N=12288 gate/up dots at 2.4 TB/s (docs/performance.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.cache import KVCache, write_positions
from specpilot.formats import w12
from specpilot.models.config import ModelConfig
from specpilot.models.layers import apply_rope, attention, linear, rms_norm, rope_tables

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
    h, n_layers = cfg.hidden_size, cfg.num_layers
    k_embed, k_perm, k_layers = jax.random.split(key, 3)
    out_std = std / (3.0 * (2.0 * n_layers) ** 0.5)
    embed = jax.random.normal(k_embed, (cfg.vocab_size, h), jnp.float32)
    params = {"embed": embed.astype(dtype), "final_norm": jnp.ones((h,), dtype)}
    if not cfg.tie_word_embeddings:
        perm = jax.random.permutation(k_perm, cfg.vocab_size)
        params["lm_head"] = (embed[perm].T / np.sqrt(h)).astype(dtype)
    del embed
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


def _projections(p: dict, h: jax.Array, fused: str, sizes: tuple[int, ...]):
    """The outputs of _FUSED[fused]'s matrices for h, from the fused matrix when present."""
    if fused in p:
        y = linear(h, p[fused], p.get(fused + "_bias"))
        if fused == "qkv" and isinstance(p[fused], (w12.W12NK, w12.TwinNK)):
            from pallas_kernels import w12_mosaic  # imported on use, as w12 does

            if w12_mosaic.QKV_BARRIER:  # the K-split sum materialized once, not recomputed in the norms
                y = jax.lax.optimization_barrier(y)
        return jnp.split(y, list(np.cumsum(sizes)[:-1]), axis=-1)
    return [linear(h, p[n], p.get(n + "_bias")) for n in _FUSED[fused]]


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)  # [B, T, H]


def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final-normed hidden states [..., H] -> float32 logits [..., V]."""
    if cfg.tie_word_embeddings:
        return jnp.einsum("...h,vh->...v", x, params["embed"], preferred_element_type=jnp.float32)
    if isinstance(params["lm_head"], w12.ENCODED):
        return w12.linear(x, params["lm_head"], out_dtype=jnp.float32)
    return jnp.einsum("...h,hv->...v", x, params["lm_head"], preferred_element_type=jnp.float32)


def decoder_layer(p: dict, cfg: ModelConfig, x: jax.Array, cos, sin, k_cache, v_cache,
                  start: jax.Array, mask: jax.Array):
    """One pre-norm decoder layer. x: [B, T, H]; returns (x, k_cache, v_cache)."""
    b, t, _ = x.shape
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = _projections(p, h, "qkv", (cfg.q_size, cfg.kv_size, cfg.kv_size))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = write_positions(k_cache, k, start)
    v_cache = write_positions(v_cache, v, start)
    attn = attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
    x = x + linear(attn.reshape(b, t, cfg.q_size), p["o"], p.get("o_bias"))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    g, u = _projections(p, h, "gate_up", (cfg.intermediate_size, cfg.intermediate_size))
    x = x + linear(jax.nn.silu(g) * u, p["down"], p.get("down_bias"))
    return x, k_cache, v_cache


def hidden_forward(params: Params, cfg: ModelConfig, x: jax.Array, cache: KVCache):
    """Decoder stack over input embeddings x [B, T, H] starting at cache.lengths.

    Returns (final-normed hidden [B, T, H], taps [B, T, n_taps*H], cache with K/V written, uncommitted).
    """
    b, t, _ = x.shape
    start = cache.lengths  # [B]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    cos, sin = rope_tables(positions, cfg.inv_freq())
    key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
    mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    new_k, new_v, taps = [], [], []
    for i, p in enumerate(params["layers"]):
        x, kc, vc = decoder_layer(p, cfg, x, cos, sin, cache.k[i], cache.v[i], start, mask)
        new_k.append(kc)
        new_v.append(vc)
        if i in cfg.tap_layers:
            taps.append(x)
    taps_arr = jnp.concatenate(taps, axis=-1) if taps else jnp.zeros((b, t, 0), x.dtype)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return x, taps_arr, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache):
    """tokens [B, T] -> (logits [B, T, V] float32, taps [B, T, n_taps*H], cache with K/V written).

    Positions start at `cache.lengths`; nothing is committed (see `KVCache.commit`).
    """
    x, taps, cache = hidden_forward(params, cfg, embed(params, tokens), cache)
    return lm_head(params, cfg, x), taps, cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache):
    """Jitted `forward` with the cache donated: AR decode (T = 1) and block verification (T = k)."""
    return forward(params, cfg, tokens, cache)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, prompt_lengths: jax.Array,
            cache: KVCache):
    """Prompt pass. tokens [B, T] right-padded, prompt_lengths [B] (1 <= len <= T).

    Returns (logits at each prompt's last token [B, V], taps [B, T, n_taps*H], cache committed by
    prompt_lengths). Padding positions are written but never committed, so later steps overwrite them.
    """
    logits, taps, cache = forward(params, cfg, tokens, cache)
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return last, taps, cache.commit(prompt_lengths)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache):
    """AR step: tokens [B] -> (logits [B, V], taps [B, 1, n_taps*H], cache committed by one)."""
    logits, taps, cache = forward(params, cfg, tokens[:, None], cache)
    return logits[:, 0], taps, cache.commit(1)
