"""Token choice from logits: greedy, temperature, top-k, top-p, with explicit PRNG keys.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


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


# The top-p cut-off is looked for among each row's most likely tokens first; only when these hold less
# than top_p of the mass does the whole vocabulary get sorted (a CPU sort of 49152 logits costs ~10 ms).
TOP_P_CANDIDATES = 256


def _top_p_cutoff(x: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest logit top-p keeps, [..., 1] (-inf where top_p == 1): the smallest prefix of the
    sorted logits whose mass reaches top_p, i.e. a token stays if the mass strictly before it is below
    top_p (so the top token always stays); ties at the cut-off are all kept."""
    v = x.shape[-1]
    m = min(TOP_P_CANDIDATES, v)
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)

    top = jax.lax.top_k(x, m)[0]  # descending, the sorted logits' first m
    top_mass = jnp.exp(top - lse)
    top_cum = jnp.cumsum(top_mass, axis=-1)

    def full_sort():
        # Row by row, so the sort's buffers stay one row long. The head's cumulative mass is the
        # candidates' own, so a row they decide gets the same cut-off here.
        def row(args):
            x_row, lse_row, top_row, cum_row, mass_row, p_row = args
            rest = jnp.sort(x_row)[::-1][m:]
            rest_mass = jnp.exp(rest - lse_row)
            rest_cum = cum_row[-1] + jnp.cumsum(rest_mass)
            keep = jnp.concatenate([cum_row - mass_row, rest_cum - rest_mass]) < p_row
            return jnp.min(jnp.where(keep, jnp.concatenate([top_row, rest]), jnp.inf))

        flat = [a.reshape(-1, a.shape[-1]) for a in (x, lse, top, top_cum, top_mass, top_p)]
        return jax.lax.map(row, flat).reshape(top_p.shape)

    def from_candidates():
        return jnp.min(jnp.where(top_cum - top_mass < top_p, top, jnp.inf), axis=-1, keepdims=True)

    decided = (top_cum[..., -1:] >= top_p) | (top_p >= 1.0)
    cutoff = jax.lax.cond(jnp.all(decided), from_candidates, full_sort)
    return jnp.where(top_p < 1.0, cutoff, -jnp.inf)


def _scaled(logits: jax.Array, s: RequestSampling) -> jax.Array:
    """Logits at temperature (1 for a temperature-0 row) with top-k's removed tokens at -inf."""
    temperature = _rows(s.temperature, logits)
    x = logits.astype(jnp.float32) / jnp.where(temperature == 0, 1.0, temperature)
    if s.top_k and s.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    return x


def filtered_logits(logits: jax.Array, sampling) -> jax.Array:
    """Logits after temperature, top-k and top-p, [..., V] float32: removed tokens get -inf; the
    sampling distribution is their softmax. A temperature-0 row is left at temperature 1 (its
    distribution is the one-hot at its argmax: callers take that from the raw logits)."""
    s = as_request_sampling(sampling)
    if s.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use jnp.argmax")
    top_p = jnp.broadcast_to(_rows(s.top_p, logits), logits.shape[:-1] + (1,))
    # Without top-p (every row at 1, the usual case) nothing is sorted or ranked at all. The branch
    # takes the raw logits, so the scaled ones stay fused into their consumers (never written out).
    cutoff = jax.lax.cond(jnp.any(top_p < 1.0), lambda: _top_p_cutoff(_scaled(logits, s), top_p),
                          lambda: jnp.full_like(top_p, -jnp.inf))
    x = _scaled(logits, s)
    return jnp.where(x < cutoff, -jnp.inf, x)


def greedy_rows(sampling, shape: tuple[int, ...]) -> jax.Array:
    """[*shape] bool: the temperature-0 rows, broadcast over the leading dimensions shape."""
    t = jnp.asarray(as_request_sampling(sampling).temperature)
    return jnp.broadcast_to(t.reshape(t.shape + (1,) * (len(shape) - t.ndim)), shape) == 0


def with_greedy_rows(greedy: jax.Array, make, sampled):
    """sampled where no row is greedy; else make() (which computes the argmax) decides those rows.
    The argmax costs as much as a greedy accept, so a batch without temperature-0 rows skips it."""
    return jax.lax.cond(jnp.any(greedy), make, lambda: sampled)


def filtered_logprobs(logits: jax.Array, sampling) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p; removed tokens get -inf. [..., V] float32.

    A row of temperature 0 gets the one-hot at its argmax (log 0 elsewhere)."""
    x = filtered_logits(logits, sampling)
    logp = x - jax.nn.logsumexp(x, axis=-1, keepdims=True)
    greedy = greedy_rows(sampling, logits.shape[:-1])[..., None]

    def with_one_hots():
        one_hot = jnp.arange(x.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
        return jnp.where(greedy, jnp.where(one_hot, 0.0, -jnp.inf), logp)

    return with_greedy_rows(greedy, with_one_hots, logp)


def probabilities(logits: jax.Array, sampling) -> jax.Array:
    """The sampling distribution as probabilities [..., V]; greedy is a one-hot at the argmax."""
    if as_request_sampling(sampling).greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.exp(filtered_logprobs(logits, sampling))


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
    in [0, 1) and non-negative weights [..., V] with a positive sum. Two levels (the chunk, then the
    token inside it) so no pass over the vocabulary is longer than one sum."""
    lead, v = weights.shape[:-1], weights.shape[-1]
    c = _chunk_size(v)
    chunks = weights.astype(jnp.float32).reshape(lead + (v // c, c))
    sums = jnp.sum(chunks, axis=-1)  # [..., n]
    cum = jnp.cumsum(sums, axis=-1)
    r = u * cum[..., -1]
    chunk = _first_above(cum, r, sums > 0)
    row = jnp.take_along_axis(chunks, chunk[..., None, None], axis=-2)[..., 0, :]  # [..., c]
    before = jnp.take_along_axis(cum - sums, chunk[..., None], axis=-1)[..., 0]
    inside = _first_above(jnp.cumsum(row, axis=-1), r - before, row > 0)
    return chunk * c + inside


def sample_uniform(u: jax.Array, logits: jax.Array, sampling) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32), drawn with the uniforms u [...] in [0, 1)."""
    s = as_request_sampling(sampling)
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filtered_logits(logits, s)
    drawn = draw(u, jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)))
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
