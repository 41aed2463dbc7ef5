"""The top-k and top-p thresholds of sampling rows without sorting the vocabulary: the largest values
come from a top-k over the chunks with the largest maxima, and the top-p cut-off is looked for among
growing candidate sets (the first for the whole batch, the later ones only for the rows it leaves
undecided), with a full sort only when none of them holds top_p of the mass; where the kept tokens lie
among the candidates, their normalizing sum comes from the candidates too. `top_p_cutoff_sorted` is the
plain definition the fast path equals. Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Candidate set sizes tried in turn for the top-p cut-off: the first for the whole batch, the later
# ones row by row for the rows still undecided. XLA's CPU top-k is several times cheaper up to k = 64
# (`top_values` of 16 rows of 49152: 64 values ~0.7 ms, 256 ~2.2).
TOP_P_CANDIDATES = (64, 128, 192, 256, 2048)
# A set at most this much larger than the one before extends it (`_extended`) rather than starting over.
EXTEND = 64
# Tokens per chunk of `top_values`' first level.
CHUNK = 32


def _chunked(x: jax.Array, m: int, chunk: int) -> bool:
    v = x.shape[-1]
    return v % chunk == 0 and v // chunk >= 4 * m


def chunk_maxima(x: jax.Array, chunk: int = CHUNK) -> jax.Array:
    """[..., V / chunk]: the largest value of each chunk of `chunk` consecutive tokens."""
    return jnp.max(x.reshape(x.shape[:-1] + (x.shape[-1] // chunk, chunk)), axis=-1)


def top_values(x: jax.Array, m: int, chunk: int = CHUNK, maxima: jax.Array | None = None) -> jax.Array:
    """The m largest values of each row [..., m], descending: a top-k over the m chunks with the largest
    maxima (they hold the m largest values: a chunk left out has m chunks' maxima at or above its
    own), several times cheaper than a top-k over the row on the CPU. maxima: `chunk_maxima(x)`."""
    lead, v = x.shape[:-1], x.shape[-1]
    if not _chunked(x, m, chunk):
        return jax.lax.top_k(x, m)[0]
    maxima = chunk_maxima(x, chunk) if maxima is None else maxima
    best = jax.lax.top_k(maxima, m)[1]  # [..., m] chunk ids
    chunks = x.reshape(lead + (v // chunk, chunk))
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


class Nucleus(NamedTuple):
    """Top-p of logits l [..., V] at scale s (x = l * s), per row [..., 1]."""

    cutoff: jax.Array  # `top_p_cutoff_sorted` of x: the smallest kept x (-inf where top_p >= 1)
    top: jax.Array  # the largest logit
    kept_sum: jax.Array  # sum of exp((l - top) * s) over the kept tokens; NaN where not known from candidates


class _Row(NamedTuple):
    """What a row's candidate search reads: its logits [..., V] and the per-row values [..., 1]."""

    logits: jax.Array
    scale: jax.Array
    top_p: jax.Array
    lse: jax.Array
    top: jax.Array


def _from_candidates(r: _Row, top: jax.Array, whole_row: bool):
    """(cut-off, kept sum, decided) from a row's largest logits top [..., m], descending. The kept sum
    is known where the cut-off lies above the smallest candidate (every kept token is a candidate) or
    the candidates are the whole row: the same weights the filter gives, summed in another order."""
    x = top * r.scale
    cutoff, decided = _cutoff_among(x, r.lse, r.top_p)
    kept = jnp.sum(jnp.where(x >= cutoff, jnp.exp((top - r.top) * r.scale), 0.0), axis=-1, keepdims=True)
    inside = (cutoff > jnp.min(x, axis=-1, keepdims=True)) | whole_row
    return cutoff, jnp.where(inside & (r.top_p < 1.0), kept, jnp.nan), decided


def _extended(x: jax.Array, top: jax.Array, m: int) -> jax.Array:
    """The m largest values of a row x [V] from its first ones top [n] (descending), with a top-k of
    m - n values below top's last (a small k: XLA's CPU top-k costs several times more from k = 128)
    after the copies of that last value top leaves out."""
    last = jnp.min(top)
    extra = jnp.sum(x == last) - jnp.sum(top == last)  # copies of `last` past top, in the sorted row
    below = top_values(jnp.where(x < last, x, -jnp.inf), m - top.shape[-1])
    i = jnp.arange(m - top.shape[-1])
    return jnp.concatenate([top, jnp.where(i < extra, last, below[jnp.maximum(i - extra, 0)])])


