"""DFlash-style parallel block drafter: one forward drafts a whole block from the target's tapped states
(`draft_block`, `BlockDrafter`), its context cache of accepted tokens (`extend_context`), and
`ReplayDrafter`, which proposes a known continuation (oracle acceptance). Its config is
`drafter_config`'s and its checkpoint format `drafter_checkpoint`'s, both also named from here.
Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import sharding
from specpilot.models import dense, draft_vocab
from specpilot.models.config import ModelConfig
# The config and checkpoint names are part of this module's API: callers reach them as `drafter.X`.
from specpilot.models.drafter_checkpoint import (PACKAGED, DrafterCheckpointError,  # noqa: F401
                                                 load_drafter, packaged_drafters, save_drafter)
from specpilot.models.drafter_config import (ARCHITECTURE, DrafterConfig, check_compatible,  # noqa: F401
                                             param_shapes)
from specpilot.models.layers import apply_rope, attention, linear, rms_norm, rope_tables, swiglu
from specpilot.state import TargetState

Params = dict


def init(key: jax.Array, cfg: DrafterConfig, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights: N(0, std) for matrices, ones for norms, zeros for biases."""
    shapes = param_shapes(cfg)
    keys = iter(jax.random.split(key, 1 + cfg.num_layers * len(shapes["layers"][0])))

    def make(name, shape):
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        if name.endswith("bias"):
            return jnp.zeros(shape, dtype)
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    return {"fc": make("fc", shapes["fc"]), "hidden_norm": make("hidden_norm", (cfg.hidden_size,)),
            "norm": make("norm", (cfg.hidden_size,)),
            "layers": tuple({n: make(n, s) for n, s in layer.items()} for layer in shapes["layers"])}


def init_context_cache(cfg: DrafterConfig, batch_size: int, max_len: int, dtype=None) -> TargetState:
    """Empty draft context cache; max_len must match the target's state (lengths stay equal). dtype is
    required (the drafter params' dtype): there is no bf16 default."""
    return dense.init_state(cfg.layer_config, batch_size, max_len, dtype)


# --------------------------------------------------------------------------------------------------
# Forward


def _keys_values(lp: dict, cfg: DrafterConfig, x: jax.Array, cos, sin):
    """A draft layer's K/V for rows x [B, T, H] (context features or normed block states)."""
    b, t, _ = x.shape
    k = linear(x, lp["k"], lp.get("k_bias"), choice=cfg.matmul, role="k")
    v = linear(x, lp["v"], lp.get("v_bias"), choice=cfg.matmul, role="v")
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, cos, sin), v  # [B, T, KVH, D] each


def arrange_taps(cfg: DrafterConfig, taps: jax.Array) -> jax.Array:
    """The target's taps [..., m*H] (layers `cfg.target_tap_layers`) -> [..., n*H] in the drafter's
    `tap_layers` order, a repeated layer's state repeated: DFlash's concatenation."""
    h, distinct = cfg.hidden_size, cfg.target_tap_layers
    if taps.shape[-1] != len(distinct) * h:
        raise ValueError(f"taps have {taps.shape[-1]} features; the drafter reads target layers "
                         f"{distinct}, {len(distinct)} x hidden {h} = {len(distinct) * h}")
    if distinct == cfg.tap_layers:
        return taps
    slot = {layer: j for j, layer in enumerate(distinct)}
    return jnp.concatenate([taps[..., slot[t] * h:(slot[t] + 1) * h] for t in cfg.tap_layers], axis=-1)


def context_features(params: Params, cfg: DrafterConfig, taps: jax.Array) -> jax.Array:
    """Target taps [B, T, m*H] (one slice per layer of `cfg.target_tap_layers`) -> normalized context
    features [B, T, H]."""
    taps = arrange_taps(cfg, taps)
    ctx = linear(taps.astype(params["fc"].dtype), params["fc"], choice=cfg.matmul, role="fc")
    return rms_norm(ctx, params["hidden_norm"], cfg.rms_norm_eps)


def extend_context(params: Params, cfg: DrafterConfig, cache: TargetState, taps: jax.Array,
                   n_new: jax.Array) -> TargetState:
    """Append context rows and commit the first n_new[b] of them.

    taps [B, T, n*H] are the target's tapped states of the tokens at positions lengths[b] + i (a prompt
    or a verified block); rows at i >= n_new[b] are written but not committed.
    """
    t = taps.shape[1]
    ctx = context_features(params, cfg, taps)  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    cos, sin = rope_tables(positions, cfg.layer_config.inv_freq())
    layers = tuple(cache.layers[i].write(*_keys_values(lp, cfg, ctx, cos, sin), cache.lengths)
                   for i, lp in enumerate(params["layers"]))
    return TargetState(layers=layers, lengths=cache.lengths).commit(n_new)


