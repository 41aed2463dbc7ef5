"""Split-K GEMV for decode: y[1, N] = x[1, K] @ W, W bf16, float32 accumulation (Pallas, Triton backend).

Design choices:
- One token's decode step is a chain of matrix-vector products that must stream every weight byte once;
  the kernel is built for that: no tensor cores (M = 1 would waste 15/16 of an MMA), FMAs into a
  [block_k, block_n] float32 accumulator per program, one cross-thread reduction at the end.
- Split-K: an N = 4096 matrix in 256-wide column blocks gives only 16 programs for 132 SMs, so the
  K axis is split too. Each split writes its own partial row `[split_k, 1, N]` (grid programs run in
  parallel, so they never accumulate into one output); the caller's XLA sum over splits is tiny and
  fuses with whatever consumes the result.
- Two weight layouts: "kn" (`[in, out]`, the layout of `specpilot.models.dense`) and "nk" (`[out, in]`,
  the torch / cuBLAS-friendly one). Both keep 16-byte contiguous loads along the fast axis.
- Only M = 1 is implemented; other M raise NotImplementedError so callers fall through to XLA's dot
  (`gemv(..., implementation="xla")` is the pure-jnp reference beside the kernel).
- Block sizes live in a frozen `GemvBlocks`; `default_blocks` picks them from the shape so that the grid
  holds a few programs per SM and every block dimension is a power of two (a Triton requirement).
- Measured (H200, 2026-11-29): at best on par with XLA's own Triton GEMM fusion per matrix (qkv
  20.2 vs 20.7-21.7 us, gate_up 59.9 vs 56.7-58.2 us, down 34.8 vs 32.1-32.8 us); a 256 x 128 tile
  with 4 warps spills and runs 15x slower. Its use is as a base for fusing neighbours into a GEMV.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NUM_SMS_H200 = 132


@dataclasses.dataclass(frozen=True)
class GemvBlocks:
    block_n: int = 256  # output columns per program
    block_k: int = 32  # rows of W per loop iteration (one pipelined load of block_k x block_n)
    split_k: int = 1  # programs along K; K // split_k must be a power of two
    num_warps: int = 4
    num_stages: int = 4


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def default_blocks(k: int, n: int, layout: str = "kn",
                   target_programs: int = 3 * NUM_SMS_H200) -> GemvBlocks:
    """Blocks for a K x N weight, from the H200 sweep of 2026-11-29 (docs/performance.md).

    "kn": 256 output columns x 64 rows per load (32 rows when the column blocks alone fill the chip, as
    for the LM head); "nk": 32 rows x 256 contiguous K per load. Then the smallest split of K that fills
    `target_programs` (more splits than needed only add partial-sum traffic).
    """
    wide_n = layout == "kn"
    block_n = _largest_pow2_divisor(n, 256 if wide_n else 32)
    n_blocks = n // block_n
    splits = [s for s in range(1, k + 1) if k % s == 0 and _pow2(k // s)]
    want_k = (32 if n_blocks >= target_programs else 64) if wide_n else 256
    block_k = min(want_k, max(k // s for s in splits))
    splits = [s for s in splits if k // s >= block_k]
    split_k = next((s for s in splits if n_blocks * s >= target_programs), splits[-1])
    return GemvBlocks(block_n=block_n, block_k=block_k, split_k=split_k)


def check_blocks(k: int, n: int, b: GemvBlocks) -> None:
    if n % b.block_n or k % b.split_k:
        raise ValueError(f"blocks {b} do not tile a [{k}, {n}] weight")
    k_split = k // b.split_k
    if not (_pow2(b.block_n) and _pow2(b.block_k) and _pow2(k_split)) or k_split % b.block_k:
        raise ValueError(f"blocks {b} for [{k}, {n}]: block_n, block_k and K/split_k must be powers "
                         f"of two with block_k dividing K/split_k")


def _gemv_kn_kernel(x_ref, w_ref, o_ref, *, block_k: int):
    # x_ref: [K_split, 1] (x transposed, so a slice broadcasts against W rows); w_ref: [K_split, BN];
    # o_ref: [1, BN] (this split's partial row).
    k_split, block_n = w_ref.shape

    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        w = w_ref[pl.ds(k0, block_k), :].astype(jnp.float32)  # [BK, BN]
        x = x_ref[pl.ds(k0, block_k), :].astype(jnp.float32)  # [BK, 1]
        return acc + x * w

    acc = jax.lax.fori_loop(0, k_split // block_k, body, jnp.zeros((block_k, block_n), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)


def _gemv_nk_kernel(x_ref, w_ref, o_ref, *, block_k: int):
    # x_ref: [1, K_split]; w_ref: [BN, K_split]; o_ref: [BN, 1] (this split's partial column).
    block_n, k_split = w_ref.shape

    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        w = w_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)  # [BN, BK]
        x = x_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)  # [1, BK]
        return acc + w * x

    acc = jax.lax.fori_loop(0, k_split // block_k, body, jnp.zeros((block_n, block_k), jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("layout", "blocks", "interpret"))
def gemv_partials(x: jax.Array, w: jax.Array, layout: str = "kn", blocks: GemvBlocks | None = None,
                  interpret: bool = False) -> jax.Array:
    """Per-split partial products [split_k, N] float32 (sum over axis 0 for the result)."""
    if x.ndim != 2 or x.shape[0] != 1:
        raise NotImplementedError(f"the Pallas GEMV handles M = 1 only, got x {x.shape}")
    if layout == "kn":
        k, n = w.shape
    elif layout == "nk":
        n, k = w.shape
    else:
        raise ValueError(f"layout must be 'kn' or 'nk', got {layout!r}")
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} does not match weight {w.shape} ({layout})")
    b = blocks or default_blocks(k, n, layout)
    check_blocks(k, n, b)
    ks = k // b.split_k
    grid = (n // b.block_n, b.split_k)
    params = dict(compiler_params=plt.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
                  interpret=interpret, grid=grid)
    if layout == "kn":
        out = pl.pallas_call(
            functools.partial(_gemv_kn_kernel, block_k=b.block_k),
            out_shape=jax.ShapeDtypeStruct((b.split_k, 1, n), jnp.float32),
            in_specs=[pl.BlockSpec((ks, 1), lambda j, s: (s, 0)),
                      pl.BlockSpec((ks, b.block_n), lambda j, s: (s, j))],
            out_specs=pl.BlockSpec((None, 1, b.block_n), lambda j, s: (s, 0, j)),
            **params,
        )(x.T, w)
        return out[:, 0, :]
    out = pl.pallas_call(
        functools.partial(_gemv_nk_kernel, block_k=b.block_k),
        out_shape=jax.ShapeDtypeStruct((b.split_k, n, 1), jnp.float32),
        in_specs=[pl.BlockSpec((1, ks), lambda j, s: (0, s)),
                  pl.BlockSpec((b.block_n, ks), lambda j, s: (j, s))],
        out_specs=pl.BlockSpec((None, b.block_n, 1), lambda j, s: (s, j, 0)),
        **params,
    )(x, w)
    return out[:, :, 0]


def gemv_reference(x: jax.Array, w: jax.Array, layout: str = "kn") -> jax.Array:
    """XLA's dot with float32 accumulation: [M, K] x W -> [M, N] float32."""
    spec = "mk,kn->mn" if layout == "kn" else "mk,nk->mn"
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def gemv(x: jax.Array, w: jax.Array, layout: str = "kn", implementation: str = "pallas",
         blocks: GemvBlocks | None = None, interpret: bool = False) -> jax.Array:
    """x [M, K] times W ("kn": [K, N], "nk": [N, K]) -> [M, N] float32.

    implementation="pallas" falls through to the XLA reference where the kernel does not apply (M != 1).
    """
    if implementation == "pallas":
        try:
            return gemv_partials(x, w, layout=layout, blocks=blocks, interpret=interpret).sum(0)[None]
        except NotImplementedError:
            pass
    elif implementation != "xla":
        raise ValueError(f"implementation must be 'pallas' or 'xla', got {implementation!r}")
    return gemv_reference(x, w, layout)
