"""Token choice from logits: greedy, temperature, top-k, top-p, with explicit PRNG keys.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.decoding.nucleus import top_k_threshold, top_p_nucleus


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_requests(self, batch_size: int, temperature=None, top_p=None) -> "RequestSampling":
        """Per-request values for a batch: this config's value for every row unless an array [B] is
        given. Validated here, on the host."""
        temp = _per_request(temperature, self.temperature, batch_size, "temperature")
        p = _per_request(top_p, self.top_p, batch_size, "top_p")
        if not (np.isfinite(temp).all() and (temp >= 0).all()):
            raise ValueError(f"temperatures must be finite and >= 0, got {temp.tolist()}")
        if not ((p > 0) & (p <= 1)).all():
            raise ValueError(f"top_p values must be in (0, 1], got {p.tolist()}")
        return RequestSampling(jnp.asarray(temp), jnp.asarray(p), greedy=bool((temp == 0).all()),
                               top_k=self.top_k)


def _per_request(values, default: float, batch_size: int, name: str) -> np.ndarray:
    if values is None:
        return np.full((batch_size,), default, np.float32)
    arr = np.asarray(values, np.float32)
    if arr.shape != (batch_size,):
        raise ValueError(f"{name} per request must have shape ({batch_size},), got {arr.shape}")
    return arr


@dataclasses.dataclass(frozen=True)
class RequestSampling:
    """Per-request sampling values (traced) with the static choices in the tree structure."""

    temperature: jax.Array  # [B] float32 (or a scalar for every row); 0 = greedy row
    top_p: jax.Array  # [B] float32; 1 = off
    greedy: bool = True  # static: every row greedy
    top_k: int = 0  # static: 0 = off


jax.tree_util.register_dataclass(RequestSampling, data_fields=["temperature", "top_p"],
                                 meta_fields=["greedy", "top_k"])

GREEDY = SamplingConfig()


def as_request_sampling(sampling: "SamplingConfig | RequestSampling") -> RequestSampling:
    if isinstance(sampling, RequestSampling):
        return sampling
    return RequestSampling(jnp.float32(sampling.temperature), jnp.float32(sampling.top_p),
                           greedy=sampling.greedy, top_k=sampling.top_k)


def _rows(values: jax.Array, like: jax.Array) -> jax.Array:
    """Per-row values [B] (or a scalar) shaped to broadcast against like [B, ...]."""
    values = jnp.asarray(values)
    return values.reshape(values.shape + (1,) * (like.ndim - values.ndim))


class Filter(NamedTuple):
    """The sampling transform of logits [..., V] as per-row values [..., 1], so consumers fuse it into
    their own passes over the raw logits (no transformed copy is written): token t of logits l keeps
    x_t = l_t * inv_temperature if x_t >= cutoff, with weight exp((l_t - top) * inv_temperature)."""

    inv_temperature: jax.Array  # 1 / temperature (1 for a temperature-0 row)
    cutoff: jax.Array  # the smallest x kept by top-k / top-p (-inf: every token)
    top: jax.Array  # the largest raw logit (always kept)
    kept_sum: jax.Array  # the kept weights' sum where top-p's candidates gave it, else NaN


def sampling_filter(logits: jax.Array, sampling) -> Filter:
    s = as_request_sampling(sampling)
    if s.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use jnp.argmax")
    logits = logits.astype(jnp.float32)
    t = jnp.broadcast_to(_rows(s.temperature, logits), logits.shape[:-1] + (1,))
    inv = jnp.where(t == 0, 1.0, 1.0 / jnp.where(t == 0, 1.0, t))
    none = jnp.full_like(inv, -jnp.inf)
    kth, head, masked = none, None, logits
    if s.top_k and s.top_k < logits.shape[-1]:
        # on the logits: x = logits * inv keeps their order, so the k-th x is the k-th logit's
        kth_logit, head = top_k_threshold(logits, s.top_k)
        kth = kth_logit * inv
        masked = jnp.where(logits * inv < kth, -jnp.inf, logits)
    top_p = jnp.broadcast_to(_rows(s.top_p, logits), inv.shape)

    def with_top_p():
        # the top-k values are the masked row's largest: the first top-p candidates
        return tuple(top_p_nucleus(masked, inv, top_p, head))

    def without_top_p():
        return none, jnp.max(logits, axis=-1, keepdims=True), jnp.full_like(inv, jnp.nan)

    # Without top-p (every row at 1, the usual case) nothing is sorted or ranked at all.
    cutoff, top, kept_sum = jax.lax.cond(jnp.any(top_p < 1.0), with_top_p, without_top_p)
    return Filter(inv, jnp.maximum(kth, cutoff), top, kept_sum)


def filter_weights(logits: jax.Array, f: Filter, masked: bool = True) -> jax.Array:
    """Unnormalized probabilities [..., V] of logits under the filter (0 for removed tokens).
    masked=False skips the cut-off, for filters that keep every token."""
    logits = logits.astype(jnp.float32)
    w = jnp.exp((logits - f.top) * f.inv_temperature)
    return jnp.where(logits * f.inv_temperature >= f.cutoff, w, 0.0) if masked else w


def _if_filtering(f: Filter, fn):
    """fn(masked=True) where some row has a cut-off, else fn(False): a reduction over the weights then
    fuses into one pass over the raw logits (with the mask's select, XLA's CPU reductions take a
    written-out copy: a 12 MB logits array costs ~2 ms more)."""
    return jax.lax.cond(jnp.any(f.cutoff > -jnp.inf), lambda: fn(True), lambda: fn(False))


def filter_sum(logits: jax.Array, f: Filter) -> jax.Array:
    """[...]: the filter's normalizing sum (of `filter_weights`) per row; a pass over the vocabulary
    only where some row's kept sum is not known from top-p's candidates (one switch for the three ways)."""
    kept = f.kept_sum[..., 0]
    known = jnp.isfinite(kept)

    def summed(masked):
        return jnp.where(known, kept, jnp.sum(filter_weights(logits, f, masked), axis=-1))

    way = jnp.where(jnp.all(known), 0, jnp.where(jnp.any(f.cutoff > -jnp.inf), 1, 2))
    return jax.lax.switch(way, [lambda: kept, lambda: summed(True), lambda: summed(False)])


def filtered_logits(logits: jax.Array, sampling) -> jax.Array:
    """Logits after temperature, top-k and top-p, [..., V] float32: removed tokens get -inf; the
    sampling distribution is their softmax. A temperature-0 row is left at temperature 1 (its
    distribution is the one-hot at its argmax: callers take that from the raw logits)."""
    f = sampling_filter(logits, sampling)
    x = logits.astype(jnp.float32) * f.inv_temperature
    return jnp.where(x >= f.cutoff, x, -jnp.inf)


def greedy_rows(sampling, shape: tuple[int, ...]) -> jax.Array:
    """[*shape] bool: the temperature-0 rows, broadcast over the leading dimensions shape."""
    t = jnp.asarray(as_request_sampling(sampling).temperature)
    return jnp.broadcast_to(t.reshape(t.shape + (1,) * (len(shape) - t.ndim)), shape) == 0


def with_greedy_rows(greedy: jax.Array, make, sampled):
    """sampled where no row is greedy; else make() (which computes the argmax) decides those rows.
    The argmax costs as much as a greedy accept, so a batch without temperature-0 rows skips it."""
    return jax.lax.cond(jnp.any(greedy), make, lambda: sampled)


def _one_hots_for_greedy_rows(logits: jax.Array, sampling, values: jax.Array, hot, cold) -> jax.Array:
    greedy = greedy_rows(sampling, logits.shape[:-1])[..., None]

    def with_one_hots():
        one_hot = jnp.arange(logits.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
        return jnp.where(greedy, jnp.where(one_hot, hot, cold), values)

    return with_greedy_rows(greedy, with_one_hots, values)


def filtered_logprobs(logits: jax.Array, sampling) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p; removed tokens get -inf. [..., V] float32.

    A row of temperature 0 gets the one-hot at its argmax (log 0 elsewhere)."""
    return _one_hots_for_greedy_rows(logits, sampling, jnp.log(_normalized(logits, sampling)), 0.0, -jnp.inf)


