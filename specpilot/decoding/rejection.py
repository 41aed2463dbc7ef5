"""Verification of a drafted chain: greedy prefix matching and lossless rejection sampling.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specpilot.decoding.sampling import (Filter, RequestSampling, as_request_sampling, draw, filter_sum,
                                         filter_weights, greedy_rows, sample, sampling_filter, with_greedy_rows)


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


def accept_uniforms(key: jax.Array, batch: int, k: int) -> tuple[jax.Array, jax.Array]:
    """The uniforms one chain verification consumes: [B, K] for the accept tests, [B] for the draw."""
    key_accept, key_next = jax.random.split(key)
    return (jax.random.uniform(key_accept, (batch, k), jnp.float32),
            jax.random.uniform(key_next, (batch,), jnp.float32))


def _residual_draw(u_next: jax.Array, p_at: jax.Array, q_at: jax.Array) -> jax.Array:
    """The token after the accepted prefix from normalize(max(p - q, 0)) [B, V] (q = 0: the bonus)."""
    residual = jnp.maximum(p_at - q_at, 0.0)
    # the residual sums to 0 only when p == q, where a rejection cannot happen; p keeps it defined
    return draw(u_next, jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_at))


def rejection_sample(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array,
                     kept: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Lossless chain verification on explicit distributions.

    drafts [B, K] sampled from q [B, K, V]; p [B, K+1, V] the target's distributions at the K draft
    positions plus the bonus position. Returns (n_accepted [B], next_token [B]).
    """
    b, k = drafts.shape
    u, u_next = accept_uniforms(key, b, k)
    p = p.astype(jnp.float32)
    live = _live(drafts, kept)
    q = jnp.where(live[..., None], q.astype(jnp.float32), 0.0)
    p_x = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
    q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # [B, K]
    # u < p/q written without the division: q(x) > 0 for a token drawn from q.
    n_acc = _accepted_prefix((u * q_x < p_x) & live)
    p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    # Past the last draft q is zero, so the residual there is p itself: the bonus draw.
    q_pad = jnp.concatenate([q, jnp.zeros((b, 1, q.shape[-1]), q.dtype)], axis=1)
    q_at = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    return n_acc, _residual_draw(u_next, p_at, q_at)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...] at position index [B] -> [B, ...]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def _filter_at(f: Filter, index: jax.Array) -> Filter:
    return Filter(*(_at(a, index) for a in f))


def accept_sampled_uniform(u: jax.Array, u_next: jax.Array, drafts: jax.Array, draft_logits: jax.Array,
                           target_logits: jax.Array, sampling: RequestSampling, kept: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
    """`rejection_sample` on logits, given its uniforms (u [B, K], u_next [B]): p and q under the same
    sampling transform, each evaluated only where the test needs it (p(x), q(x) at the drafts from one
    normalizing sum per position, full rows only at the accepted prefix's end)."""
    b, k = drafts.shape
    live = _live(drafts, kept)
    fq = sampling_filter(draft_logits, sampling)  # per position [B, K, 1]
    fp = sampling_filter(target_logits, sampling)  # [B, K+1, 1]
    z_q = filter_sum(draft_logits, fq)  # [B, K]
    z_p = filter_sum(target_logits, fp)  # [B, K+1]

    def at_drafts(logits, f):  # the filter's weight of each draft token, [B, K]
        picked = jnp.take_along_axis(logits[:, :k], drafts[..., None], axis=-1)
        return filter_weights(picked, Filter(*(a[:, :k] for a in f)))[..., 0]

    q_x = at_drafts(draft_logits, fq) / z_q
    p_x = at_drafts(target_logits, fp) / z_p[:, :k]
    greedy = greedy_rows(sampling, (b,))

    def with_one_hots():
        # a temperature-0 row's p and q are the one-hots at the argmax, and its next token p's argmax
        choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
        g = greedy[:, None]
        return (jnp.where(g, (drafts == choice[:, :k]).astype(jnp.float32), p_x),
                jnp.where(g, (drafts == jnp.argmax(draft_logits, axis=-1)).astype(jnp.float32), q_x), choice)

    p_x, q_x, choice = with_greedy_rows(greedy, with_one_hots, (p_x, q_x, jnp.zeros((b, k + 1), jnp.int32)))
    q_x = jnp.where(live, q_x, 0.0)
    n_acc = _accepted_prefix((u * q_x < p_x) & live)
    p_at = filter_weights(_at(target_logits, n_acc), _filter_at(fp, n_acc)) / _at(z_p, n_acc)[:, None]
    # q is zero past the row's last verified draft, so the residual there is p itself: the bonus draw.
    q_at = jnp.zeros_like(p_at)
    if k:
        last = jnp.minimum(n_acc, k - 1)
        q_live = n_acc < (k if kept is None else jnp.minimum(kept, k))
        q_row = filter_weights(_at(draft_logits, last), _filter_at(fq, last)) / _at(z_q, last)[:, None]
        q_at = jnp.where(q_live[:, None], q_row, 0.0)
    next_token = _residual_draw(u_next, p_at, q_at)
    return n_acc, jnp.where(greedy, _at(choice, n_acc), next_token)


def accept_sampled(key: jax.Array, drafts: jax.Array, draft_logits: jax.Array, target_logits: jax.Array,
                   sampling: RequestSampling, kept: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling with p and q from logits under the same sampling transform."""
    u, u_next = accept_uniforms(key, *drafts.shape)
    return accept_sampled_uniform(u, u_next, drafts, draft_logits, target_logits, sampling, kept)


def verify_chain(key: jax.Array, drafts: jax.Array, draft_logits: jax.Array, target_logits: jax.Array,
                 sampling: RequestSampling, kept: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The one entry the decoding loop calls: greedy matching or rejection sampling."""
    if as_request_sampling(sampling).greedy:
        return accept_greedy(drafts, target_logits, kept)
    return accept_sampled(key, drafts, draft_logits, target_logits, sampling, kept)
