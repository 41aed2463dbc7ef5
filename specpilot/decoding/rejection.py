"""Verification of a drafted chain: greedy prefix matching and lossless rejection sampling.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specpilot.decoding.sampling import RequestSampling, as_request_sampling, probabilities, sample


def choose_drafts(key: jax.Array, draft_logits: jax.Array, sampling: RequestSampling) -> jax.Array:
    """Draft tokens [B, K] from draft logits [B, K, V]: argmax when greedy, else samples from q."""
    return sample(key, draft_logits, sampling)


def _accepted_prefix(accept: jax.Array) -> jax.Array:
    """accept [B, K] bool -> length of the all-True prefix [B] int32."""
    return jnp.cumprod(accept.astype(jnp.int32), axis=-1).sum(axis=-1).astype(jnp.int32)


def _live(drafts: jax.Array, kept: jax.Array | None) -> jax.Array:
    """[B, K] bool: the drafts each row verifies (its first kept[b]; all when kept is None)."""
    j = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None, :]
    return jnp.ones(drafts.shape, bool) if kept is None else j < kept[:, None]


def accept_greedy(drafts: jax.Array, target_logits: jax.Array, kept: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """drafts [B, K], target_logits [B, K+1, V], kept [B] or None -> (n_accepted [B], next_token [B])."""
    k = drafts.shape[1]
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    n_acc = _accepted_prefix((drafts == choice[:, :k]) & _live(drafts, kept))
    return n_acc, jnp.take_along_axis(choice, n_acc[:, None], axis=1)[:, 0]


def rejection_sample(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array,
                     kept: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Lossless chain verification on explicit distributions.

    drafts [B, K] sampled from q [B, K, V]; p [B, K+1, V] the target's distributions at the K draft
    positions plus the bonus position. Returns (n_accepted [B], next_token [B]).
    """
    b, k = drafts.shape
    key_accept, key_next = jax.random.split(key)
    p = p.astype(jnp.float32)
    live = _live(drafts, kept)
    q = jnp.where(live[..., None], q.astype(jnp.float32), 0.0)
    p_x = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B, K]
    u = jax.random.uniform(key_accept, (b, k), jnp.float32)
    # u < p/q written without the division: q(x) > 0 for a token drawn from q.
    n_acc = _accepted_prefix((u * q_x < p_x) & live)
    p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    # Past the last draft q is zero, so the residual there is p itself: the bonus draw.
    q_pad = jnp.concatenate([q, jnp.zeros((b, 1, q.shape[-1]), q.dtype)], axis=1)
    q_at = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    residual = jnp.maximum(p_at - q_at, 0.0)
    total = residual.sum(axis=-1, keepdims=True)
    # total == 0 only when p == q, where a rejection cannot happen; fall back to p to stay defined.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_at)
    next_token = jax.random.categorical(key_next, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n_acc, next_token


def accept_sampled(key: jax.Array, drafts: jax.Array, draft_logits: jax.Array, target_logits: jax.Array,
                   sampling: RequestSampling, kept: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling with p and q from logits under the same sampling transform."""
    q = probabilities(draft_logits, sampling)  # [B, K, V]
    p = probabilities(target_logits, sampling)  # [B, K+1, V]
    return rejection_sample(key, drafts, q, p, kept)


def verify_chain(key: jax.Array, drafts: jax.Array, draft_logits: jax.Array, target_logits: jax.Array,
                 sampling: RequestSampling, kept: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The one entry the decoding loop calls: greedy matching or rejection sampling."""
    if as_request_sampling(sampling).greedy:
        return accept_greedy(drafts, target_logits, kept)
    return accept_sampled(key, drafts, draft_logits, target_logits, sampling, kept)