def _normalized(logits: jax.Array, sampling) -> jax.Array:
    w = filter_weights(logits, sampling_filter(logits, sampling))
    return w / jnp.sum(w, axis=-1, keepdims=True)


def probabilities(logits: jax.Array, sampling) -> jax.Array:
    """The sampling distribution as probabilities [..., V]; greedy is a one-hot at the argmax."""
    if as_request_sampling(sampling).greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return _one_hots_for_greedy_rows(logits, sampling, _normalized(logits, sampling), 1.0, 0.0)


def _chunk_size(v: int) -> int:
    """Chunk width of `draw`'s two-level search: a power of two near sqrt(v) dividing v (1 at worst)."""
    c = 1
    while c * 2 <= 256 and v % (c * 2) == 0 and (c * 2) ** 2 <= 4 * v:
        c *= 2
    return c


def _first_above(cum: jax.Array, r: jax.Array, positive: jax.Array) -> jax.Array:
    """Index of the first positive entry with cum[..., i] > r (cum: running sums of the entries), or
    the last positive entry where rounding left r at or past the total: never a zero entry."""
    n = cum.shape[-1]
    i = jnp.arange(n, dtype=jnp.int32)
    first = jnp.min(jnp.where(positive & (cum > r[..., None]), i, n), axis=-1)
    last_positive = jnp.max(jnp.where(positive, i, -1), axis=-1)
    return jnp.where(first < n, first, last_positive).astype(jnp.int32)


