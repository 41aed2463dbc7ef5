"""How much a plan's timings scatter, and whether the machine was too noisy for a run's speedups to count.

A plan timed over several repeats reports the range of its decode time per token relative to the median
(the first repeat left out from three on: it is the warm-up); timed once, the range over its batches
stands in (for speculative plans that also mixes in each batch's acceptance). The AR baseline's spread
is the run's noise: above `NOISY_SPREAD`, speedups within it are not told apart from noise.
"""

from __future__ import annotations

import statistics

NOISY_SPREAD = 0.10  # the AR baseline's timings scatter more than this: a noisy machine


def timing_spread(repeat_times: list[float], batch_times: list[tuple[float, int]]) -> dict | None:
    """{"over": "repeats" | "batches", "n", "range" ((max - min) / median), "min_ms", "max_ms"} of a
    plan's decode time per output token, or None with fewer than two samples."""
    samples, over = [t for t in repeat_times if t == t], "repeats"  # NaN: no decode step
    if len(samples) >= 3:
        samples = samples[1:]
    if len(samples) < 2:
        samples, over = [s / n for s, n in batch_times if n > 0], "batches"
    if len(samples) < 2:
        return None
    median = statistics.median(samples)
    if median <= 0:
        return None
    return {"over": over, "n": len(samples), "range": (max(samples) - min(samples)) / median,
            "min_ms": 1e3 * min(samples), "max_ms": 1e3 * max(samples)}


def noise_warning(ar_spread: dict | None, threshold: float = NOISY_SPREAD) -> str | None:
    """The noisy-machine warning when the AR baseline's spread exceeds `threshold`, else None."""
    if ar_spread is None or ar_spread["range"] <= threshold:
        return None
    pct = 100 * ar_spread["range"]
    return (f"noisy machine: AR timings spread {pct:.0f}% over {ar_spread['n']} {ar_spread['over']} (more than "
            f"{100 * threshold:.0f}%); speedups below {1 + ar_spread['range']:.2f}x are within noise")


def format_spread(spread: dict | None) -> str:
    return "-" if spread is None else f"{100 * spread['range']:.0f}%"
