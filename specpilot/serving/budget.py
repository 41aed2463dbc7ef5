"""Per-request speculation budget: each step, each row's draft count from the drafter's confidence.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specpilot.costmodel.prediction import predict


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Seconds of one decode step that verifies `tokens` tokens: fixed_s + per_token_s * tokens, or, with
    `points` ((tokens, seconds) pairs, measured), the line through the nearest two of them."""

    fixed_s: float = 1.0
    per_token_s: float = 0.0
    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not self.fixed_s > 0 or self.per_token_s < 0:
            raise ValueError(f"StepCost needs fixed_s > 0 and per_token_s >= 0, got {self.fixed_s}, "
                             f"{self.per_token_s}")
        xs = [t for t, _ in self.points]
        if xs != sorted(set(xs)) or any(not s > 0 for _, s in self.points):
            raise ValueError(f"StepCost.points must be (tokens, seconds > 0) pairs in increasing token order, "
                             f"got {self.points}")

    def step_s(self, tokens):
        if self.points:
            xs = jnp.asarray([t for t, _ in self.points], jnp.float32)
            ys = jnp.asarray([s for _, s in self.points], jnp.float32)
            return jnp.interp(jnp.asarray(tokens, jnp.float32), xs, ys)
        return self.fixed_s + self.per_token_s * tokens

    @classmethod
    def from_predict(cls, plan, setting, slots: int) -> "StepCost":
        """The line through the cost model's step times of `plan` at `setting` (a `prediction.Setting`)
        with `slots` rows verifying 2 and block_size tokens each (the draft stage counted once, at the
        plan's block: the drafter always drafts a full block)."""
        bs = plan.block_size
        if plan.verify != "chain" or bs < 3:
            raise ValueError(f"plan {plan.name!r}: a per-token step cost needs a chain plan of block >= 3")
        s = dataclasses.replace(setting, shape=dataclasses.replace(setting.shape, batch=int(slots)))
        full = predict(plan, s, tau=1.0)
        small = predict(dataclasses.replace(plan, block_size=2), s, tau=1.0)
        verify = lambda p: p.step_s - p.stages.get("draft", 0.0)  # noqa: E731
        per_token = max(verify(full) - verify(small), 0.0) / (slots * (bs - 2))
        return cls(fixed_s=full.step_s - per_token * slots * bs, per_token_s=per_token)


def marginal_gains(confidence: jax.Array) -> jax.Array:
    """confidence [S, K] (the drafter's top-1 probability per draft) -> [S, K] expected accepted tokens
    each draft adds when verified after all earlier ones: prod_{l <= j} p_l."""
    return jnp.cumprod(confidence.astype(jnp.float32), axis=-1)


def expected_accepted(confidence: jax.Array, k: jax.Array) -> jax.Array:
    """[S] expected accepted drafts when row b verifies its first k[b]: sum_{j < k} prod_{l <= j} p_l."""
    gains = marginal_gains(confidence)
    j = jnp.arange(gains.shape[-1], dtype=jnp.int32)
    return jnp.sum(jnp.where(j[None, :] < k[:, None], gains, 0.0), axis=-1)


def confidence_of(draft_logits: jax.Array) -> jax.Array:
    """draft logits [S, K, V] -> [S, K] top-1 probabilities."""
    return jnp.max(jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1), axis=-1)


def stream_index(tokens: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """The index of the smallest of the ascending stream `sizes` holding `tokens` (the last where none does)."""
    return jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), tokens, side="left"), len(sizes) - 1)


def round_up(tokens: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """The smallest of the ascending stream `sizes` holding `tokens` (the largest where none does)."""
    return jnp.asarray(sizes, jnp.int32)[stream_index(tokens, sizes)]


def choose_draft_lengths(confidence: jax.Array, active: jax.Array, token_budget: int,
                         cost: StepCost = StepCost(), sizes: tuple[int, ...] = ()) -> jax.Array:
    """Each row's draft count k [S] int32 (1..K for active rows, 0 otherwise) maximising
    (rows + expected accepted) / cost.step_s(n) subject to n = sum (k + 1) <= token_budget; with stream
    `sizes` (ascending), the step computes, and is priced at, the smallest size holding n.

    confidence [S, K]; active [S] bool; token_budget >= 2 x active rows (every row verifies one draft).
    """
    s, kmax = confidence.shape
    active = active.astype(bool)
    if kmax == 1:
        return active.astype(jnp.int32)
    gains = marginal_gains(confidence)  # [S, K]
    rows = jnp.sum(active.astype(jnp.int32))
    base_gain = rows.astype(jnp.float32) + jnp.sum(jnp.where(active, gains[:, 0], 0.0))
    extra = jnp.where(active[:, None], gains[:, 1:], -1.0).reshape(-1)  # [S*(K-1)]: drafts 1.. of each row
    order = jnp.argsort(-extra, stable=True)  # largest first; a row's earlier draft first on ties
    n = extra.shape[0]
    e = jnp.arange(n + 1, dtype=jnp.int32)  # extra drafts taken
    total_gain = base_gain + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(extra[order])])
    tokens = 2 * rows + e
    ok = (e <= rows * (kmax - 1)) & (tokens <= token_budget)
    priced = round_up(tokens, sizes) if sizes else tokens
    rate = jnp.where(ok, total_gain / cost.step_s(priced.astype(jnp.float32)), -jnp.inf)
    best = jnp.argmax(rate)  # the first maximum: the fewest tokens among equal rates
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    taken = (rank < best).reshape(s, kmax - 1)
    return jnp.where(active, 1 + jnp.sum(taken.astype(jnp.int32), axis=-1), 0).astype(jnp.int32)
