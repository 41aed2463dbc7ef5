"""Public functions of the Mosaic GPU W12 kernel: its config, the step / stage / split rules, the partial
products of W12 and of its bf16 twin, the product as runs take it (`mosaic_matmul`), the layouts for a
model's weights (`prepare_w12`, `prepare_twin`) and the pure-jnp references. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import NUM_SMS_H200, sum_splits
from pallas_kernels.w12_mosaic.kernel import SWIZZLE_BF16, kernel_call
from pallas_kernels.w12_mosaic.layout import BN, TwinNK, W12NK, check_shape, decode_nk, tile_twin, to_nk, untile_twin
from specpilot.formats.w12 import W12


@dataclasses.dataclass(frozen=True)
class W12MosaicConfig:
    """The Mosaic GPU W12 kernel's settings (defaults: what runs use, measured on the H200)."""

    mp_choices: tuple[int, ...] = (8, 16, 32, 64)  # x's rows padded to the least that holds them (wgmma N)
    large_n: int = 32768  # N from which a matrix is stepped 128 half-rows at a time (the LM head)...
    large_step_max_rows: int = 16  # ...for products of up to this many rows per call
    small_m_stages: int = 2  # pipeline depth at steps of 64 for up to 16 rows
    programs_per_sm: int = 2  # the default split's target: the smallest split giving this many programs per SM...
    wave_programs_per_sm: int = 3  # ...unless that needs more than this many per SM (one wave)
    qkv_barrier: bool = True  # materialize the fused qkv product (`dispatch.matmul(role="qkv")`)
    # products of more rows are refused (NotImplementedError: a choice's next implementation takes them):
    # the K-split partials are [splits, rows, N] float32, 85 GB at a 32 x 512-token prefill's LM head on
    # the H200 (out of memory); verification steps (batch x block) stay far below
    max_rows: int = 2048
    interpret: bool | None = None  # the Mosaic GPU interpreter; None: on CPU backends

    def __post_init__(self):
        if not self.mp_choices or any(p % 8 or not 8 <= p <= 64 for p in self.mp_choices) \
                or tuple(sorted(self.mp_choices)) != tuple(self.mp_choices):
            raise ValueError(f"mp_choices must be increasing multiples of 8 in [8, 64], got {self.mp_choices}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if min(self.small_m_stages, self.programs_per_sm, self.wave_programs_per_sm) < 1 or self.large_step_max_rows < 0:
            raise ValueError(f"small_m_stages, programs_per_sm and wave_programs_per_sm must be >= 1, "
                             f"large_step_max_rows >= 0: {self}")


DEFAULT = W12MosaicConfig()


def default_block_k(k: int, n: int, rows: int = 1, config: W12MosaicConfig = DEFAULT) -> int:
    """The step (half-rows of K per pipeline step) a [K, N] weight is laid out for, for products of up to
    `rows` rows per call (a deployment's batch x verification block): 128 at the LM head, else 64."""
    large = n >= config.large_n and rows <= config.large_step_max_rows
    return 128 if large and (k // 2) % 128 == 0 and n % BN == 0 else 64


def default_stages(block_k: int, mp: int = 16, config: W12MosaicConfig = DEFAULT) -> int:
    """Pipeline depth: 2 for steps of 128 and for 32 or 64 rows (x's tile is then 8-16 KB a step; fewer
    stages leave room for more programs per SM), else `small_m_stages`. Stages do not change the bits."""
    return 2 if block_k >= 128 or mp >= 32 else config.small_m_stages


def _split(kh: int, block_k: int, n: int, target_programs: int, max_programs: int | None = None) -> int:
    """Smallest split of the K/2 rows into whole steps giving `target_programs` programs (of 64 W^T rows);
    if that gives more than `max_programs`, the largest split giving at most that many (and at least 1)."""
    steps = kh // block_k
    splits = [s for s in range(1, steps + 1) if steps % s == 0]
    s = next((s for s in splits if (n // BN) * s >= target_programs), steps)
    if max_programs is not None and (n // BN) * s > max_programs:
        s = max([t for t in splits if (n // BN) * t <= max_programs] or [1])
    return s


def default_split(k: int, n: int, block_k: int, config: W12MosaicConfig = DEFAULT) -> int:
    """The K split of a [K, N] weight at a step of block_k half-rows: the smallest giving `programs_per_sm`
    programs per SM, unless that needs more than one wave (`wave_programs_per_sm`)."""
    return _split(k // 2, block_k, n, config.programs_per_sm * NUM_SMS_H200,
                  config.wave_programs_per_sm * NUM_SMS_H200)


def fold_x(x_p: jax.Array, block_k: int) -> jax.Array:
    """[Mp, K] -> [Mp, K]: step i's x tiles of the lower and upper K half side by side, so the pipeline
    brings both with one copy. A permutation of a few KB per call."""
    mp, k = x_p.shape
    return x_p.reshape(mp, 2, k // 2 // block_k, block_k).transpose(0, 2, 1, 3).reshape(mp, k)


def _prepare_x(x: jax.Array, k: int, n: int, block_k: int, config: W12MosaicConfig):
    """x [M, K] -> (x padded to Mp rows and folded, M, Mp)."""
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x {x.shape} does not match a [{k}, {n}] weight")
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the kernel multiplies bf16 activations, got {x.dtype}")
    m = x.shape[0]
    check_shape(k, n, block_k)
    if m > config.mp_choices[-1]:
        raise NotImplementedError(f"the Mosaic W12 kernel takes M <= {config.mp_choices[-1]} per call, got {m}")
    if block_k % SWIZZLE_BF16:  # both operands' tiles have rows of 128 bytes
        raise ValueError(f"block_k = {block_k} must be a multiple of {SWIZZLE_BF16}")
    mp = next(p for p in config.mp_choices if p >= m)
    return fold_x(jnp.pad(x, ((0, mp - m), (0, 0))), block_k), m, mp


def _rows_of(raw: jax.Array, m: int) -> jax.Array:
    """The kernel's raw output [split, N, Mp] -> partials [split, m, N]."""
    return jnp.swapaxes(raw, 1, 2)[:, :m]


def sum_rows(raw: jax.Array, m: int) -> jax.Array:
    """[split, N, Mp] (`raw=True`) -> y [m, N] float32: the splits added in index order (`sum_splits`, so the
    same bits as summing the transposed partials), then transposed."""
    return sum_splits(raw)[:, :m].T


@functools.partial(jax.jit, static_argnames=("split", "stages", "interpret", "raw", "config"))
def w12_mosaic_partials(x: jax.Array, w: W12NK, *, split: int | None = None, stages: int | None = None,
                        interpret: bool = False, raw: bool = False,
                        config: W12MosaicConfig = DEFAULT) -> jax.Array:
    """x [M, K] bf16 (M <= 64), W12NK [K, N] -> partial products [split, M, N] float32 (`raw`: the kernel's
    own [split, N, Mp]). split / stages: `default_split` / `default_stages` unless given (any split of
    whole steps gives the twin's bits at that split)."""
    if not isinstance(w, W12NK):
        raise TypeError(f"w12_mosaic_partials takes a W12NK (layout.to_nk), got {type(w).__name__}")
    k, n = w.shape
    block_k = w.slot_k
    x_p, m, mp = _prepare_x(x, k, n, block_k, config)
    out = kernel_call(x_p, (w.packed, w.base7, w.slots), k=k, n=n, mp=mp, block_k=block_k,
                      split=split or default_split(k, n, block_k, config),
                      stages=stages or default_stages(block_k, mp, config), w12=True, interpret=interpret)
    return out if raw else _rows_of(out, m)


@functools.partial(jax.jit, static_argnames=("split", "stages", "interpret", "raw", "config"))
def bf16_mosaic_partials(x: jax.Array, w: TwinNK, *, split: int | None = None, stages: int | None = None,
                         interpret: bool = False, raw: bool = False,
                         config: W12MosaicConfig = DEFAULT) -> jax.Array:
    """The twin: the same kernel over a bf16 matrix tiled for it (`prepare_twin` / `layout.tile_twin`), its
    tiles streamed by the same pipeline straight to the same wgmma calls. Same defaults as W12's for the
    same shape and step, so the two pair up bit for bit."""
    if not isinstance(w, TwinNK):
        raise TypeError(f"bf16_mosaic_partials takes a TwinNK (prepare_twin), got {type(w).__name__}")
    k, n = w.shape
    if w.tiles.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the twin reads bf16 weights, got {w.tiles.dtype}")
    x_p, m, mp = _prepare_x(x, k, n, w.block_k, config)
    out = kernel_call(x_p, (w.tiles,), k=k, n=n, mp=mp, block_k=w.block_k,
                      split=split or default_split(k, n, w.block_k, config),
                      stages=stages or default_stages(w.block_k, mp, config), w12=False, interpret=interpret)
    return out if raw else _rows_of(out, m)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def _matmul_2d(rows: jax.Array, w, *, interpret: bool, config: W12MosaicConfig) -> jax.Array:
    """rows [M, K] bf16 @ w (W12NK or TwinNK) -> float32 [M, N]. Jitted so that a model's products of one
    shape are traced and lowered once, not once per layer (a Qwen3-8B step has 145 of them)."""
    k, n = w.shape
    partials = w12_mosaic_partials if isinstance(w, W12NK) else bf16_mosaic_partials

    def call(r):
        return sum_rows(partials(r, w, interpret=interpret, raw=True, config=config), len(r))

    m, step = rows.shape[0], config.mp_choices[-1]
    if m <= step:
        return call(rows)
    # one kernel call in a loop over blocks of `step` rows (the last one zero-padded): a prefill's program
    # holds one call per matrix, not m / step of them (compile time grows with the calls)
    blocks = jnp.pad(rows, ((0, -m % step), (0, 0))).reshape(-1, step, k)
    return jax.lax.map(call, blocks).reshape(-1, n)[:m]


def mosaic_matmul(x: jax.Array, w, config: W12MosaicConfig = DEFAULT) -> jax.Array:
    """x [..., K] @ w (W12NK or TwinNK) -> float32 [..., N], as runs multiply (x cast to bf16, any number of
    rows up to `config.max_rows`). Raises NotImplementedError for other weights, for more rows, and on a CPU backend with `config.interpret`
    False (the kernel compiles for NVIDIA GPUs only)."""
    if not isinstance(w, (W12NK, TwinNK)):
        raise NotImplementedError(f"the Mosaic W12 kernel multiplies W12NK or TwinNK weights (prepare_w12, "
                                  f"prepare_twin), got {type(w).__name__}")
    platform = jax.devices()[0].platform
    interpret = platform == "cpu" if config.interpret is None else config.interpret
    if not interpret and platform != "gpu":
        raise NotImplementedError(f"the Mosaic W12 kernel compiles for NVIDIA GPUs, not {platform!r} "
                                  f"(W12MosaicConfig(interpret=True) runs it in the interpreter)")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} does not match a [{k}, {n}] weight")
    rows = x.reshape(-1, k).astype(jnp.bfloat16)
    if rows.shape[0] > config.max_rows:
        raise NotImplementedError(f"the Mosaic W12 kernel takes up to max_rows={config.max_rows} rows per product, "
                                  f"got {rows.shape[0]} (a prefill: the next implementation decodes the weight)")
    return _matmul_2d(rows, w, interpret=bool(interpret), config=config).reshape(*x.shape[:-1], n)


def prepare_w12(w: W12, rows: int = 1, config: W12MosaicConfig = DEFAULT) -> W12NK:
    """A W12 matrix in the kernel's layout, stepped for products of up to `rows` rows per call. Raises
    NotImplementedError where the kernel does not take it (`layout.to_nk`)."""
    k, n = w.shape
    return to_nk(w, default_block_k(k, n, rows, config))


def prepare_twin(w: jax.Array, rows: int = 1, config: W12MosaicConfig = DEFAULT) -> TwinNK:
    """A bf16 [K, N] matrix tiled for the twin at W12's step for the same shape and rows."""
    k, n = w.shape
    block_k = default_block_k(k, n, rows, config)
    check_shape(k, n, block_k)
    if w.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the twin multiplies bf16 weights, got {w.dtype}")
    return TwinNK(tiles=tile_twin(jnp.asarray(w).T, block_k), shape=(k, n), block_k=block_k)


def w12_mosaic_reference(x: jax.Array, w: W12NK) -> jax.Array:
    """Pure jnp: x [..., K] @ the matrix a W12NK holds (`layout.decode_nk`), float32 accumulation."""
    return jnp.einsum("...k,kn->...n", x, decode_nk(w), preferred_element_type=jnp.float32)


def twin_mosaic_reference(x: jax.Array, w: TwinNK) -> jax.Array:
    """Pure jnp: x [..., K] @ the bf16 matrix a TwinNK holds (`layout.untile_twin`), float32 accumulation."""
    return jnp.einsum("...k,kn->...n", x, untile_twin(w), preferred_element_type=jnp.float32)
