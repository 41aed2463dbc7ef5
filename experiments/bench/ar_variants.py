"""Decode-step variants of the dense decoder, for measuring where AR decode time goes.

Design notes: docs/design/bench.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from specpilot.state import AttentionState, TargetState, write_slots
from specpilot.models import dense
from specpilot.models.layers import apply_rope, attention, rms_norm, rope_tables


@dataclasses.dataclass(frozen=True)
class Variant:
    stock: bool = False  # run dense.forward itself (other fields except `loop` ignored)
    fuse: bool = False  # q/k/v -> one [H, q+2kv] matrix; gate/up -> one [H, 2I]
    layout: str = "kn"  # "kn": [in, out] (dense.py); "nk": [out, in] (XLA's dot of bf16 weights only)
    attention: bool = True  # False: the attention output is q itself (ablation)
    elementwise: bool = True  # False: no RMSNorms, qk-norm or RoPE (ablation)
    loop: str = "host"  # "host": one jitted step per token; "fori": all tokens in one jit
    lean: bool = False  # fused only: one RMSNorm + RoPE over q and k heads together, deferred softmax
    matmul: dispatch.OpChoice | None = None  # every product's implementation (None: each weight's own)

    @property
    def param_key(self) -> tuple:
        return ("stock",) if self.stock else (self.fuse, self.layout)


VARIANTS: dict[str, Variant] = {
    "stock": Variant(stock=True),
    "stock_fori": Variant(stock=True, loop="fori"),
    "replica": Variant(),
    "fused": Variant(fuse=True),
    "fused_nk": Variant(fuse=True, layout="nk"),
    "fused_fori": Variant(fuse=True, loop="fori"),
    "fused_lean": Variant(fuse=True, lean=True),
    "fused_nk_lean": Variant(fuse=True, layout="nk", lean=True),
    "fused_lean_fori": Variant(fuse=True, lean=True, loop="fori"),
    "fused_no_attention": Variant(fuse=True, attention=False),
    "no_attention": Variant(attention=False),
    "matmul_only": Variant(attention=False, elementwise=False),
    "fused_matmul_only": Variant(fuse=True, attention=False, elementwise=False),
}

_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def prepare_params(params: dict, cfg, v: Variant) -> dict:
    """Stock params -> this variant's layout (new device arrays; stock params untouched)."""
    if v.stock:
        return params
    tr = (lambda w: w.T) if v.layout == "nk" else (lambda w: w)

    @jax.jit
    def convert(p):
        out = {n: p[n] for n in p if n not in _MATRICES}
        if v.fuse:
            out["qkv"] = tr(jnp.concatenate([p["q"], p["k"], p["v"]], axis=1))
            out["gate_up"] = tr(jnp.concatenate([p["gate"], p["up"]], axis=1))
        else:
            out.update({n: tr(p[n]) for n in ("q", "k", "v", "gate", "up")})
        out["o"], out["down"] = tr(p["o"]), tr(p["down"])
        return out

    new = {n: params[n] for n in params if n not in ("layers", "lm_head")}
    new["layers"] = tuple(jax.block_until_ready(convert(p)) for p in params["layers"])
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    new["lm_head"] = jax.jit(tr)(head) if v.layout == "nk" or cfg.tie_word_embeddings else head
    return new


def _linear(x: jax.Array, w, v: Variant, role: str, out_dtype=None) -> jax.Array:
    """x [B, T, K] @ W -> [B, T, N] in out_dtype (default x's), float32 accumulation. A plain bf16 array is
    XLA's dot of the rows (no implementation of `dispatch.matmul` takes it otherwise), in either layout."""
    if isinstance(w, jax.Array):
        b, t, k = x.shape
        spec = "mk,kn->mn" if v.layout == "kn" else "mk,nk->mn"
        y = jnp.einsum(spec, x.reshape(b * t, k), w, preferred_element_type=jnp.float32)
        return y.astype(out_dtype or x.dtype).reshape(b, t, -1)
    if v.layout != "kn":
        raise ValueError("kernel layouts multiply [in, out] weights (layout 'kn')")
    return dispatch.matmul(x, w, choice=v.matmul, role=role, out_dtype=out_dtype)


