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


def filtered_logprobs(logits: jax.Array, sampling) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p; removed tokens get -inf. [..., V] float32.

    A row of temperature 0 gets the one-hot at its argmax (log 0 elsewhere)."""
    s = as_request_sampling(sampling)
    if s.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use jnp.argmax")
    temperature = _rows(s.temperature, logits)
    greedy_row = temperature == 0
    x = logits.astype(jnp.float32) / jnp.where(greedy_row, 1.0, temperature)
    if s.top_k and s.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    top_p = _rows(s.top_p, logits)
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass strictly before
    # it is below top_p (so the top token always stays). top_p == 1 filters nothing.
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = mass_before < top_p
    # The cut-off value is the smallest kept logit; ties at the cut-off are all kept.
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((top_p < 1.0) & (x < cutoff), -jnp.inf, x)
    logp = jax.nn.log_softmax(x, axis=-1)
    one_hot = jnp.arange(x.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
    return jnp.where(greedy_row, jnp.where(one_hot, 0.0, -jnp.inf), logp)


def probabilities(logits: jax.Array, sampling) -> jax.Array:
    """The sampling distribution as probabilities [..., V]; greedy is a one-hot at the argmax."""
    if as_request_sampling(sampling).greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.exp(filtered_logprobs(logits, sampling))


def sample(key: jax.Array, logits: jax.Array, sampling) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32)."""
    s = as_request_sampling(sampling)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if s.greedy:
        return greedy
    drawn = jax.random.categorical(key, filtered_logprobs(logits, s), axis=-1).astype(jnp.int32)
    return jnp.where(_rows(s.temperature, greedy) == 0, greedy, drawn)


def resolve_key(key: jax.Array | None, sampling) -> jax.Array:
    """The PRNG key to decode with: sampling requires an explicit one; greedy draws nothing."""
    if key is not None:
        return key
    if not sampling.greedy:
        raise ValueError("sampling needs an explicit PRNG key (key=jax.random.key(seed))")
    return jax.random.key(0)