def draft_block(params: Params, cfg: DrafterConfig, target_params: Params, target_cfg: ModelConfig,
                cache: TargetState, block_tokens: jax.Array, keep: int | None = None):
    """block_tokens [B, Bs] -> (final-normed hidden [B, Bs, H], cache with block K/V written, uncommitted).

    The block sits at positions lengths[b] .. lengths[b]+Bs-1 and sees every committed context row and
    every block row (bidirectional inside the block). With `keep` < Bs only the first `keep` rows' K/V
    are written to the cache (which need only hold those); the rest are attended to from registers.
    """
    b, t = block_tokens.shape
    keep = t if keep is None else keep
    if not 0 < keep <= t:
        raise ValueError(f"keep={keep} rows of a {t}-row block")
    x = dense.embed(target_params, block_tokens).astype(params["norm"].dtype)  # [B, Bs, H]
    start = cache.lengths  # [B]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, Bs]
    cos, sin = rope_tables(positions, cfg.layer_config.inv_freq())
    key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
    visible = key_pos[None, :] < (start + keep)[:, None]  # [B, S]: context + the block's kept rows
    mask = jnp.broadcast_to(visible[:, None, :], (b, t, cache.max_len))  # [B, Bs, S]
    if keep < t:  # the rows past `keep` are keys after the cache's slots, visible to every block row
        mask = jnp.concatenate([mask, jnp.ones((b, t, t - keep), bool)], axis=2)
    layers = []
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = linear(h, lp["q"], lp.get("q_bias"), choice=cfg.matmul, role="q")
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), cos, sin)
        k, v = _keys_values(lp, cfg, h, cos, sin)  # [B, Bs, KVH, D]
        kv = cache.layers[i].write(k[:, :keep], v[:, :keep], start)
        layers.append(kv)
        keys, values = kv.k.astype(q.dtype), kv.v.astype(q.dtype)  # [B, KVH, S, D]
        if keep < t:
            keys = jnp.concatenate([keys, k[:, keep:].transpose(0, 2, 1, 3).astype(q.dtype)], axis=2)
            values = jnp.concatenate([values, v[:, keep:].transpose(0, 2, 1, 3).astype(q.dtype)], axis=2)
        attn = attention(q, keys, values, mask)
        x = x + linear(attn.reshape(b, t, cfg.num_heads * cfg.head_dim), lp["o"], lp.get("o_bias"),
                       choice=cfg.matmul, role="o")
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + swiglu(h, lp["gate"], lp["up"], lp["down"], choice=cfg.matmul)
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return x, TargetState(layers=tuple(layers), lengths=cache.lengths)