def _attention_deferred(q, k, v, mask):
    """GQA attention with the softmax division after P @ V (on [.., D] instead of [.., S]): lets XLA
    emit exp and its row sum as one fusion. q [B, T, H, D]; k, v [B, KVH, S, D]; mask [B, T, S]."""
    b, t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    denom = jnp.sum(e, axis=-1)  # [B, KVH, G, T]
    out = jnp.einsum("bkgts,bksd->btkgd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.moveaxis(denom, -1, 1)[..., None]
    return out.reshape(b, t, h, d).astype(q.dtype)


def _layer(p: dict, cfg, v: Variant, x, cos, sin, k_cache, v_cache, start, mask):
    """One decoder layer."""
    b, t, _ = x.shape
    nq, nkv = cfg.q_size, cfg.kv_size
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps) if v.elementwise else x
    if v.fuse:
        qkv = _linear(h, p["qkv"], v, "qkv")
        q, k, val = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:
        q, k, val = (_linear(h, p[n], v, n) for n in ("q", "k", "v"))
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    val = val.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if v.lean and v.fuse and v.elementwise:
        # q and k heads side by side: one norm and one RoPE fusion instead of one each.
        qk = qkv[..., :nq + nkv].reshape(b, t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            w = jnp.concatenate([jnp.broadcast_to(p["q_norm"], (cfg.num_heads, cfg.head_dim)),
                                 jnp.broadcast_to(p["k_norm"], (cfg.num_kv_heads, cfg.head_dim))])
            qk = rms_norm(qk, w, cfg.rms_norm_eps)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, :cfg.num_heads], qk[:, :, cfg.num_heads:]
    elif v.elementwise:
        if cfg.qk_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = write_slots(k_cache, k, start)
    v_cache = write_slots(v_cache, val, start)
    if not v.attention:
        attn = q
    elif v.lean:
        attn = _attention_deferred(q, k_cache, v_cache, mask)
    else:
        attn = attention(q, k_cache, v_cache, mask)
    x = x + _linear(attn.reshape(b, t, nq), p["o"], v, "o")
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps) if v.elementwise else x
    if v.fuse:
        gu = _linear(h, p["gate_up"], v, "gate_up")
        g, u = gu[..., :cfg.intermediate_size], gu[..., cfg.intermediate_size:]
    else:
        g, u = _linear(h, p["gate"], v, "gate"), _linear(h, p["up"], v, "up")
    x = x + _linear(jax.nn.silu(g) * u, p["down"], v, "down")
    return x, k_cache, v_cache


def forward(params: dict, cfg, v: Variant, tokens: jax.Array, cache: TargetState):
    """tokens [B, T] -> (logits [B, T, V] float32, cache with K/V written, uncommitted)."""
    if v.stock:
        logits, _, cache = dense.chain_forward(params, cfg, tokens, cache)
        return logits, cache
    x = dense.embed(params, tokens)
    t = tokens.shape[1]
    start = cache.lengths
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(positions, cfg.inv_freq())
    mask = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
    ks, vs = [], []
    layers = params["layers"]
    for i, p in enumerate(layers):
        x, kc, vc = _layer(p, cfg, v, x, cos, sin, cache.layers[i].k, cache.layers[i].v, start, mask)
        ks.append(kc)
        vs.append(vc)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps) if v.elementwise else x
    logits = _linear(x, params["lm_head"], v, "lm_head", out_dtype=jnp.float32)
    layers = tuple(AttentionState(k, v_) for k, v_ in zip(ks, vs))
    return logits, TargetState(layers=layers, lengths=cache.lengths)


def linear_call_labels(params: dict) -> list[str]:
    """The matrices a step multiplies, in call order (each layer's, then the LM head), by their names in
    `params`' layers: fused q/k/v and gate/up where the params hold them (`Variant.fuse`, or dense.forward
    over such params)."""
    layer = ["qkv", "o", "gate_up", "down"] if "qkv" in params["layers"][0] else ["q", "k", "v", "o", "gate", "up",
                                                                                 "down"]
    return layer * len(params["layers"]) + ["lm_head"]


def make_step(cfg, v: Variant):
    """Jitted greedy AR step (cache donated): (params, tokens [B], cache) -> (next [B], logits [B, V], cache)."""

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def step(params, tokens, cache):
        logits, cache = forward(params, cfg, v, tokens[:, None], cache)
        logits = logits[:, 0]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, cache.commit(1)

    return step


def make_generate(cfg, v: Variant, new_tokens: int):
    """Jitted greedy generation of new_tokens tokens inside one `fori_loop` (cache donated):
    (params, tokens [B], cache) -> (generated [B, new_tokens], cache)."""

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def generate(params, tokens, cache):
        def body(i, carry):
            tok, cache, out = carry
            logits, cache = forward(params, cfg, v, tok[:, None], cache)
            nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return nxt, cache.commit(1), out.at[:, i].set(nxt)

        out = jnp.zeros((tokens.shape[0], new_tokens), jnp.int32)
        _, cache, out = jax.lax.fori_loop(0, new_tokens, body, (tokens, cache, out))
        return out, cache

    return generate