def _row_stages(r: _Row, top: jax.Array, sizes: tuple[int, ...]):
    """(cut-off, kept sum) of one row (arrays [V] and [1], its largest logits top [n]) from the
    candidate sets sizes in turn, then the sorted row."""
    if not sizes:
        cutoff, kept, _ = _from_candidates(r, jnp.sort(r.logits)[::-1], True)
        return cutoff, kept
    m = sizes[0]
    top = _extended(r.logits, top, m) if m - top.shape[-1] <= EXTEND else top_values(r.logits, m)
    cutoff, kept, decided = _from_candidates(r, top, False)
    return jax.lax.cond(decided[0], lambda: (cutoff, kept), lambda: _row_stages(r, top, sizes[1:]))


def _undecided_rows(r: _Row, head, cutoff, kept, decided, sizes: tuple[int, ...]):
    """(cut-off, kept sum) with each undecided row searched on its own, so one wide nucleus does not
    move the whole batch to a larger set: a loop over those rows only."""
    shape = cutoff.shape
    flat = _Row(*(a.reshape(-1, a.shape[-1]) for a in r))
    head = head.reshape(-1, head.shape[-1])
    todo = ~decided.reshape(-1)
    rows = jnp.nonzero(todo, size=todo.shape[0], fill_value=0)[0]

    def one(i, carry):
        row = _Row(*(a[rows[i]] for a in flat))
        c, k = _row_stages(row, head[rows[i]], sizes)
        return carry[0].at[rows[i]].set(c), carry[1].at[rows[i]].set(k)

    cutoff, kept = jax.lax.fori_loop(0, jnp.sum(todo), one, (cutoff.reshape(-1, 1), kept.reshape(-1, 1)))
    return cutoff.reshape(shape), kept.reshape(shape)


def _sorted_rows(r: _Row, cutoff, kept, done):
    """(cut-off, kept sum) with every row sorted at once, kept where `done`: one batched sort, for a
    device where a loop over rows with a branch per set costs more than sorting them all (the H200:
    16 undecided rows of 151936 took 9.3 ms in the row loop)."""
    c, k, _ = _from_candidates(r, jnp.flip(jnp.sort(r.logits, axis=-1), axis=-1), True)
    return jnp.where(done, cutoff, c), jnp.where(done, kept, k)


def batched_fallback() -> bool:
    """Whether the rows the first candidate set leaves undecided are sorted together (accelerators) or
    searched row by row through the later sets (the CPU, where a sort of the row costs the most)."""
    return jax.default_backend() != "cpu"


def top_p_nucleus(logits: jax.Array, scale: jax.Array, top_p: jax.Array, head: jax.Array | None = None,
                  batched: bool | None = None) -> Nucleus:
    """`top_p_cutoff_sorted` of x = logits * scale (scale > 0 [..., 1]) from the candidate sets of
    `TOP_P_CANDIDATES` (head [..., m]: the rows' m largest logits, descending, when already known: the
    first candidates). A set that holds top_p of the mass decides: the sorted row's first m values are
    these, and every later token has at least top_p of mass before it. `batched`: the undecided rows
    sorted together instead of searched row by row (default `batched_fallback()`)."""
    scale = jnp.broadcast_to(scale, top_p.shape)
    chunked = _chunked(logits, min(TOP_P_CANDIDATES), CHUNK)
    maxima = chunk_maxima(logits) if chunked else None
    top = jnp.max(maxima if chunked else logits, axis=-1, keepdims=True)
    # jax.nn.logsumexp of x (the definition's), its maximum taken from the chunks' maxima
    x_max = top * scale
    x_max = jnp.where(jnp.isfinite(x_max), x_max, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(logits * scale - x_max), axis=-1, keepdims=True)) + x_max
    r = _Row(logits, scale, top_p, lse, top)
    sizes = tuple(m for m in TOP_P_CANDIDATES if m < logits.shape[-1] and (head is None or m > head.shape[-1]))
    if not chunked:  # a small vocabulary: after the first set, the sorted row (fewer stages to compile)
        sizes = sizes[:1]
    if head is None:  # the first set (the whole row where the vocabulary is smaller)
        head = top_values(logits, sizes[0] if sizes else logits.shape[-1], maxima=maxima)
        sizes = sizes[1:]
    cutoff, kept, decided = _from_candidates(r, head, head.shape[-1] == logits.shape[-1])
    done = decided | (top_p >= 1.0)
    batched = batched_fallback() if batched is None else batched
    rest = (lambda: _sorted_rows(r, cutoff, kept, done)) if batched else (
        lambda: _undecided_rows(r, head, cutoff, kept, done, sizes))
    cutoff, kept = jax.lax.cond(jnp.all(done), lambda: (cutoff, kept), rest)
    return Nucleus(jnp.where(top_p >= 1.0, -jnp.inf, cutoff), top, kept)


def top_p_cutoff(x: jax.Array, top_p: jax.Array, head: jax.Array | None = None) -> jax.Array:
    """`top_p_cutoff_sorted` from the candidate sets (`top_p_nucleus` at scale 1)."""
    return top_p_nucleus(x, jnp.ones_like(top_p), top_p, head).cutoff