@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    """The drafter interface the speculative loop uses (static and hashable; params travel apart).

    Any object with these three methods can draft: `init_state`, `extend` (feed accepted context) and
    `propose` (logits for block positions 1..Bs-1 given the last accepted token).
    """

    cfg: DrafterConfig
    target_cfg: ModelConfig
    mesh: Any = None  # a jax.sharding.Mesh: the context cache is sharded over it (specpilot.sharding)
    # Draft every block this wide (the block the drafter was trained at: it saw that many mask rows) and
    # keep the plan's first Bs rows; None: as wide as the plan's block.
    draft_width: int | None = None

    def __post_init__(self):
        check_compatible(self.cfg, self.target_cfg)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def with_matmul(self, choice) -> "BlockDrafter":
        """This drafter with its layers and the target's head multiplied by `choice` (a plan's kernels)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, matmul=choice),
                                   target_cfg=dataclasses.replace(self.target_cfg, matmul=choice))

    def with_mesh(self, mesh) -> "BlockDrafter":
        """This drafter with its context cache sharded over `mesh` (None: one device)."""
        return dataclasses.replace(self, mesh=mesh)

    def with_draft_width(self, width: int | None) -> "BlockDrafter":
        """This drafter drafting every block `width` rows wide (None: as wide as the plan's block)."""
        return dataclasses.replace(self, draft_width=width)

    def init_state(self, params: Params, batch_size: int, max_len: int, dtype=None) -> TargetState:
        """The context cache, in dtype or else the drafter's own dtype (that of a norm: never encoded)."""
        cache = init_context_cache(self.cfg, batch_size, max_len, dtype or params["hidden_norm"].dtype)
        return sharding.constrain_state(cache, self.mesh)

    def extend(self, params: Params, target_params: Params, state: TargetState, taps: jax.Array,
               n_new: jax.Array) -> TargetState:
        return sharding.constrain_state(extend_context(params, self.cfg, state, taps, n_new), self.mesh)

    def propose(self, params: Params, target_params: Params, state: TargetState, last_tokens: jax.Array,
                block_size: int):
        """last_tokens [B] -> (draft logits [B, Bs-1, V] float32, state). Params carrying a reduced draft
        vocabulary (`draft_vocab.with_draft_vocab`) score only its ids, the rest at a floor."""
        b = last_tokens.shape[0]
        width = max(block_size, self.draft_width or 0)
        masks = jnp.full((b, width - 1), self.cfg.mask_token_id, jnp.int32)
        block = jnp.concatenate([last_tokens[:, None].astype(jnp.int32), masks], axis=1)  # [B, width]
        hidden, state = draft_block(params, self.cfg, target_params, self.target_cfg, state, block,
                                    keep=block_size)
        state = sharding.constrain_state(state, self.mesh)
        hidden = hidden[:, 1:block_size]
        if draft_vocab.has_draft_vocab(params):  # a reduced draft vocabulary: its own gathered head rows
            return draft_vocab.reduced_logits(params, hidden, self.target_cfg.vocab_size), state
        return dense.lm_head(target_params, self.target_cfg, hidden), state


@dataclasses.dataclass(frozen=True)
class ReplayDrafter:
    """Proposes a known reference continuation: oracle acceptance, or (shift != 0) always-wrong drafts.

    Its params are the reference `[B, R]` int32: each row's prompt followed by its continuation, indexed
    by absolute position. Its state is the committed context length `[B]`. A block starting at position
    L proposes reference[L+1 .. L+Bs-1] as one-hot logits of height `confidence`; the token at absolute
    position p is shifted by `shift` (mod V), i.e. made wrong, when `wrong_every` is 0 or divides p;
    with `runner_up` the right token stays second there (a tree's second sibling finds it).
    Useful wherever a drafter's acceptance must be controlled, e.g. targets with random weights; such
    results are labelled oracle-acceptance results.
    """

    vocab_size: int
    block_size: int
    shift: int = 0  # 0: the exact reference
    wrong_every: int = 0  # with shift != 0: 0 = every draft wrong, k = positions divisible by k wrong
    confidence: float = 30.0
    runner_up: float = 0.0  # > 0: a wrong draft keeps the right token second, this far below (trees)

    def with_mesh(self, mesh) -> "ReplayDrafter":
        """The replayed reference is one small array: nothing to shard."""
        del mesh
        return self

    def with_matmul(self, choice) -> "ReplayDrafter":
        del choice  # no weights: nothing to multiply
        return self

    def init_state(self, params, batch_size: int, max_len: int, dtype=None) -> jax.Array:
        return jnp.zeros((batch_size,), jnp.int32)

    def extend(self, params, target_params, state, taps, n_new):
        return state + n_new

    def propose(self, params, target_params, state, last_tokens, block_size: int):
        positions = state[:, None] + 1 + jnp.arange(block_size - 1, dtype=jnp.int32)[None, :]
        positions = jnp.minimum(positions, params.shape[1] - 1)  # past the reference: repeat its end
        wrong = (positions % self.wrong_every == 0) if self.wrong_every else True
        shift = jnp.where(wrong, self.shift, 0)
        right = jnp.take_along_axis(params, positions, axis=1)
        tokens = (right + shift) % self.vocab_size
        logits = self.confidence * jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        if self.runner_up:
            second = jnp.where(tokens != right, self.confidence - self.runner_up, 0.0)
            logits = logits + second[..., None] * jax.nn.one_hot(right, self.vocab_size, dtype=jnp.float32)
        return logits, state


def replay_reference(prompts, continuations, length: int | None = None) -> np.ndarray:
    """[B, R] int32 reference rows (prompt + continuation, zero-padded) for `ReplayDrafter`."""
    rows = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    length = length or max(len(r) for r in rows)
    out = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