def draw(u: jax.Array, weights: jax.Array) -> jax.Array:
    """Inverse-CDF draw: token ids [...] with probability weights / sum(weights) from uniforms u [...]
    in [0, 1) and non-negative weights [..., V] with a positive sum."""
    return _draw(u, weights, lambda w, _: w)


def _draw(u: jax.Array, values: jax.Array, weigh) -> jax.Array:
    """`draw` over weigh(values, axes) (elementwise; axes: how many trailing axes values has past the
    leading ones), in two levels (the chunk, then the token inside it) so no pass over the vocabulary
    is longer than one sum, and the weights are recomputed where needed, never written out whole."""
    lead, v = values.shape[:-1], values.shape[-1]
    c = _chunk_size(v)
    chunks = values.reshape(lead + (v // c, c))
    sums = jnp.sum(weigh(chunks, 2), axis=-1)  # [..., n]
    cum = jnp.cumsum(sums, axis=-1)
    r = u * cum[..., -1]
    chunk = _first_above(cum, r, sums > 0)
    row = weigh(jnp.take_along_axis(chunks, chunk[..., None, None], axis=-2)[..., 0, :], 1)  # [..., c]
    before = jnp.take_along_axis(cum - sums, chunk[..., None], axis=-1)[..., 0]
    inside = _first_above(jnp.cumsum(row, axis=-1), r - before, row > 0)
    return chunk * c + inside


def draw_filtered(u: jax.Array, logits: jax.Array, f: Filter) -> jax.Array:
    """A draw from logits [..., V] under the filter f, weighing only what the draw reads."""
    def drawn(masked):
        def weigh(values, axes):
            return filter_weights(values, Filter(*(a.reshape(a.shape + (1,) * (axes - 1)) for a in f)), masked)

        return _draw(u, logits, weigh)

    return _if_filtering(f, drawn)


def sample_uniform(u: jax.Array, logits: jax.Array, sampling) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32), drawn with the uniforms u [...] in [0, 1)."""
    s = as_request_sampling(sampling)
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = draw_filtered(u, logits, sampling_filter(logits, s))
    greedy = greedy_rows(s, drawn.shape)
    return with_greedy_rows(greedy, lambda: jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32),
                                                      drawn), drawn)


def sample(key: jax.Array, logits: jax.Array, sampling) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32)."""
    if as_request_sampling(sampling).greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_uniform(jax.random.uniform(key, logits.shape[:-1], jnp.float32), logits, sampling)


def resolve_key(key: jax.Array | None, sampling) -> jax.Array:
    """The PRNG key to decode with: sampling requires an explicit one; greedy draws nothing."""
    if key is not None:
        return key
    if not sampling.greedy:
        raise ValueError("sampling needs an explicit PRNG key (key=jax.random.key(seed))")
    return jax.random.key(0)
