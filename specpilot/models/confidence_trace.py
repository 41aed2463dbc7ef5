"""Drafter confidence by outcome: a trained pair's top-1 draft probabilities, recorded per draft outcome
(accepted, first rejected, after) as quantile tables, and replayed by the oracle drafter, so the serving
engine's confidence budget reads a calibrated signal at shapes where only oracle acceptance exists.
Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np

from specpilot.models.oracle_trace import trace_path

GRID = np.linspace(0.0, 1.0, 101)
OUTCOMES = ("accepted", "first_rejected", "after")


def outcomes(accepted_per_step: np.ndarray, depth: int) -> np.ndarray:
    """accepted_per_step [steps, B] (-1: no step) -> [steps, B, depth] int8: 0 accepted, 1 first rejected,
    2 after it, -1 where the row did not step."""
    a = np.asarray(accepted_per_step)[..., None]
    k = np.arange(1, depth + 1)
    code = np.where(k <= a, 0, np.where(k == a + 1, 1, 2)).astype(np.int8)
    return np.where(a >= 0, code, -1).astype(np.int8)


def confidence_table(top1: np.ndarray, accepted_per_step: np.ndarray) -> dict:
    """top1 [steps, B, depth] (the drafter's top-1 probability per draft position), accepted_per_step
    [steps, B] -> {outcome: [len(GRID)] quantiles (empty when the outcome never occurred), "counts":
    {outcome: n}, "mean": {outcome: mean or None}, "grid": len(GRID)}."""
    top1 = np.asarray(top1, np.float64)
    code = outcomes(accepted_per_step, top1.shape[-1])
    out, counts, means = {}, {}, {}
    for i, name in enumerate(OUTCOMES):
        x = top1[code == i]
        out[name] = [round(float(q), 7) for q in np.quantile(x, GRID)] if x.size else []
        counts[name] = int(x.size)
        means[name] = round(float(x.mean()), 6) if x.size else None
    return {**out, "counts": counts, "mean": means, "grid": len(GRID)}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Quantile tables (each [len(GRID)], non-decreasing, in [0, 1]) of the drafter's top-1 probability
    for accepted, first-rejected and later drafts; hashable (it rides in a jit-static drafter)."""

    accepted: tuple[float, ...]
    first_rejected: tuple[float, ...]
    after: tuple[float, ...]
    source: str = ""

    def __post_init__(self):
        for name in OUTCOMES:
            q = np.asarray(getattr(self, name), np.float64)
            if q.shape != GRID.shape or (np.diff(q) < 0).any() or q.min() < 0 or q.max() > 1:
                raise ValueError(f"{self.source or 'calibration'}: the {name!r} table must be {GRID.size} "
                                 f"non-decreasing probabilities")

    @classmethod
    def from_table(cls, table: dict, source: str = "") -> "Calibration":
        missing = [k for k in OUTCOMES if not table.get(k)]
        if missing:
            raise ValueError(f"{source or 'calibration'}: no samples for {missing} (a table is drawn from)")
        return cls(*(tuple(float(q) for q in table[k]) for k in OUTCOMES), source=source)

    def tables(self) -> jnp.ndarray:
        """[3, len(GRID)] float32, rows in OUTCOMES order."""
        return jnp.asarray([self.accepted, self.first_rejected, self.after], jnp.float32)


def sample(quantiles, u):
    """Inverse-CDF draws: u (uniform in [0, 1], any shape) through the quantile grid, linearly
    interpolated. quantiles [len(GRID)] or [..., len(GRID)] matching u's leading shape."""
    q = jnp.asarray(quantiles, jnp.float32)
    # the grid is uniform: a draw's cell and offset within it come from u directly
    pos = jnp.clip(u.astype(jnp.float32), 0.0, 1.0) * (GRID.size - 1)
    lo = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, GRID.size - 2)
    frac = pos - lo.astype(jnp.float32)
    if q.ndim == 1:
        a, b = q[lo], q[lo + 1]
    else:
        a = jnp.take_along_axis(q, lo[..., None], axis=-1)[..., 0]
        b = jnp.take_along_axis(q, lo[..., None] + 1, axis=-1)[..., 0]
    return a + frac * (b - a)


def load_calibration(path, method: str = "stock") -> Calibration:
    """The confidence calibration recorded for `method` in a trace file (`experiments/bench/record_trace.py`)."""
    p = trace_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no confidence trace at {p} (write one with experiments/bench/record_trace.py)")
    data = json.loads(p.read_text())
    methods = data.get("methods") if isinstance(data, dict) else None
    if not isinstance(methods, dict):
        raise ValueError(f"{p}: a trace file holds {{'methods': {{name: {{'confidence': {{...}}}}}}}}")
    have = sorted(k for k, m in methods.items() if isinstance(m, dict) and m.get("confidence"))
    if method not in have:
        raise ValueError(f"{p} has no confidence table for method {method!r} (methods with one: "
                         f"{', '.join(have) or 'none'})")
    return Calibration.from_table(methods[method]["confidence"], source=str(path))
