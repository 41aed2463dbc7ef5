"""Token choice from logits: greedy, temperature, top-k, top-p, with explicit PRNG keys.

Design choices:
- `SamplingConfig` is frozen and hashable: it is a static argument of jitted steps (changing it
  recompiles; the values are few and fixed per run).
- `filtered_logprobs` is the one place where temperature / top-k / top-p are applied. Both AR sampling
  and speculative rejection sampling use it, so the draft and target distributions are transformed
  identically — a requirement for losslessness.
- temperature == 0 means greedy (argmax); ties break to the lowest token id, as `jnp.argmax` does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


GREEDY = SamplingConfig()


def filtered_logprobs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p; removed tokens get -inf. [..., V] float32."""
    if cfg.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use jnp.argmax")
    x = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass strictly before
        # it is below top_p (so the top token always stays).
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < cfg.top_p
        # The cut-off value is the smallest kept logit; ties at the cut-off are all kept.
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


def probabilities(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The sampling distribution as probabilities [..., V]; greedy is a one-hot at the argmax."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.exp(filtered_logprobs(logits, cfg))


def sample(key: jax.Array, logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """logits [..., V] -> token ids [...] (int32)."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logprobs(logits, cfg), axis=-1).astype(jnp.int32)


def resolve_key(key: jax.Array | None, cfg: SamplingConfig) -> jax.Array:
    """The PRNG key to decode with: sampling requires an explicit one; greedy draws nothing."""
    if key is not None:
        return key
    if not cfg.greedy:
        raise ValueError("sampling needs an explicit PRNG key (key=jax.random.key(seed))")
    return jax.random.key(0)
