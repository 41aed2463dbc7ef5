"""What the W12 kernels share: the device's SM count, the fixed-order split sum, the exception-list
operands and power-of-two helpers. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_SMS_H200 = 132  # the grid sizes of both kernels' default splits are chosen for this many SMs


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def sum_splits(partials: jax.Array) -> jax.Array:
    """[S, M, N] -> [M, N], adding the splits in index order as one chain of adds. An XLA reduce picks its
    summation order by fusion context (eager vs inside a larger jit gave different bits on the H200), so
    the order is written out: a W12 path and its twin then agree bit for bit wherever they are called."""
    acc = partials[0]
    for i in range(1, partials.shape[0]):
        acc = acc + partials[i]
    return acc


def no_exception_lists() -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows, cols, bits) standing for no exceptions: one sentinel at row -1, which matches nothing."""
    return jnp.full((1,), -1, jnp.int32), jnp.full((1,), -1, jnp.int32), jnp.zeros((1,), jnp.uint16)


def exception_lists(w) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows, cols, bits) of a W12 matrix's exceptions as kernel operands: zero-size operands do not lower,
    so a matrix without exceptions gets `no_exception_lists`."""
    if w.num_exceptions == 0:
        return no_exception_lists()
    return w.exc_row, w.exc_col, w.exc_val
