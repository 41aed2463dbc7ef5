"""The top-k and top-p thresholds of sampling rows without sorting the vocabulary: the largest values
come from a top-k over the chunks with the largest maxima, and the top-p cut-off is looked for among
growing candidate sets, with a full sort only when none of them holds top_p of the mass.
`top_p_cutoff_sorted` is the plain definition the fast path equals. Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Candidate set sizes tried in turn for the top-p cut-off, the whole batch at once (2-core CPU, 4 rows of
# 49152: 128 values ~0.25 ms, 256 ~0.6, 2048 ~12, a sort ~130); a batch none of them decides sorts.
TOP_P_CANDIDATES = (256, 2048)
# Tokens per chunk of `top_values`' first level.
CHUNK = 32


def top_values(x: jax.Array, m: int, chunk: int = CHUNK) -> jax.Array:
    """The m largest values of each row [..., m], descending: a top-k over the m chunks with the largest
    maxima (they hold the m largest values: a chunk left out has m chunks' maxima at or above its
    own), several times cheaper than a top-k over the row on the CPU."""
    lead, v = x.shape[:-1], x.shape[-1]
    if v % chunk or v // chunk < 4 * m:
        return jax.lax.top_k(x, m)[0]
    chunks = x.reshape(lead + (v // chunk, chunk))
    best = jax.lax.top_k(jnp.max(chunks, axis=-1), m)[1]  # [..., m] chunk ids
    candidates = jnp.take_along_axis(chunks, best[..., None], axis=-2).reshape(lead + (m * chunk,))
    return jax.lax.top_k(candidates, m)[0]


def top_k_threshold(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(the k-th largest value [..., 1], the k largest [..., k] descending) of each row."""
    top = top_values(x, k)
    # the minimum, not top[..., -1:]: a slice past a top-k's first value makes XLA's CPU back end sort
    # the whole row instead (~45 ms for 4 rows of 49152)
    return jnp.min(top, axis=-1, keepdims=True), top


def _cutoff_among(top: jax.Array, lse: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cut-off [..., 1], decided [..., 1]) from a row's largest values top [..., m] (descending): a
    token stays if the mass strictly before it is below top_p; decided where these hold top_p."""
    mass = jnp.exp(top - lse)
    cum = jnp.cumsum(mass, axis=-1)
    cutoff = jnp.min(jnp.where(cum - mass < top_p, top, jnp.inf), axis=-1, keepdims=True)
    return cutoff, cum[..., -1:] >= top_p


def _sorted_cutoff(x: jax.Array, lse: jax.Array, top_p: jax.Array) -> jax.Array:
    """The cut-off from each row sorted whole, row by row (so the sort's buffers stay one row long)."""
    def row(args):
        x_row, lse_row, p_row = args
        return _cutoff_among(jnp.sort(x_row)[::-1], lse_row, p_row)[0]

    flat = [a.reshape(-1, a.shape[-1]) for a in (x, lse, top_p)]
    return jax.lax.map(row, flat).reshape(top_p.shape)


def top_p_cutoff_sorted(x: jax.Array, top_p: jax.Array) -> jax.Array:
    """The definition: the smallest value of the smallest prefix of the sorted row whose mass reaches
    top_p, [..., 1] (-inf where top_p == 1); ties with it all stay (the mask is x >= cut-off)."""
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    return jnp.where(top_p < 1.0, _sorted_cutoff(x, lse, top_p), -jnp.inf)


def top_p_cutoff(x: jax.Array, top_p: jax.Array, head: jax.Array | None = None) -> jax.Array:
    """`top_p_cutoff_sorted`, from the candidate sets of `TOP_P_CANDIDATES` in turn (head [..., m]: the
    rows' m largest values, descending, when already known: the first candidates). A set that holds
    top_p of the mass decides: the sorted row's first m values are these, and every later token has at
    least top_p of mass before it."""
    v = x.shape[-1]
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    off = top_p >= 1.0
    sizes = [m for m in TOP_P_CANDIDATES if m < v and (head is None or m > head.shape[-1])]

    def from_candidates(top, later):
        cutoff, decided = _cutoff_among(top, lse, top_p)
        return jax.lax.cond(jnp.all(decided | off), lambda: cutoff, later)

    def from_size(i):
        if i == len(sizes):
            return _sorted_cutoff(x, lse, top_p)
        return from_candidates(top_values(x, sizes[i]), lambda: from_size(i + 1))

    cutoff = from_size(0) if head is None else from_candidates(head, lambda: from_size(0))
    return jnp.where(off, -jnp.inf, cutoff)
