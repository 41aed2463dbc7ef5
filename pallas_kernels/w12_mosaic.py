"""W12 decode + matmul on the Mosaic GPU backend (Hopper: TMA, wgmma). Exact against its twin in the
Mosaic GPU interpreter and compiled on the H200, where it beats every bf16 path at the LM head for
M <= 32 (docs/performance.md). Runs use it with `gpu.kernel_backend=mosaic` (`w12.W12NK` weights).

y[M, N] = x[M, K] @ W[K, N], computed transposed: y^T = W^T x^T, so a 64-row block of W's columns is the
wgmma's M operand and x's few rows (padded to Mp = 16, 32 or 64) its N operand.

Design choices (the measurements behind each: docs/notes_w12.md):
- Planes in N-major order (`to_nk`): sm^T [N, K] int8 and the nibble plane^T [N, K/2] uint8, so a tile of
  W^T is a plain [64, BK] slice. Rows k and K/2 + k still share a nibble byte, so the nibble tile [64, BK]
  gives the codes of both K halves' tiles, in the same register layout, with one AND or one SHIFT.
- x's tiles are [Mp, BK] with 128-byte rows and the 128-byte swizzle, and wgmma reads them transposed
  (K-major B). An x^T tile would have rows of only 2 * Mp bytes: with that swizzle the twin ran at
  2.6 TB/s at M = 16 against 3.9 TB/s now.
- `plgpu.emit_pipeline` streams the planes and x into shared memory by TMA, `stages` steps deep. The decode
  runs in registers ("packed", the default: a step's three plane tiles side by side, one swizzled copy
  per step; "upcast": three copies; both loaded 4 bytes per thread in the 8 -> 16-bit upcast layout, then
  moved to the WGMMA layout; "wgmma": plain tiles loaded straight into it), by PTX on packed registers
  (`_ptx_decode`) when compiled, and wgmma takes the decoded tile from registers (`a_operand="smem"`
  stores it to shared memory instead). x is folded (`_fold_x`): one copy per step for both K halves.
  `pad_x=False` reads x unpadded (TMA fills the missing rows with zeros) and `mp=8` takes 8-row x tiles:
  exact, 0-3% off the kernel, but AR decode was slower with x unpadded, so runs pad (`PAD_X`).
- Exceptions: `to_nk` tabulates each step's exceptions (`exception_slots`); the pipeline streams a step's
  row with its planes, and each listed exception overwrites its element (PTX: a predicated bit-select in
  the register that holds it, compared only by the threads that hold its row, `owner_branch`; jnp:
  `where` against a packed iota).
  Matrices with a step of more than 255 exceptions fall back to the CSR lists, read from global memory.
- The twin (`bf16_mosaic_partials`) is the same kernel with the bf16 W^T tiles streamed by the same
  pipeline instead of decoded: same wgmma calls on the same values in the same order. W12 is lossless iff
  the two agree bit for bit (tests: interpreter and GPU; the benchmark checks every timed case).
- Split-K over a grid axis (partials [S, N, Mp]; sum them with `w12_matmul.sum_splits`, the fixed order),
  or, with `sum_splits_in_kernel`, added by the kernel itself in the same order: the last split's program
  waits on its column block's semaphore (a global one, `pl.get_global`) for the others' partials. Exact on
  the H200 but slower in AR decode, so runs leave it off (`SUM_SPLITS_IN_KERNEL`).
- `tiled` planes (each step's tile contiguous, `to_nk(tiled=True)`; the twin's `tile_twin`) copied
  `plain_planes` (one unswizzled 12 KB box per step, plain loads): exact, 4-6% off the kernel at the big
  layer shapes at up to 16 rows and 2.4% off AR decode: on in runs (`TILED`, `PLAIN_PLANES`). Their rows
  are stored in `chunk_order` (`to_nk(xor_chunks=True)`, runs `XOR_CHUNKS`) and loaded by the PTX decode
  itself, so no load has a bank conflict (plain rows of 192 bytes gave 4-way ones). `early_base` (the
  bases' copy issued alongside the pipeline, waited for in the first step) is on in runs (`EARLY_BASE`).
- The K split (`default_split`): 2 programs per SM, unless that needs a second wave of programs.
- The step follows the shape and the rows per call (`default_block_k`): 128 half-rows over 2 stages at the
  LM head for up to 16 rows, 64 elsewhere, over 3 stages up to 16 rows and 2 from 32 (`default_stages`).
  Warp specialization (`warp_specialized`) is exact on the GPU but not faster; not yet: M > 64.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemv import NUM_SMS_H200
from pallas_kernels.w12_matmul import exception_lists, no_exception_lists, sum_splits
from specpilot.formats.w12 import W12, W12NK  # noqa: F401 - W12NK is this kernel's layout

BN = 64  # W^T rows (W columns) per program: one warpgroup's wgmma M
# x rows padded to one of these (wgmma N). 8 (wgmma's least) took 2-3% off the kernel at M = 1 in an earlier
# pass (mg23) but was timed in AR decode only with x unpadded, which was slower for another reason; padded
# to 8 rows, AR decode took 4.27 against 4.35 ms per token at 16 (fourteenth pass, docs/performance.md).
MP_CHOICES = (8, 16, 32, 64)
SWIZZLE = 128  # bytes: the swizzle of both wgmma operands in shared memory (TMA's widest, bank-conflict free)
SWIZZLE_BF16 = SWIZZLE // 2  # bf16 elements per swizzled row: block_k is a multiple of it


# Step size by shape and rows (measured on the H200, docs/performance.md, runs mg11-mg14): at the LM head,
# steps of 128 half-rows over 2 stages read 3 x 128-byte rows per step and beat 64 x 3 stages at M <= 16
# (264-276 against 288-296 us); at M = 32 they are 2-3% slower and at M = 64 20% slower. At the layer
# shapes they are level or slower at every M, so those keep 64.
LARGE_N = 32768  # N from which block_k 128 is the default
LARGE_STEP_MAX_ROWS = 16  # the most rows per call for which it is


def default_block_k(k: int, n: int, rows: int = 1) -> int:
    """The step (half-rows of K per pipeline step) `to_nk` packs a [K, N] weight for, and its twin uses,
    for products of up to `rows` rows per call (a deployment's batch x verification block)."""
    large = n >= LARGE_N and rows <= LARGE_STEP_MAX_ROWS
    return 128 if large and (k // 2) % 128 == 0 and n % BN == 0 else 64


# The pipeline depth at steps of 64 for up to 16 rows (`default_stages`). 2 took 1-3% off W12's gate/up and
# down kernels at M = 1 and 16 and left the twin level (mg53, docs/performance.md, thirteenth pass); alone it
# left AR decode level (4.33-4.37 against 4.34 ms per token), together with 8-row x tiles and no automatic
# barriers it took AR decode to 4.21-4.22 ms (fourteenth pass). `bench_ar.py --w12-small-m-stages` sets it for a run.
SMALL_M_STAGES = 2


def default_stages(block_k: int, mp: int = 16) -> int:
    """Pipeline depth for a step size and x's padded rows: 2 for steps of 128 (two 32 KB steps in flight
    per program) and for 32 or 64 rows (x's tile is then 8-16 KB a step; fewer stages leave room for more
    programs per SM: 5-10% faster for W12 and 2-4% for the twin at 64 rows on the H200, mg36-mg37 in
    docs/performance.md), else `SMALL_M_STAGES`. Stages do not change the bits (same steps, same order)."""
    return 2 if block_k >= 128 or mp >= 32 else SMALL_M_STAGES


# Packed planes in the wgmma register order (`mma_order`), measured faster on the H200 at every shape and
# row count (docs/performance.md): at up to 16 rows per call 3-6% off the kernel time (mg20), the LM head at
# any (mg21), and the layer shapes at 32 and 64 rows over 2 stages (`default_stages`; 3-6% faster than the
# plain order there, mg37; over 3 stages they had been 8% slower, mg20). MMA_ORDER, if not None, overrides
# it (benchmarks time both).
MMA_ORDER: bool | None = None


def default_mma(k: int, n: int, rows: int = 1) -> bool:
    """Whether `to_nk` packs a [K, N] weight in `mma_order` for products of up to `rows` rows per call:
    yes at every shape and row count measured, unless `MMA_ORDER` says otherwise."""
    del k, n, rows  # the measured rule no longer depends on them
    return True if MMA_ORDER is None else MMA_ORDER


def mma_order(width: int) -> np.ndarray:
    """The column order of a plane tile in "mma order": stored column s holds true column perm[s].

    The kernel loads a plane tile 4 bytes per thread in the 8 -> 16-bit upcast layout, where a thread of
    a warp holds, of each 16 columns, 4 consecutive ones: lane%4 = 0, 1, 2, 3 hold columns 0-3, 8-11,
    4-7, 12-15. wgmma's A registers give that thread columns 2 (lane%4) + {0, 1} and 8 + 2 (lane%4) + {0, 1}.
    Storing the columns so that a thread's 4 loaded bytes are those 4 columns (swap bits 1 and 3 of the
    column within each 16) lets the decode write its registers straight into the wgmma layout, without
    the warp shuffle of the layout change. The order is its own inverse."""
    s = np.arange(width)
    return (s & ~0b1010) | (((s >> 3) & 1) << 1) | (((s >> 1) & 1) << 3)


def _unpermute_jnp(a: jax.Array) -> jax.Array:
    """[R, C] in mma order -> true order (the interpreter's path; swaps bits 1 and 3 of each column)."""
    r, c = a.shape
    return a.reshape(r, c // 16, 2, 2, 2, 2).transpose(0, 1, 4, 3, 2, 5).reshape(r, c)


# Whether runs (`w12.encode_params(kernel="mosaic")`, `w12.linear`) pack adjacent row blocks per step and
# multiply twins that pair the same blocks (`to_nk(adjacent=)`): x is then read as it is, with no
# reordering per call. In AR decode (H200, docs/performance.md) that removed the 107 small transposes per
# token, but the padding of x to Mp rows took their place as its own fusion (same count, same time): no
# measured gain, so off. It is the half of the fix that is done; the other is reading x unpadded.
ADJACENT = False

# Whether runs (`w12._mosaic_rows`) pass x to the kernel as it is (`pad_x=False`: unpadded, and unfolded
# unless adjacent row blocks), so that no fusion per call makes a padded copy of x: the copies of the x tiles
# overhang x's rows and TMA fills the rest with zeros. The interpreter always pads. At the sixteenth pass's
# defaults it removes the o projection's own x fusion (1.2 us per layer in the AR profile); AR decode 4.190
# against 4.238 ms per token in one call, 4.201 / 4.251 with `ADJACENT` too (docs/performance.md, sixteenth
# pass): within the runs' spread, so x is still padded.
PAD_X = True

# Whether runs have the kernel add its K splits itself (`sum_splits_in_kernel`): no XLA sum of the partials
# follows each call. Exact on the H200, and the sums went from AR decode, but each call got 1.6 us longer
# (the last split waits, then reads the partials) and AR was slower: 4.95 against 4.75 ms per token
# (docs/performance.md, eighth pass). Off.
SUM_SPLITS_IN_KERNEL = False


# Whether runs (`w12.encode_params(kernel="mosaic")`) store packed planes tile by tile (`to_nk(tiled=)`),
# each step's 12 KB tile one contiguous run of memory instead of 64 pieces of 192 bytes 6-18 KB apart, and
# whether the W12 kernel copies its rows' bases alongside the pipeline (`early_base`) instead of before it.
# Tiled planes copied plain (`PLAIN_PLANES`: one contiguous 12 KB copy per step) made AR decode 2.4% faster:
# 4.59 against 4.71 ms per token in one session (docs/performance.md, ninth pass): on. Early bases, with
# tiled swizzled planes, made AR slower (5.05 against 4.75 ms per token, eighth pass); with plain chunk-ordered
# tiles they take 0.4-0.6 us off [4096, 1024], 0.2-1.0 us off [4096, 4096], and are level at the big shapes
# (mg48, eleventh pass), and AR decode was faster with them (4.34 against 4.50 ms per token, both with
# qkv's product materialized, `bench_ar.py --qkv-barrier`; docs/performance.md, eleventh pass): on.
TILED = True
EARLY_BASE = True


# Whether runs pack every W12 matrix at steps of 128 half-rows, copied as 128-byte-swizzled tiles and decoded
# in 64-column halves (`subtile`, `wide_swizzle`), with twins at block_k 64 and W12's split. With the planes
# only copied, such steps ran 10% faster than the 64-byte ones at K = 8192 (docs/performance.md, eighth
# pass); the full kernel, exact on the H200, was not faster (42.7 against 43.5 us at K = 8192, slower at
# 4096: ninth pass): off.
WIDE_SWIZZLE = False

# Whether runs patch exceptions only in the threads that hold the exception's row (`owner_branch`) or
# compare every register with every exception in every thread. Exact by construction (the same selects),
# timed on the H200 in the tenth pass (docs/performance.md).
OWNER_BRANCH = True

# Whether runs' owning threads (`OWNER_BRANCH`) branch on which of their two rows, then which K half, holds an
# exception and compare only those 4 registers (`row_branch`, `_ptx_decode`) instead of all 8 in both halves.
# Exact by construction (the registers skipped cannot match the entry) and on the H200 (GPU tests at the
# Qwen3 shapes). 0.0-0.4 us less at every layer shape at M = 1 and 16, never more (mg65: gate/up 38.5 against
# 38.6 and 39.2 against 39.6 us); AR decode level (4.203 against 4.217 ms per token; docs/performance.md,
# sixteenth pass): on. The patches still cost 0.4-0.8 us over no patches at all.
ROW_BRANCH = True

# Whether runs copy the packed plane tiles plain (`plain_planes`: one box as stored, neither tiled nor
# swizzled; steps of 64 only, a box row holds <= 256 bytes); with `TILED`, each step's tile is then one
# contiguous copy. Exact on the H200; plain tiled planes took 4-6% off the kernel at gate/up and down at
# 1-16 rows (mg33, mg38; level to 6% at 32-64) and made AR decode 2.4% faster (docs/performance.md,
# ninth pass): on.
PLAIN_PLANES = True

# Whether runs store tiled steps of 64 in `chunk_order` (`to_nk(xor_chunks=True)`), so that the PTX decode
# loads the plainly copied tiles without bank conflicts (the plain loads' are 4-way). Exact on the H200;
# the loads then cost nothing over the copies, the kernel 0.1-0.5 us less at the layer shapes, AR decode
# 4.490 against 4.540 ms per token (docs/performance.md, tenth pass): on.
XOR_CHUNKS = True

# Whether runs (`w12._mosaic_rows`) materialize each product after its split sum (an optimization barrier),
# W12 and twin alike; bits are unchanged (the sum's order is written out). XLA otherwise fuses the sum of the
# fused qkv matrix's partials into the k-norm's 8-output reduce and recomputes it there (5.8 us per layer on
# the H200). A barrier after qkv's product alone (`bench_ar.py --qkv-barrier`) removed that and made AR decode
# faster (4.32-4.34 against 4.50 ms per token); one after every product kept the GPU's busy time but
# lengthened the gaps between kernels (4.75 ms per token; docs/performance.md, eleventh pass): off.
SUM_BARRIER = False

# Whether the model's fused qkv product through the W12 kernel is materialized before its split, norms and
# RoPE (`dense._projections`: an optimization barrier after it; bits unchanged). Without it XLA fuses the sum
# of qkv's K-split partials into the k-norm's 8-output reduce and recomputes it there (5.8 us per layer on the
# H200); with it (`bench_ar.py --qkv-barrier`) AR decode took 4.32-4.34 against 4.50 ms per token
# (docs/performance.md, eleventh pass): on.
QKV_BARRIER = True

# Whether runs multiply more than 64 rows at once (a prefill) by decoding the W12 matrix to bf16 (`unpack_nk`,
# `w12.decode_jnp`: exact) and using XLA's dot, the twin by XLA's dot of its bf16 weight, instead of looping
# the kernel over 64-row blocks (which reads the planes once per block: a 512-token Qwen3-8B prefill took 52
# against bf16's 18 ms on the H200, twelfth pass). Exact, but slower: the same prefill took 110 ms through the
# run harness (XLA's elementwise decode makes several passes over every matrix; thirteenth pass): off.
PREFILL_DECODE = False

# Whether runs multiply with two warpgroups per program, one per K half of every step (`halves`), W12 and twin
# alike: twice the warps per program at the same programs and shared-memory tiles. Exact on the H200 but 1-3%
# slower at every layer shape at M <= 16 and 28% at gate/up at M = 64 (mg54, docs/performance.md, fourteenth
# pass): off.
HALVES = False

# Whether runs let Pallas insert its warpgroup barriers (bar.sync) around each copy issue and conditional of
# the pipeline, both kernels (`auto_barriers`; `_kernel_call` says why leaving them out is safe here). Without
# them W12's gate/up kernel took 1-4% less at M = 1 and 16, the other shapes level (mg55), AR decode level
# alone and faster together with 8-row x tiles and 2 stages (fourteenth pass, docs/performance.md): off.
AUTO_BARRIERS = False

# How many slot-table entries of each step the runs' PTX decode loads before decoding, deciding there which
# threads patch them (`prefetch_slots`, `_ptx_decode`); later entries go through the loop, which loads one,
# then branches on it. Bits unchanged (the same selects in the same order). With the loop alone, the patches
# took 0.5-1.4 us of gate/up's 38.8-40.0 us kernel and 0.5-0.7 us at down, qkv and o (no_patch, mg60), most of
# it in the loop's head: each entry's load, then its row's test, on every warp's path to the step's wgmma.
# Prefetching 1-3 entries left every shape within 0.4 us (mg62) and AR decode level (4.218 against 4.194 ms
# per token; docs/performance.md, fifteenth pass): off.
PREFETCH_SLOTS = 0

# How many consecutive steps runs copy at once (`copy_steps`, planes tiled in chunk order: one copy of
# COPY_STEPS x 12 KB), where it divides a program's steps; the steps are decoded and multiplied one by one,
# so the bits are those of single steps. With the planes only copied (diagnostic "copies_only"), steps of 128
# half-rows (24 KB) took 0-4% less than steps of 64 at gate/up and down (mg58). The whole kernel was 2-6%
# slower with 2 steps a copy and 30-45% with 4 at every layer shape (mg63), AR decode 4.294 against 4.238 ms
# per token (docs/performance.md, fifteenth pass): off.
COPY_STEPS = 1

# Whether runs' products store their sums row by row (`out_rows`: [split, Mp, N] instead of [split, N, Mp]),
# both kernels, so that the split sum after the call reads each real row's sums contiguously and nothing is
# transposed. The same bits (GPU tests). AR decode 4.271 ms per token with it against 4.20-4.24 without, 4.196
# with `PAD_X` off too and qkv's barrier dropped (docs/performance.md, sixteenth pass): within the runs' spread,
# off.
OUT_ROWS = False


_KNOBS = ("MP_CHOICES", "LARGE_N", "LARGE_STEP_MAX_ROWS", "MMA_ORDER", "ADJACENT", "PAD_X", "SUM_SPLITS_IN_KERNEL",
          "TILED", "EARLY_BASE", "WIDE_SWIZZLE", "OWNER_BRANCH", "ROW_BRANCH", "PLAIN_PLANES", "XOR_CHUNKS",
          "WAVE_PROGRAMS_PER_SM", "SMALL_M_STAGES", "HALVES", "AUTO_BARRIERS", "PREFETCH_SLOTS", "COPY_STEPS",
          "OUT_ROWS")


def knobs() -> tuple:
    """The module's switches that a product's trace reads (`w12._mosaic_rows`), as (name, value) pairs: the
    key under which that trace is cached."""
    return tuple((name, globals()[name]) for name in _KNOBS)


def run_block_k(k: int, n: int, rows: int = 1) -> int:
    """The step runs pack a [K, N] weight for: 128 with `WIDE_SWIZZLE` where the shape takes it, else
    `default_block_k`."""
    if WIDE_SWIZZLE and ADJACENT:  # W12's sub-steps of adjacent 128-row blocks are no twin's 64-row pairs
        raise NotImplementedError("w12_mosaic.WIDE_SWIZZLE does not take ADJACENT")
    if WIDE_SWIZZLE and (k // 2) % 128 == 0 and n % BN == 0:
        return 128
    return default_block_k(k, n, rows)


def run_xor_chunks(step: int) -> bool:
    """Whether runs store a matrix packed at `step` in `chunk_order`: `XOR_CHUNKS` where its tiles are
    copied plain (`TILED`, `PLAIN_PLANES`, steps of 64)."""
    return XOR_CHUNKS and TILED and PLAIN_PLANES and step == 64


def run_w12_options(w: W12NK) -> dict:
    """The options runs pass to the W12 kernel for a matrix packed by `to_nk` (besides `run_options`)."""
    wide = WIDE_SWIZZLE and w.slot_k == 128 and w.has_packed_planes
    plain = PLAIN_PLANES and not wide and w.has_packed_planes and w.slot_k == 64  # packed, one box per step
    copy = 1
    if COPY_STEPS > 1 and plain and w.xor_chunks and not HALVES:  # where it divides a program's steps
        k, n = w.shape
        copy = COPY_STEPS if (k // 2 // w.slot_k // default_split(k, n, w.slot_k)) % COPY_STEPS == 0 else 1
    return dict(early_base=EARLY_BASE, subtile=wide, wide_swizzle=wide, plain_planes=plain,
                owner_branch=OWNER_BRANCH, row_branch=ROW_BRANCH and OWNER_BRANCH, prefetch_slots=PREFETCH_SLOTS,
                copy_steps=copy)


def run_operands(w: W12NK) -> W12NK:
    """The matrix as runs pass it to the kernel: with a slot table (`slot_k`, the step runs use) the kernel
    never reads the CSR lists, whose lengths differ from matrix to matrix, so they become one-element
    placeholders; a model's products of one shape then share one trace (`w12._mosaic_rows`)."""
    if not w.slot_k:
        return w
    rows, cols, vals = no_exception_lists()
    return dataclasses.replace(w, exc_ptr=jnp.zeros((1,), jnp.int32), exc_row=rows, exc_col=cols, exc_val=vals)


def run_twin_steps(k: int, n: int, rows: int = 1) -> dict:
    """The step and split of the runs' twin for a [K, N] weight, paired with `run_block_k` and
    `run_w12_options`: W12's 64-column sub-steps of 128-row steps are the twin's steps of 64 at W12's split."""
    if WIDE_SWIZZLE and run_block_k(k, n, rows) == 128:
        return dict(block_k=64, split=default_split(k, n, 128))
    return dict(block_k=default_block_k(k, n, rows))


def run_options(adjacent: bool) -> dict:
    """The options runs pass to either kernel (`PAD_X`, `SUM_SPLITS_IN_KERNEL`, `HALVES`, `AUTO_BARRIERS`,
    `OUT_ROWS`)."""
    return dict(pad_x=PAD_X, fold_x=PAD_X or adjacent, sum_splits_in_kernel=SUM_SPLITS_IN_KERNEL, halves=HALVES,
                auto_barriers=AUTO_BARRIERS, out_rows=OUT_ROWS)


MAX_SLOTS = 256  # a step's slot row is one TMA box (<= 256 elements): 1 count + up to 255 exceptions
SLOT_ALIGN = 32  # int32 entries per 128 bytes


def exception_slots(w: W12, block_k: int, mma: bool = False, adjacent: bool = False) -> np.ndarray | None:
    """Each kernel step's exceptions as one row of a dense int32 table that the pipeline streams with the
    planes, so the patch loop reads shared memory instead of chasing CSR pointers in global memory.

    Row `kb * (N / 64) + jb` holds the exceptions of W^T rows [64 jb, 64 jb + 64) and K rows
    [block_k kb, block_k (kb + 1)) of both K halves: entry 0 is their count, then one int32 each,
    `bits << 16 | half << 15 | n_local << 8 | k_local`. Rows are padded to a multiple of SLOT_ALIGN entries
    (128 bytes: a copy in the kernel moves a multiple of one byte per thread of the warpgroup), which costs
    128 bytes per step (about 0.125 bits per weight at block_k = 64). None if a step holds more than
    MAX_SLOTS - 1 (the kernel then reads the CSR). `mma`: k_local is the stored column of planes packed in
    `mma_order`. `adjacent`: step kb pairs K rows [2 block_k kb, 2 block_k kb + block_k) ("lower") with the
    next block_k rows ("upper") instead of the two K halves (`to_nk(adjacent=True)`)."""
    k, n = w.shape
    kh = k // 2
    if block_k > 256:  # k_local has 8 bits in an entry
        raise ValueError(f"exception slots take block_k <= 256, got {block_k}")
    if w.num_exceptions == 0:
        return np.zeros((n // BN * (kh // block_k), SLOT_ALIGN), np.int32)
    rows, cols = np.asarray(w.exc_row, np.int64), np.asarray(w.exc_col, np.int64)
    vals = np.asarray(w.exc_val).astype(np.int64)
    if adjacent:
        half = (rows % (2 * block_k) >= block_k).astype(np.int64)
        kr = rows // (2 * block_k) * block_k + rows % block_k  # the step's block and the row in it, as below
    else:
        half = (rows >= kh).astype(np.int64)
        kr = rows - half * kh
    step = (kr // block_k) * (n // BN) + cols // BN  # step-major: a step's column blocks are adjacent
    n_steps = n // BN * (kh // block_k)
    counts = np.bincount(step, minlength=n_steps)
    if counts.max() >= MAX_SLOTS:
        return None
    width = -(-(int(counts.max()) + 1) // SLOT_ALIGN) * SLOT_ALIGN
    table = np.zeros((n_steps, width), np.int64)
    table[:, 0] = counts
    order = np.argsort(step, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(len(order)) - starts[step[order]] + 1
    k_local = mma_order(block_k)[kr % block_k] if mma else kr % block_k
    packed = (vals << 16) | (half << 15) | ((cols % BN) << 8) | k_local
    table[step[order], slot] = packed[order]
    return table.astype(np.uint32).view(np.int32)


def pack_planes(sm_t: jax.Array, nib_t: jax.Array, block_k: int, mma: bool = False,
                adjacent: bool = False) -> jax.Array:
    """[N, 3 K/2] int8: for each step kb of block_k half-rows, sm^T of the lower half's rows, sm^T of the
    upper half's rows and the nibble bytes, side by side, so that one copy brings a step's planes.
    `mma`: each tile's columns in `mma_order`. `adjacent`: step kb's "lower" rows are K rows
    [2 block_k kb, 2 block_k kb + block_k) and its "upper" rows the next block_k, their 4-bit codes
    re-paired into one byte (W12 pairs rows k and K/2 + k; the codes are the same), so that x needs no
    reordering: a step reads 2 block_k consecutive columns of it."""
    n, k = sm_t.shape
    kh, steps = k // 2, k // 2 // block_k
    if adjacent:
        codes = jnp.concatenate([nib_t & 0xF, nib_t >> 4], axis=1).reshape(n, steps, 2, block_k)  # row r's code
        nib = (codes[:, :, 0] | (codes[:, :, 1] << 4)).astype(jnp.uint8)
        sm3 = sm_t.reshape(n, steps, 2, block_k)
        parts = [sm3[:, :, 0], sm3[:, :, 1], jax.lax.bitcast_convert_type(nib, jnp.int8)]
    else:
        parts = [sm_t[:, :kh], sm_t[:, kh:], jax.lax.bitcast_convert_type(nib_t, jnp.int8)]
        parts = [p_.reshape(n, steps, block_k) for p_ in parts]
    if mma:
        parts = [p_[:, :, mma_order(block_k)] for p_ in parts]
    return jnp.stack(parts, axis=2).reshape(n, 3 * kh)


def tile_rows(a: jax.Array, block_k: int, width: int) -> jax.Array:
    """[N, steps * width] (a step's `width` columns side by side, step by step) -> [N / 64 * steps * 64,
    width]: the tiles of 64 rows and one step stored one after another, column block by column block, so
    that each step's tile is one contiguous run of memory (`tiled`) instead of 64 strided row pieces. Tile
    (jb, kb) is rows [64 (jb * steps + kb), 64 (jb * steps + kb + 1))."""
    n, cols = a.shape
    steps = cols // width
    if n % BN or cols % width or width % block_k:
        raise ValueError(f"tile_rows takes N % {BN} == 0 and whole steps, got {a.shape} at width {width}")
    return a.reshape(n // BN, BN, steps, width).transpose(0, 2, 1, 3).reshape(n * steps, width)


def tile_twin(w_t: jax.Array, block_k: int | None = None, adjacent: bool = False) -> jax.Array:
    """The twin's bf16 W^T [N, K] stored tile by tile (`bf16_mosaic_partials(tiled=True)`): per step, the
    lower and upper tiles side by side ([64, 2 block_k], as W12's packed planes pair them), each step's tile
    contiguous: [N / 64 * steps * 64, 2 block_k]. `adjacent`: a step pairs adjacent row blocks."""
    n, k = w_t.shape
    block_k = block_k or default_block_k(k, n)
    kh, steps = k // 2, k // 2 // block_k
    if adjacent:  # step kb's two blocks are K rows [2 block_k kb, 2 block_k (kb + 1)): already side by side
        paired = w_t
    else:
        paired = jnp.stack([w_t[:, :kh].reshape(n, steps, block_k), w_t[:, kh:].reshape(n, steps, block_k)],
                           axis=2).reshape(n, k)
    return tile_rows(paired, block_k, 2 * block_k)


class _Loaded:
    """A plane tile's values the interpreter already holds (planes stored in `chunk_order`, put back in
    order by jnp): `tile` passes them through."""

    def __init__(self, value):
        self.value = value


def chunk_order(rows: int = BN, width: int = 3 * 64) -> np.ndarray:
    """[rows, width] int: for each byte of a step's [64, 192] plane tile, the column it is stored at with
    `to_nk(xor_chunks=True)`: within each 64-byte plane (lower sm, upper sm, nibbles) the 16-byte chunk c of row r moves
    to c ^ ((r // 2) % 4) (the pattern of TMA's 64-byte swizzle). The kernel's loads in the upcast layout
    read 4 bytes per lane from 8 rows and 4 chunks per warp, and plain [64, 192] rows put rows r and r + 2
    on the same banks (a 4-way conflict); stored this way every load of a warp hits 32 distinct banks
    (`tests/test_w12_mosaic.py` checks both claims against jax's layout). Its own inverse."""
    r = np.arange(rows)[:, None]
    c = np.arange(width)[None, :]
    return (c & ~63) | ((c & 63) ^ (16 * ((r >> 1) & 3)))


def xor_tile_chunks(tiles: jax.Array) -> jax.Array:
    """Tiled packed planes [T * 64, 192] with each tile's rows stored in `chunk_order` (and back: the
    order is its own inverse). Static slices and selects only, so the interpreted kernel runs it too."""
    rows, width = tiles.shape
    if rows % BN or width != 3 * 64:
        raise ValueError(f"xor_tile_chunks takes tiled planes of steps of 64, [T * {BN}, 192], got {tiles.shape}")
    key = (jax.lax.broadcasted_iota(jnp.int32, tiles.shape, 0) >> 1) & 3  # the row's chunk XOR
    out = tiles
    for t in (1, 2, 3):  # the rows whose chunks c are stored at c ^ t
        moved = jnp.concatenate([tiles[:, 64 * p + 16 * (c ^ t):64 * p + 16 * (c ^ t) + 16]
                                 for p in range(3) for c in range(4)], axis=1)
        out = jnp.where(key == t, moved, out)
    return out


def to_nk(w: W12, block_k: int | None = None, pack: bool = True, mma: bool | None = None,
          adjacent: bool = False, tiled: bool = False, xor_chunks: bool = False) -> W12NK:
    """Transpose the planes once (offline, like encoding) and tabulate the exceptions per kernel step of
    `block_k` rows (`exception_slots`); the CSR lists are kept for matrices whose steps overflow a slot row.
    `block_k` defaults to `default_block_k(K, N)`. `pack` (default) stores the planes step by step for
    `planes="packed"` and only so (the separate N-major planes become empty placeholders); it needs the
    slot table, so a matrix with a step of more than 255 exceptions keeps separate planes. `pack=False`
    keeps separate planes for "upcast"/"wgmma". `mma` (default `default_mma(K, N)`): packed planes in
    `mma_order` (only with packed planes; the slot table then lists stored columns). `adjacent`: packed
    steps pair adjacent row blocks (`pack_planes`; only with packed planes), so x is not reordered per call;
    its twin is `bf16_mosaic_partials(..., adjacent=True)`. `tiled`: packed planes stored tile by tile
    (`tile_rows`; only with packed planes), so that each step's copy reads one contiguous 12 KB run.
    `xor_chunks` (with `tiled`, steps of 64): each tile's rows stored in `chunk_order` (`xor_tile_chunks`), read
    by the kernel's own conflict-free loads after a plain copy (`plain_planes`)."""
    k, n = w.shape
    block_k = block_k or default_block_k(k, n)
    if xor_chunks and not (tiled and block_k == 64):
        raise ValueError("xor_chunks stores tiled planes of steps of 64: to_nk(..., block_k=64, tiled=True, "
                         "xor_chunks=True)")
    exc = exception_lists(w)
    fits = (k // 2) % block_k == 0 and n % BN == 0
    mma = pack and (default_mma(k, n) if mma is None else mma)
    slots = exception_slots(w, block_k, mma=mma) if fits else None  # mma order renumbers, never moves, them
    sm_t, nib_t = jnp.asarray(w.sm).T.copy(), jnp.asarray(w.nib).T.copy()
    packed = pack and slots is not None
    mma = packed and mma
    adjacent = packed and adjacent
    if adjacent:  # re-paired steps hold other exceptions: one may overflow its slot row, then separate planes
        slots = exception_slots(w, block_k, mma=mma, adjacent=True)
        if slots is None:
            packed = mma = adjacent = False
    if packed:
        packed_planes = pack_planes(sm_t, nib_t, block_k, mma=mma, adjacent=adjacent)
        if tiled:
            packed_planes = tile_rows(packed_planes, block_k, 3 * block_k)
            if xor_chunks:
                packed_planes = xor_tile_chunks(packed_planes)
        sm_t, nib_t = jnp.zeros((1, 2 * SWIZZLE_BF16), jnp.int8), jnp.zeros((1, SWIZZLE_BF16), jnp.uint8)
    else:
        packed_planes = jnp.zeros((1, 3 * SWIZZLE_BF16), jnp.int8)
    return W12NK(sm_t=sm_t, nib_t=nib_t, packed=packed_planes,
                 base7=jnp.asarray(w.base).astype(jnp.int32) << 7, exc_ptr=jnp.asarray(w.exc_ptr),
                 exc_row=exc[0], exc_col=exc[1], exc_val=exc[2],
                 slots=jnp.zeros((1, SLOT_ALIGN), jnp.int32) if slots is None else jnp.asarray(slots),
                 shape=w.shape, group_n=w.group_n, group_k=w.group_k, n_groups_k=w.n_groups_k,
                 slot_k=0 if slots is None else block_k, mma_order=bool(mma), adjacent=bool(adjacent),
                 tiled=bool(packed and tiled), xor_chunks=bool(packed and tiled and xor_chunks))


def unpack_nk(w: W12NK) -> W12:
    """The W12 matrix that `to_nk` laid out as `w` (jax ops, traceable): chunk order, tiling, packing and mma
    order undone, the planes transposed back. Its CSR lists are `w`'s (with `exception_lists`' sentinel
    row -1 for a matrix without exceptions, which `w12.decode_jnp` skips)."""
    k, n = w.shape
    kh = k // 2
    if not w.has_packed_planes:
        sm_t, nib_t = w.sm_t, w.nib_t
    else:
        block_k = w.slot_k
        steps = kh // block_k
        packed = w.packed
        if w.tiled:  # `tile_rows` undone (after the chunk order, which is its own inverse)
            packed = xor_tile_chunks(packed) if w.xor_chunks else packed
            packed = packed.reshape(n // BN, steps, BN, 3 * block_k).transpose(0, 2, 1, 3).reshape(n, 3 * kh)
        parts = packed.reshape(n, steps, 3, block_k)
        if w.mma_order:  # its own inverse
            parts = parts[..., mma_order(block_k)]
        lower, upper = parts[:, :, 0], parts[:, :, 1]
        nib = jax.lax.bitcast_convert_type(parts[:, :, 2], jnp.uint8)
        if w.adjacent:  # step kb holds K rows [2 block_k kb, 2 block_k (kb + 1)), codes paired within it
            sm_t = jnp.stack([lower, upper], axis=2).reshape(n, k)
            codes = jnp.stack([nib & 0xF, nib >> 4], axis=2).reshape(n, k)  # row r's code, in row order
            nib_t = (codes[:, :kh] | (codes[:, kh:] << 4)).astype(jnp.uint8)
        else:
            sm_t = jnp.concatenate([lower.reshape(n, kh), upper.reshape(n, kh)], axis=1)
            nib_t = nib.reshape(n, kh)
    return W12(sm=sm_t.T, nib=nib_t.T, base=(w.base7 >> 7).astype(jnp.uint8), exc_ptr=w.exc_ptr,
               exc_row=w.exc_row, exc_col=w.exc_col, exc_val=w.exc_val, shape=w.shape, group_n=w.group_n,
               group_k=w.group_k)


def _transforms(bits: int, swizzle: int):
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _split(kh: int, block_k: int, n: int, target_programs: int, max_programs: int | None = None) -> int:
    """Smallest split of the K/2 rows into whole steps giving `target_programs` programs (of 64 W^T rows);
    if that gives more than `max_programs`, the largest split giving at most that many (and at least 1)."""
    steps = kh // block_k
    splits = [s for s in range(1, steps + 1) if steps % s == 0]
    s = next((s for s in splits if (n // BN) * s >= target_programs), steps)
    if max_programs is not None and (n // BN) * s > max_programs:
        s = max([t for t in splits if (n // BN) * t <= max_programs] or [1])
    return s


# Programs per SM that one wave of the grid may hold: at 64 rows a program's two stages take 56 KB of shared
# memory (W12) or 64 KB (the twin) of an H200 SM's 228 KB: room for 3, for W12 4 with none to spare. Grids
# of 512 programs (3.9 per SM) were the slow ones there, for both kernels: [4096, 4096] at split 8 took
# 12.4-13.4 us at 64 rows against 10.6 at split 4 (256 programs), and [4096, 1024] at split 32 5.5-5.6
# against 5.1-5.3 at 16 (docs/performance.md, mg48, mg49); where the default gives at most 3 per SM, it
# stayed the fastest split measured.
WAVE_PROGRAMS_PER_SM = 3


def default_split(k: int, n: int, block_k: int) -> int:
    """The K split both kernels take by default for a [K, N] weight at a step of block_k half-rows: the
    smallest giving 2 programs per SM, unless that needs more than one wave (`WAVE_PROGRAMS_PER_SM`)."""
    return _split(k // 2, block_k, n, 2 * NUM_SMS_H200, WAVE_PROGRAMS_PER_SM * NUM_SMS_H200)


def check_shape(k: int, n: int, block_k: int = 64):
    """Raise if a [K, N] weight does not fit the kernel's tiles (before encoding a model for it)."""
    if k % 2 or (k // 2) % block_k or n % BN:
        raise NotImplementedError(f"the Mosaic W12 kernel needs K/2 % {block_k} == 0 and N % {BN} == 0, "
                                  f"got a [{k}, {n}] weight; use gpu.kernel_backend=triton or xla")


def _check(k: int, n: int, m: int, block_k: int):
    check_shape(k, n, block_k)
    if m > MP_CHOICES[-1]:
        raise NotImplementedError(f"the Mosaic W12 kernel takes M <= {MP_CHOICES[-1]}, got {m}")


def _decode_ptx(halves: tuple[int, ...]) -> str:
    """The decode of the K halves `halves` (in output order) for one register: out $0, $1 the first
    half's words, then the next's; in, after the outputs, each half's sign+mantissa word, the nibble word
    and the row's base << 7. The nibble and base spreads are shared by the halves."""
    n_out = 2 * len(halves)
    nib, base = f"${n_out + len(halves)}", f"${n_out + len(halves) + 1}"
    lines = [".reg .b32 z, b2, e0, e1, x, t;", "mov.b32 z, 0;", f"prmt.b32 b2, {base}, z, 0x1010;",
             f"prmt.b32 e0, {nib}, z, 0x4140;", f"prmt.b32 e1, {nib}, z, 0x4342;"]
    for q, half in enumerate(halves):
        mask, scale = ("0x000F000F", 128) if half == 0 else ("0x00F000F0", 8)  # the half's nibble, shifted to << 7
        for w, (select, spread) in enumerate((("0x9180", "e0"), ("0xB3A2", "e1"))):
            lines += [f"prmt.b32 x, ${n_out + q}, z, {select};", f"and.b32 t, {spread}, {mask};",
                      f"mad.lo.u32 t, t, {scale}, b2;", f"lop3.b32 ${2 * q + w}, x, 0x807F807F, t, 0xEA;"]
    return "{\n" + "\n".join(lines) + "\n}"


# The PTX of `_ptx_decode` (tests/test_w12_mosaic.py runs each on the CPU, instruction by instruction).
# One register of the upcast layout: $4 four sign|mantissa bytes of the lower K half's tile (K elements
# k..k+3 of one W^T row), $5 the same for the upper half, $6 the four nibble bytes, $7 the row's base << 7;
# out $0, $1 the lower half's four bf16 patterns (two per register, element 0 in the low half), $2, $3
# the upper half's.
_DECODE4_PTX = _decode_ptx((0, 1))

# The diagnostic "ptx_load_only": the registers' loads kept, the decode replaced by one XOR per output
# word (4 instructions per 8 weights instead of 19); wrong values, timing only.
_LOAD_ONLY_PTX = """{
xor.b32 $0, $4, $6;
xor.b32 $1, $4, $7;
xor.b32 $2, $5, $6;
xor.b32 $3, $5, $7;
}"""


def decode2_ptx(half: int) -> str:
    """`_DECODE4_PTX` for one K half (`halves`): $2 the half's four sign+mantissa bytes, $3 the four nibble
    bytes, $4 the row's base << 7; out $0, $1 the half's four bf16 patterns. The same instructions as that
    half's in `_DECODE4_PTX`, so the same bits: 11 instructions per 4 weights."""
    if half not in (0, 1):
        raise ValueError(f"half must be 0 or 1, got {half}")
    return _decode_ptx((half,))


# One exception entry $4 (bits << 16 | half << 15 | n_local << 8 | k_local) -> $0 its position without the
# two lane bits (compared with a register's key), $1 its bits in both halves, $2 / $3 the halfword mask
# that selects its lane in a register's first / second word (zero in the other word).
_EXCEPTION_PTX = """{
.reg .b32 z, lane, m, s;
.reg .pred p;
mov.b32 z, 0;
and.b32 $0, $4, 0xFFFC;
prmt.b32 $1, $4, z, 0x3232;
and.b32 lane, $4, 3;
and.b32 s, $4, 1;
shl.b32 s, s, 4;
mov.b32 m, 0xFFFF;
shl.b32 m, m, s;
setp.lt.u32 p, lane, 2;
selp.b32 $2, m, z, p;
selp.b32 $3, z, m, p;
}"""
# One register ($2, $3: its two words) against one exception ($4 position, $5 the register's key, $6
# bits in both halves, $7 / $8 masks): $0, $1 the words with the exception's halfword replaced if the
# keys match (lop3 0xD8 = (a & ~c) | (b & c)), unchanged otherwise.
_PATCH_PTX = """{
.reg .pred p;
setp.eq.u32 p, $4, $5;
mov.b32 $0, $2;
mov.b32 $1, $3;
@p lop3.b32 $0, $2, $6, $7, 0xD8;
@p lop3.b32 $1, $3, $6, $8, 0xD8;
}"""


def _if_else(scf, cond, result_types):
    """An `scf.if` with an else block: its keyword is `has_else` in jaxlib 0.10's MLIR bindings and
    `hasElse` in upstream MLIR's."""
    import inspect
    kw = "has_else" if "has_else" in inspect.signature(scf.IfOp.__init__).parameters else "hasElse"
    return scf.IfOp(cond, result_types, **{kw: True})


def _ptx_decode(dec_layout, shape, use_slots: bool, col_offset: int = 0, mma: bool = False,
                part: int | None = None, owner_branch: bool = True, arithmetic: bool = True,
                from_ref: bool = False, half: int | None = None, prefetch_slots: int = 0,
                row_branch: bool = False, patch_probe: str = ""):
    """The decode of `decode="ptx"`: one `plgpu.inline_mgpu` function that works on the registers
    themselves. The plane tiles arrive in the upcast layout, four consecutive K elements of one W^T row
    per 32-bit register, and each register is decoded by a few PTX instructions on packed pairs:

    - `prmt` with sign replication puts two sign+mantissa bytes into the low bytes of two 16-bit halves
      and copies each byte's sign bit over the high byte; `& 0x807F807F` then leaves bf16's sign bit
      and the 7 mantissa bits of both values;
    - `prmt` spreads two nibble bytes over the two halves, one AND keeps the lower (or upper) half's
      nibble and one `mad` shifts the codes into place and adds the row's base << 7 to both;
    - one `lop3` merges the two.

    That is 19 instructions per 8 weights, against about 9 per weight from the element-wise jnp decode
    (PTX dump: docs/notes_w12.md). The sums are those of the jnp decode bit for bit: each 16-bit half's
    exponent sum stays below 2^16, so no carry crosses into the other half.

    Exceptions (slot table): each listed entry is compared with each register's position (row << 8 |
    first column, with the half bit), and the register holding it takes the value with two predicated
    bit-selects: about 3 instructions per register per exception, against 4 per element before.
    `owner_branch`: only the threads that hold the entry's row (a 64-bit mask of their rows, built once)
    take that branch, so the other warps of the warpgroup pay a few instructions per exception instead of
    the compares over all their registers.

    `mma` (planes packed in `mma_order`): a register's 4 loaded columns are the true columns
    2 (lane%4) + {0, 1} and 8 + 2 (lane%4) + {0, 1} of its 16, so its two decoded words are two registers
    of the WGMMA layout (column groups 2g and 2g + 1 of the register's 16-column group g), and the tiles
    come out in that layout: no layout change follows.

    `part` (`wide_swizzle`): the plane tiles arrive `shape[1] * parts` columns wide, and only the registers
    of their columns [part * shape[1], (part + 1) * shape[1]) are decoded (the others are never touched, so
    their loads are dead code); `col_offset` is then that part's first column in the step's table row.

    `arithmetic=False` (the diagnostic "ptx_load_only"): the same loads, one XOR per output word instead
    of the decode: wrong values, to time the loads against the arithmetic.

    `from_ref` (planes stored with `xor_chunks`): the function takes the step's [64, 3 * 64] plane tile in
    shared memory instead of three loaded tiles, and loads each register's 4 bytes of each plane itself,
    at the column `chunk_order` stored them in (one 32-bit shared-memory load each, all 32 lanes of a warp
    on distinct banks).

    `half` (0 or 1; `halves`, with `from_ref`): only that K half's tile is decoded (`decode2_ptx`), from
    its sign+mantissa plane and the nibbles; exceptions of the other half never match its keys. The
    function then returns that one tile.

    `row_branch` (with `owner_branch`): the thread's registers hold two rows of the tile (8 apart; their
    offsets are static in the layout), and an entry branches on which of the two is its row, then on its K
    half, so the owning thread compares only that row's 4 registers in that half instead of all 8 registers in
    both halves. The registers it skips are those whose keys cannot match the entry (another row or half), so
    the selects made are the same: the same bits.

    `patch_probe` (timing only, with the slot table; no exception is patched): "count" loads each step's count
    and makes the decode's first word depend on it (a select that never fires), with no loop; "entries" also
    loops over the count, loading each entry and carrying every word through the loop as the patches do, but
    compares nothing. Against `no_patch` and the patches, they split the patches' cost into the count's
    load, the loop with its loads, and the compares. "hidden" keeps the whole patch path, compares and
    selects included, but runs it with a count of 0 that the compiler cannot see (the count shifted right by
    31 bits): against the patches it tells the code's presence from its execution.

    `prefetch_slots` (P > 0, with the slot table): the step's count and its first P entries are loaded before
    the decode, and whether this thread holds each entry's row is worked out from them there, off the
    decode's path; after the decode each of those entries is one branch taken only by its row's threads,
    and only entries past the first P go through the loop (which loads each entry, then decides). The
    same selects on the same registers in the same order as the loop alone, so the same bits."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, scf
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    out_layout = plgpu.Layout.WGMMA if mma else dec_layout
    out = plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, layout=out_layout)
    if from_ref and (part is not None or shape != (BN, 64)):
        raise NotImplementedError(f"from_ref takes whole steps of 64, [{BN}, 64], got {shape}, part {part}")
    if half is not None and not (from_ref and arithmetic):
        raise NotImplementedError("half takes from_ref and the arithmetic decode")
    if prefetch_slots < 0 or (prefetch_slots and not use_slots):
        raise ValueError(f"prefetch_slots takes a count >= 0 of slot-table entries, with the slot table; got "
                         f"{prefetch_slots}, use_slots={use_slots}")
    if row_branch and not (use_slots and owner_branch):
        raise ValueError("row_branch takes the slot table with owner_branch")
    if patch_probe not in ("", "count", "entries", "hidden") or (patch_probe and not use_slots):
        raise ValueError(f"patch_probe takes 'count', 'entries' or 'hidden' with the slot table, got {patch_probe!r}, "
                         f"use_slots={use_slots}")
    if prefetch_slots >= SLOT_ALIGN:  # a row holds at least SLOT_ALIGN entries, the count included
        raise ValueError(f"prefetch_slots must be below {SLOT_ALIGN} (the least row of the slot table), got "
                         f"{prefetch_slots}")
    n_words = 4 if half is None else 2  # output words per register: both halves' two, or one half's
    planes_in = (plgpu.RefType(),) if from_ref else (dec_layout, dec_layout, dec_layout)
    arg_types = planes_in + (dec_layout,) + ((plgpu.RefType(),) if use_slots else ())

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=(out, out) if half is None else (out,))
    def decode(ctx, *args):
        del ctx
        if from_ref:
            tile_ref, base7, *slot = args
        else:
            s_lo, s_hi, nib, base7, *slot = args
        i32 = ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        pair = ir.VectorType.get((2,), ir.BF16Type.get())

        def word(reg):  # a vector of 4 int8 (or 1 of an int32 vector) as one 32-bit register
            ty = ir.VectorType(reg.type)
            if ir.IntegerType(ty.element_type).width == 32:
                return mgpu_utils.bitcast(mgpu_utils.vector_slice(reg, slice(0, 1)), i32)
            return mgpu_utils.bitcast(reg, i32)

        def asm(n_out, args, text):
            res = llvm.inline_asm(llvm.StructType.get_literal([i32] * n_out), args, text,
                                  ",".join(["=r"] * n_out + ["r"] * len(args)))
            return [llvm.extractvalue(i32, res, [q]) for q in range(n_out)]

        if part is not None:  # the part's column groups (dimension 1 of the upcast layout's registers)
            width = s_lo.shape[1]

            def cut(a):  # the registers of a tiled layout index its column tiles in order along dimension 1
                full_rs, part_rs = a.layout.registers_shape((shape[0], width)), a.layout.registers_shape(shape)
                assert [r for q, r in enumerate(full_rs) if q != 1] == [r for q, r in enumerate(part_rs) if q != 1]
                assert full_rs[1] == part_rs[1] * width // shape[1], (full_rs, part_rs)
                groups = part_rs[1]
                regs = a.registers[:, part * groups:(part + 1) * groups]
                out_ = mgpu.FragmentedArray(_registers=regs, _layout=a.layout, _is_signed=a.is_signed)
                assert out_.shape == tuple(shape), (out_.shape, shape)
                return out_

            s_lo, s_hi, nib = cut(s_lo), cut(s_hi), cut(nib)
        # the planes' layout (base7's, when the function loads them itself) and, per register, the (row,
        # column) of its first element
        lay = base7.layout if from_ref else s_lo.layout
        regs_shape = base7.registers.shape if from_ref else s_lo.registers.shape
        positions = ([tuple(arith.index_cast(i32, v) for v in rc) for rc in lay.thread_idxs(shape)]
                     if from_ref or use_slots else [])
        i64 = ir.IntegerType.get_signless(64)
        # per register, its row's static offset from the thread's first row (the layout's tile strides)
        strides = lay.tiling.tile_strides(tuple(mgpu_utils.get_contiguous_strides(shape)))
        row_offs = [sum(i * s for i, s in zip(idx, strides)) // shape[1] for idx in np.ndindex(regs_shape)]
        groups = [(off, [q for q, o in enumerate(row_offs) if o == off]) for off in sorted(set(row_offs))]
        if use_slots:
            (slot_ref,) = slot
            rows = mgpu_utils.c(0, i64)  # bit r set for each tile row r this thread holds
            for r, _ in positions:
                rows = arith.ori(rows, arith.shli(mgpu_utils.c(1, i64), arith.extui(i64, r)))

            def n_local_of(entry):  # the entry's row in the tile (bits 8-13)
                return arith.andi(arith.shrui(entry, mgpu_utils.c(8, i32)), mgpu_utils.c(BN - 1, i32))

            def held_by_me(entry):  # whether this thread holds the entry's row
                held = arith.andi(arith.shrui(rows, arith.extui(i64, n_local_of(entry))), mgpu_utils.c(1, i64))
                return arith.cmpi(arith.CmpIPredicate.ne, held, mgpu_utils.c(0, i64))

            # row_branch: the thread's first row (register 0's row less its static offset)
            row_first = arith.subi(positions[0][0], mgpu_utils.c(row_offs[0], i32))

            def group_conds(entry):  # per row group: whether the entry's row is that group's row here
                n_local = n_local_of(entry)
                return [arith.cmpi(arith.CmpIPredicate.eq, n_local, arith.addi(row_first, mgpu_utils.c(off, i32)))
                        for off, _ in groups]

            zero = arith.constant(index, 0)
            count = memref.load(slot_ref, [zero, zero])
            if patch_probe == "hidden":  # timing only: 0 for every count the table holds, unknown to the compiler
                count = arith.shrui(count, mgpu_utils.c(31, i32))

            def load_entry(e, skip=0):  # entry e (an i32 loop index) past the first `skip`; the count is first
                return memref.load(slot_ref, [zero, arith.addi(arith.index_cast(index, e),
                                                               arith.constant(index, 1 + skip))])

            # the first entries and whether each is this thread's, before the decode (rows are zero-padded
            # to SLOT_ALIGN entries, so these loads stay inside the row; an entry past the count is not taken)
            early = [memref.load(slot_ref, [zero, arith.constant(index, 1 + e)]) for e in range(prefetch_slots)]
            early_mine = []
            for e, entry in enumerate(early):
                valid = arith.cmpi(arith.CmpIPredicate.sgt, count, mgpu_utils.c(e, i32))
                if row_branch:
                    early_mine.append([arith.andi(valid, cond) for cond in group_conds(entry)])
                else:
                    early_mine.append(arith.andi(valid, held_by_me(entry)) if owner_branch else valid)
        if from_ref:  # the three planes' registers, loaded here from the chunk-ordered tile
            ptr = mgpu_utils.memref_ptr(tile_ref)
            i8 = ir.IntegerType.get_signless(8)
            loaded = []  # per register: [lo, hi, nib] words
            for r, c in positions:
                chunk = arith.shli(arith.andi(arith.shrui(r, mgpu_utils.c(1, i32)), mgpu_utils.c(3, i32)),
                                   mgpu_utils.c(4, i32))  # ((r // 2) % 4) * 16: `chunk_order`
                off = arith.addi(arith.muli(r, mgpu_utils.c(3 * shape[1], i32)), arith.xori(c, chunk))
                planes_q = range(3) if half is None else (half, 2)  # one half's: its plane and the nibbles
                loaded.append([llvm.load(i32, mgpu_utils.getelementptr(
                    ptr, [arith.addi(off, mgpu_utils.c(q * shape[1], i32))], i8), alignment=4) for q in planes_q])
        else:
            loaded = [[word(t.registers[idx]) for t in (s_lo, s_hi, nib)] for idx in np.ndindex(regs_shape)]
        words = []  # per register: [lo0, lo1, hi0, hi1] (one half: its two)
        text = decode2_ptx(half) if half is not None else _DECODE4_PTX if arithmetic else _LOAD_ONLY_PTX
        for q, idx in enumerate(np.ndindex(regs_shape)):
            words.append(asm(n_words, [*loaded[q], word(base7.registers[idx])], text))
        if use_slots:
            keys = []  # per register: row << 8 | first column (the half bit is added for the upper tile)
            for r, c in positions:
                c = arith.addi(c, mgpu_utils.c(col_offset, i32))  # the tile's first column in the table row
                keys.append(arith.ori(arith.shli(r, mgpu_utils.c(8, i32)), c))
            hi_bit = mgpu_utils.c(0x8000, i32)
            keys_hi = [arith.ori(k, hi_bit) for k in keys]
            key_sets = [keys, keys_hi] if half is None else [keys_hi if half else keys]
            flat = [w for ws in words for w in ws]

            def compare_all(entry, flat):  # every register against the entry; the match takes its value
                keyq, vv, m0, m1 = asm(4, [entry], _EXCEPTION_PTX)
                out = []
                for q in range(len(words)):
                    for h, ks in enumerate(key_sets):
                        w0, w1 = flat[n_words * q + 2 * h], flat[n_words * q + 2 * h + 1]
                        out += asm(2, [w0, w1, keyq, ks[q], vv, m0, m1], _PATCH_PTX)
                return out  # per register: lo0, lo1, hi0, hi1 (or one half's two), as `flat`

            def patch_if(cond, entry, flat):  # the entry's selects in the threads where cond holds
                branch = _if_else(scf, cond, [w.type for w in flat])
                with ir.InsertionPoint(branch.then_block):
                    scf.yield_(compare_all(entry, flat))
                with ir.InsertionPoint(branch.else_block):
                    scf.yield_(list(flat))
                return list(branch.results)

            def patch_rows(conds, entry, flat):  # row_branch: the entry's row group, then its K half
                for cond, (_, regs_q) in zip(conds, groups):
                    branch = _if_else(scf, cond, [w.type for w in flat])
                    with ir.InsertionPoint(branch.then_block):
                        keyq, vv, m0, m1 = asm(4, [entry], _EXCEPTION_PTX)

                        def patch_half(h, flat):  # the group's registers' words of key set h
                            out = list(flat)
                            for q in regs_q:
                                w = n_words * q + 2 * h
                                out[w:w + 2] = asm(2, [flat[w], flat[w + 1], keyq, key_sets[h][q], vv, m0, m1],
                                                   _PATCH_PTX)
                            return out

                        if len(key_sets) == 1:  # one K half's registers (`half`)
                            scf.yield_(patch_half(0, flat))
                        else:
                            upper = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(entry, hi_bit),
                                               mgpu_utils.c(0, i32))
                            inner = _if_else(scf, upper, [w.type for w in flat])
                            with ir.InsertionPoint(inner.then_block):
                                scf.yield_(patch_half(1, flat))
                            with ir.InsertionPoint(inner.else_block):
                                scf.yield_(patch_half(0, flat))
                            scf.yield_(list(inner.results))
                    with ir.InsertionPoint(branch.else_block):
                        scf.yield_(list(flat))
                    flat = list(branch.results)
                return flat

            def never(word, value):  # `word`, unless `value` is -1: a select that never fires here
                cond = arith.cmpi(arith.CmpIPredicate.eq, value, mgpu_utils.c(-1, i32))
                return arith.select(cond, arith.xori(word, mgpu_utils.c(1, i32)), word)

            if patch_probe == "count":  # timing only: the count's load on the path, nothing patched
                flat = [never(flat[0], count)] + flat[1:]
            elif patch_probe == "entries":  # timing only: the loop and its loads, every word carried, no compares
                @mgpu_utils.fori(count, flat)
                def probed(e, flat_):
                    return [never(flat_[0], load_entry(e))] + flat_[1:]

                flat = list(probed.results)
            else:
                for entry, mine in zip(early, early_mine):  # the prefetched entries, decided before the decode
                    flat = patch_rows(mine, entry, flat) if row_branch else patch_if(mine, entry, flat)
                # the rest (all of them without prefetch_slots), each loaded, then decided
                rest = (arith.maxsi(arith.subi(count, mgpu_utils.c(prefetch_slots, i32)), mgpu_utils.c(0, i32))
                        if prefetch_slots else count)

                @mgpu_utils.fori(rest, flat)
                def patched(e, flat):
                    entry = load_entry(e, prefetch_slots)
                    if not owner_branch:
                        return compare_all(entry, flat)
                    if row_branch:
                        return patch_rows(group_conds(entry), entry, flat)
                    # only the threads that hold the entry's row compare (4 lanes of one warp): the others
                    # skip the per-register work, so an exception costs the warpgroup a few instructions
                    return patch_if(held_by_me(entry), entry, flat)

                flat = list(patched.results)
            words = [flat[n_words * q:n_words * (q + 1)] for q in range(len(words))]

        def array(first):
            if mma:  # upcast register [.., g, .., h, ..] -> WGMMA registers [.., 2g, .., h, ..] and [.., 2g + 1, ..]
                wl = mgpu.WGMMA_LAYOUT
                regs = np.empty(wl.registers_shape(shape), dtype=object)
                # both register arrays vary only in dim 1 (column group) and dim 4 (row half): checked here
                assert regs_shape[1] * 2 == regs.shape[1] and regs_shape[4] == regs.shape[4] == 2
                assert np.prod(regs_shape) == regs_shape[1] * 2 and regs.size == regs.shape[1] * 2
                for q, idx in enumerate(np.ndindex(regs_shape)):
                    for e in (0, 1):
                        out_idx = [0] * regs.ndim
                        out_idx[1], out_idx[4] = 2 * idx[1] + e, idx[4]
                        regs[tuple(out_idx)] = mgpu_utils.bitcast(words[q][first + e], pair)
                return mgpu.FragmentedArray(_registers=regs, _layout=wl, _is_signed=None)
            regs = np.empty(regs_shape, dtype=object)
            for q, idx in enumerate(np.ndindex(regs_shape)):
                w0, w1 = words[q][first], words[q][first + 1]
                regs[idx] = mgpu_utils.vector_concat([mgpu_utils.bitcast(w0, pair), mgpu_utils.bitcast(w1, pair)])
            return mgpu.FragmentedArray(_registers=regs, _layout=lay, _is_signed=None)

        return (array(0), array(2)) if half is None else (array(0),)

    return decode


def w12_operand_names(planes: str, use_slots: bool) -> tuple[str, ...]:
    """The W12NK arrays a configuration passes to the kernel, in order: every operand costs host work at
    each launch (at the layer shapes the launch, not the kernel, set the wall time: docs/performance.md),
    so the nibble plane goes only with separate planes, and the CSR lists only without the slot table."""
    return (("planes",) + (("nib",) if planes != "packed" else ()) + ("base7",)
            + (("slots",) if use_slots else ("exc_ptr", "exc_row", "exc_col", "exc_val")))


def _kernel_call(x, operands, *, k: int, n: int, mp: int, block_k: int, split: int, stages: int, w12: bool,
                 fmt: dict, interpret: bool, use_slots: bool = False, diagnostic: str = "", planes: str = "upcast",
                 a_operand: str = "registers", decode: str = "jnp", fold_x: bool = False,
                 warp_specialized: bool = False, subtile: bool = False, mma: bool = False,
                 adjacent: bool = False, sum_splits_in_kernel: bool = False, tiled: bool = False,
                 early_base: bool = False, wide_swizzle: bool = False, plain_planes: bool = False,
                 owner_branch: bool = True, xor_chunks: bool = False, halves: bool = False,
                 auto_barriers: bool = True, prefetch_slots: int = 0, copy_steps: int = 1,
                 row_branch: bool = False, out_rows: bool = False):
    ws = warp_specialized
    # out_rows: the output is [S, Mp, N] (x's rows, each a contiguous row of N sums) instead of [S, N, Mp]:
    # each program stores its [64, Mp] sums transposed (the WGMMA_TRANSPOSED layout, whose register vectors
    # run along the 64 rows, into a transposed view of its [Mp, 64] block). The same sums, so the same bits;
    # the glue after the call then reads the real rows' contiguous sums instead of one float in every Mp.
    # sum_splits_in_kernel: programs of splits 0 .. S-2 store their partials to a workspace and signal their
    # column block's semaphore; the split S-1 program waits for them, adds the partials in index order with
    # its own last (`w12_matmul.sum_splits`'s order) and stores the sum: the output is [1, N, Mp].
    fixup = sum_splits_in_kernel and split > 1
    if sum_splits_in_kernel and ws:
        raise NotImplementedError("sum_splits_in_kernel is not implemented with warp_specialized")
    # subtile: each step's packed tiles are decoded and multiplied as block_k / 64 sub-steps of 64 half-rows
    # (the copies stay block_k wide); `mma_k` is the K width of one decode and one wgmma pair.
    mma_k = SWIZZLE_BF16 if subtile else block_k
    if subtile and not (w12 and planes == "packed" and fold_x and not ws and block_k % mma_k == 0):
        raise NotImplementedError("subtile takes W12 with packed planes and x folded, without warp_specialized")
    if tiled and (ws or (w12 and planes != "packed")):
        raise NotImplementedError("tiled weights are packed W12 planes or the twin's paired tiles, without "
                                  "warp_specialized")
    # early_base: the copy of the rows' bases is issued before the pipeline and waited for inside its first
    # step, so the pipeline's first copies do not wait for it; the bases are then read from shared memory
    # at each step (a few loads) instead of held in registers.
    if early_base and (ws or not w12):
        raise NotImplementedError("early_base takes W12 without warp_specialized")
    nwg = 2 if ws else 1  # consumer warpgroups per program, each over its own 64 W^T rows
    cta = BN * nwg  # W^T rows per program
    # halves: two warpgroups per program over the same 64 W^T rows, one per K half of every step (the step's
    # tiles hold both halves), each with its own accumulator; the first also issues the copies (`halves_body`).
    # At the end the first adds the second's accumulator to its own (lower + upper, in that order), so the
    # twin with `halves` gives the same bits. Twice the warps per program, the same programs and tiles.
    if halves and (ws or subtile or fixup or adjacent or diagnostic or not fold_x):
        raise NotImplementedError("halves takes x folded, without warp_specialized, subtile, adjacent, "
                                  "sum_splits_in_kernel or a diagnostic")
    if halves and w12 and not (planes == "packed" and tiled and xor_chunks and use_slots):
        raise NotImplementedError("halves takes W12 planes packed tiled in chunk order (to_nk(tiled=True, "
                                  "xor_chunks=True)) with the slot table")
    if halves and not w12 and not tiled:
        raise NotImplementedError("halves takes the twin's tiled weights (tile_twin)")
    if halves and x.shape[0] != mp:
        raise NotImplementedError(f"halves takes x padded to Mp = {mp} rows (pad_x=True), got {x.shape[0]}")
    per_wg = 2 if (ws or halves) else 1  # warpgroups that own scratch
    if ws and not (w12 and planes == "packed" and fold_x and n % cta == 0):
        raise NotImplementedError(f"warp_specialized takes W12 with packed planes, x folded and N % {cta} == 0")
    kh = k // 2
    if split < 1 or kh % (split * block_k):  # a split must cover whole steps, or the rows left over are dropped
        raise ValueError(f"split {split} does not divide the {kh // block_k} steps of {block_k} half-rows of a "
                         f"[{k}, {n}] weight into whole steps per program")
    steps = kh // split // block_k  # K steps per program (each covers block_k rows of both K halves)
    if copy_steps < 1:
        raise ValueError(f"copy_steps must be >= 1, got {copy_steps}")
    if steps % copy_steps:
        raise ValueError(f"copy_steps {copy_steps} does not divide the {steps} steps of each program")
    half_blocks = kh // block_k  # block index of the upper K half's first block
    mma_tiles = _transforms(16, SWIZZLE)  # bf16 tiles with 128-byte rows: x [Mp, BK] and the twin's W^T
    wgmma_layout = plgpu.Layout.WGMMA
    # The layout the decode runs in. "upcast": planes in swizzled tiles, loaded 4 bytes per thread in the
    # layout made for 8 -> 16-bit upcasts, decoded there, moved to the WGMMA layout by one warp shuffle per
    # register pair. "wgmma": plain tiles loaded straight into the WGMMA layout, 2 bytes per load.
    # "packed": the three plane tiles of a step side by side in one array (`W12NK.packed`), one copy per
    # step, swizzled and loaded as "upcast".
    dec_layout = wgmma_layout if planes == "wgmma" else plgpu.Layout.WGMMA_UPCAST_2X
    # wgmma's A operand: W12's decoded tiles from registers (default) or stored to shared memory; the twin's
    # bf16 tiles from shared memory (default) or loaded to registers. The interpreter has no register A.
    if a_operand not in ("registers", "smem"):
        raise ValueError(f"a_operand must be 'registers' or 'smem', got {a_operand!r}")
    a_in_registers = a_operand == "registers" and not interpret
    # auto_barriers=False (`unsafe_no_auto_barriers`): Pallas inserts no warpgroup barrier (bar.sync) around
    # each copy issue, `pl.when` or conditional fetch of the pipeline (about 7 per step). Its two conditions
    # hold here: no thread writes shared memory that it or another thread then reads (the tiles arrive by
    # TMA, the A operand is decoded into registers or read by wgmma from the copied tiles), and nothing is
    # read after a commit_smem. A slot is refilled only after the step's `wgmma_wait(0)` in the issuing
    # warp, and the warpgroup's wgmma completes only once all four warps issued it, after their decodes'
    # loads from that slot (the A registers depend on them) and with the B tile read: no read of the
    # slot is left when the refill starts. (That last step is a reading of wgmma's warpgroup-wide issue, not
    # a documented guarantee; the GPU test at the Qwen3 shapes, where a race between steps showed before,
    # checks it bit for bit against the twin.)
    if not auto_barriers and w12 and not interpret and not a_in_registers:
        raise NotImplementedError("auto_barriers=False takes W12's decoded tiles in registers (a_operand="
                                  "'registers'): stored to shared memory they would be written and read by "
                                  "the same threads")
    # wide_swizzle (with subtile): the plane tiles are copied with rows of block_k bytes and their swizzle
    # (128 at block_k 128: the copies' fastest, docs/performance.md), and each sub-step decodes its 64 columns
    # of them (the whole tile loaded, only that part's registers used); otherwise each sub-step's columns are
    # their own swizzled tile of mma_k bytes.
    if wide_swizzle and not (subtile and block_k <= SWIZZLE):
        raise NotImplementedError(f"wide_swizzle takes subtile and block_k <= {SWIZZLE}")
    # plain_planes: packed plane tiles copied as they are stored (one TMA box, neither tiled nor swizzled)
    # and loaded from there by plain (unoptimized) loads: the copies without the swizzle's constraints.
    if plain_planes and (planes != "packed" or wide_swizzle or 3 * block_k > 256):
        raise NotImplementedError("plain_planes takes packed planes of steps up to 85 half-rows (a TMA box row "
                                  "holds <= 256 bytes), without wide_swizzle")
    # xor_chunks: tiled planes stored in `chunk_order`, copied plain and loaded by the PTX decode itself
    # (`_ptx_decode(from_ref=True)`); the interpreter puts the bytes back in order with jnp.
    if xor_chunks and not (plain_planes and tiled and block_k == 64 and not subtile and not ws):
        raise NotImplementedError("xor_chunks planes are tiled steps of 64 copied plain (plain_planes), without "
                                  "subtile or warp_specialized")
    # copy_steps (c > 1): the pipeline copies c consecutive steps at once (their tiles are contiguous in tiled
    # planes: c * 12 KB in one copy; x's c folded tiles in one; the c slot rows as c copies) and the step body
    # decodes and multiplies them one after the other, in the same order as c single steps: the same bits,
    # with the same twin (whose steps stay single).
    if copy_steps > 1 and not (w12 and xor_chunks and fold_x and not (halves or ws or subtile or adjacent)):
        raise NotImplementedError("copy_steps takes W12 planes tiled in chunk order (to_nk(tiled=True, "
                                  "xor_chunks=True)) with x folded, without halves, warp_specialized, subtile or "
                                  "adjacent row blocks")
    plain = planes == "wgmma" or plain_planes
    plane_tiles = () if plain else _transforms(8, block_k if wide_swizzle else mma_k)

    def tile(ref, layout):  # the interpreter has no layouts; compiled, they are explicit
        if isinstance(ref, _Loaded):  # the interpreter's planes, put back in order already
            return ref.value
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout, optimized=not plain)

    def iota(dim):
        if interpret:
            return jax.lax.broadcasted_iota(jnp.int32, (BN, mma_k), dim)
        return plgpu.broadcasted_iota(jnp.int32, (BN, mma_k), dim, layout=dec_layout)

    if decode not in ("auto", "jnp", "ptx"):
        raise ValueError(f"decode must be 'auto', 'jnp' or 'ptx', got {decode!r}")
    ptx_decode, ptx_slots = None, False
    # diagnostic -> `_ptx_decode`'s patch_probe
    probes = {"patch_count": "count", "patch_entries": "entries", "patch_hidden": "hidden"}
    ptx_able = planes != "wgmma" and diagnostic in ("", "no_patch", "ptx_load_only", *probes)
    if decode == "ptx" and not ptx_able:
        raise NotImplementedError(f"decode='ptx' takes planes 'upcast' or 'packed' and diagnostic '', "
                                  f"'no_patch', 'ptx_load_only' or a patch probe ({', '.join(probes)}), got "
                                  f"{planes!r}, {diagnostic!r}")
    if diagnostic in probes and (interpret or decode == "jnp" or not w12 or not use_slots):
        raise ValueError(f"diagnostic={diagnostic!r} times the PTX decode's patch path: W12 with the slot table, "
                         f"compiled, decode 'auto'/'ptx'")
    if diagnostic == "ptx_load_only" and (interpret or decode == "jnp" or not w12):
        raise ValueError("diagnostic='ptx_load_only' times the PTX decode's loads: W12, compiled, decode 'auto'/'ptx'")
    if decode == "ptx" and interpret:
        raise ValueError("decode='ptx' runs only compiled for an NVIDIA GPU: the interpreter has no PTX")
    if decode != "jnp" and ptx_able and w12 and not interpret:
        ptx_slots = use_slots and diagnostic in ("", *probes)
        probe = probes.get(diagnostic, "")
        prefetch = prefetch_slots if ptx_slots and not probe else 0
        rows_ = row_branch and ptx_slots and owner_branch
        ptx_decode = [_ptx_decode(dec_layout, (BN, mma_k), ptx_slots, u * mma_k, mma,  # one per sub-step
                                  part=u if wide_swizzle else None, owner_branch=owner_branch,
                                  arithmetic=diagnostic != "ptx_load_only", from_ref=xor_chunks,
                                  prefetch_slots=prefetch, row_branch=rows_, patch_probe=probe)
                      for u in range(block_k // mma_k)]
    ptx_half = None
    if halves and ptx_decode is not None:  # one decode per K half, the warpgroup's own
        ptx_half = [_ptx_decode(dec_layout, (BN, mma_k), ptx_slots, 0, mma, owner_branch=owner_branch,
                                from_ref=True, half=h, prefetch_slots=prefetch, row_branch=rows_,
                                patch_probe=probe) for h in (0, 1)]
    if halves and w12 and not interpret and (ptx_half is None or not a_in_registers):
        raise NotImplementedError("halves decodes by PTX (decode='auto' or 'ptx') into registers when compiled")
    if xor_chunks and not interpret and ptx_decode is None and diagnostic != "copies_only":
        raise NotImplementedError("xor_chunks planes are loaded by the PTX decode when compiled (decode='auto' "
                                  "or 'ptx')")
    if wide_swizzle and not interpret and ptx_decode is None and diagnostic != "copies_only":
        raise NotImplementedError("wide_swizzle takes the PTX decode when compiled (decode='auto' or 'ptx')")
    if adjacent and w12 and not (planes == "packed" and (use_slots or diagnostic)):
        raise NotImplementedError("adjacent row blocks are packed W12 planes with slot-table exceptions")
    if mma:  # planes packed in `mma_order`
        if not (w12 and planes == "packed"):
            raise NotImplementedError("planes in mma order are packed W12 planes")
        if not use_slots and not diagnostic:
            raise NotImplementedError("planes in mma order take their exceptions from the slot table, not the CSR "
                                      "lists (exceptions='auto')")
        if not interpret and ptx_decode is None and diagnostic not in ("copies_only", "load_only"):
            raise NotImplementedError("planes in mma order take the PTX decode when compiled (decode='auto' or 'ptx')")

    names = w12_operand_names(planes, use_slots) if w12 else ()
    halves_scratch = []  # `halves_body`'s: x, weight and slot-row buffers per stage, their barriers, the upper sum
    if halves:
        w_buf = (plgpu.SMEM((stages, BN, 3 * block_k), jnp.int8) if w12
                 else plgpu.SMEM((stages, BN, 2 * block_k), jnp.bfloat16, transforms=mma_tiles))
        slot_buf = plgpu.SMEM((stages, 1, operands[-1].shape[1] if w12 else 1), jnp.int32)
        halves_scratch = [plgpu.SMEM((stages, mp, 2 * block_k), jnp.bfloat16, transforms=mma_tiles), w_buf,
                          slot_buf, plgpu.Barrier(num_arrivals=3 if w12 else 2, num_barriers=stages),
                          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                          plgpu.SMEM((BN, mp), jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=1)]

    def kernel(x_gmem, *refs):
        if halves:  # `halves_body`'s buffers and barriers, last
            refs, hrefs = refs[:-len(halves_scratch)], refs[-len(halves_scratch):]
        if w12:  # only the operands this configuration reads (`w12_operand_names`)
            g = dict(zip(names, refs))
            o_gmem, *scr = refs[len(names):]
            ws_gmem = scr.pop(0) if fixup else None
            bs, bar, *scr = scr
            sm_gmem, nib_gmem, base_gmem = g["planes"], g.get("nib"), g["base7"]
            ptr_gmem, row_gmem, col_gmem, val_gmem = (g.get(q) for q in ("exc_ptr", "exc_row", "exc_col", "exc_val"))
            slot_gmem = g.get("slots")
        else:
            w_gmem, o_gmem, *scr = refs
            ws_gmem = scr.pop(0) if fixup else None
        # one semaphore per column block, global: a scratch semaphore is the program's own (block scope),
        # so another program's signal would never reach it (the first GPU run hung)
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((n // cta,))) if fixup and not interpret else None
        j, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        wg = jax.lax.axis_index("wg") if (ws or halves) else 0  # this consumer's rows (halves: K half)
        first = si * steps  # this program's first K block (in each half)
        state = {}  # per consumer: its first W^T row, bases and positions (`setup`)

        def spec(shape, half, col_major, transforms=()):
            # a [shape] block of the lower (half 0) or upper (half 1) K half at pipeline step i
            def index(i):  # adjacent: the step's two row blocks follow each other
                kb = 2 * (first + i) + half if adjacent else half * half_blocks + first + i
                return (j, kb) if col_major else (0, kb)
            return plgpu.BlockSpec(shape, index, transforms=transforms)

        if fold_x:  # x arrives folded (`_fold_x`): one [Mp, 2 BK] copy per step, [lower half | upper half]
            x_specs = [plgpu.BlockSpec((mp, 2 * block_k * copy_steps), lambda i: (0, first // copy_steps + i),
                                       transforms=mma_tiles)]
        else:
            x_specs = [spec((mp, block_k), h, False, mma_tiles) for h in (0, 1)]
        def load_base7():  # the bases of this consumer's rows (base << 7), broadcast over a tile's columns
            base7 = jax.lax.broadcast_in_dim(tile(bs.at[0 if halves else wg], dec_layout.reduce(1)), (BN, mma_k),
                                             (0,))
            if not interpret:  # the broadcast's layout, named for the lowering
                base7 = plgpu.layout_cast(base7, dec_layout)
            return base7

        def setup():  # in each consumer, before its pipeline: the bases of its rows, positions for patches
            row0 = state["row0"] = j * cta + wg * BN
            if not w12:
                return
            plgpu.copy_gmem_to_smem(base_gmem.at[pl.ds(row0, BN)], bs.at[wg], bar.at[wg])
            if not early_base:
                plgpu.barrier_wait(bar.at[wg])
                state["base7"] = load_base7()
            state["n_iota"], state["k_iota"] = iota(0) + row0, iota(1)
            if use_slots:
                state["pos_lo"] = (iota(0) << 8) | state["k_iota"]  # an element's packed position in the table
                state["pos_hi"] = state["pos_lo"] | 0x8000

        if w12:
            if planes == "packed":  # one copy per step: [sm lower half | sm upper half | nibbles] per row
                # tiled: tile (j, kb) is the planes' block row j * half_blocks + kb (`tile_rows`); copy_steps
                # of them (contiguous) per copy
                index = ((lambda i: ((j * half_blocks + first) // copy_steps + i, 0)) if tiled
                         else (lambda i: (j, first + i)))
                w_specs = [plgpu.BlockSpec((copy_steps * cta, 3 * block_k), index, transforms=plane_tiles)]
                w_gmem_refs = (sm_gmem,)
            else:
                w_specs = [spec((BN, block_k), h, True, plane_tiles) for h in (0, 1, 0)]
                w_gmem_refs = (sm_gmem, sm_gmem, nib_gmem)
            if use_slots:  # the slot table's rows of this step (one per consumer), streamed like the planes;
                # with copy_steps, one copy per step of the copy (their rows are N / 64 apart)
                for v in range(copy_steps):
                    w_specs.append(plgpu.BlockSpec(
                        (nwg, slot_gmem.shape[1]),
                        lambda i, v=v: ((first + copy_steps * i + v) * (n // cta) + j, 0)))
                w_gmem_refs += (slot_gmem,) * copy_steps
        elif tiled:  # the twin's two tiles of a step side by side, contiguous (`tile_twin`): one copy
            w_specs = [plgpu.BlockSpec((BN, 2 * block_k), lambda i: (j * half_blocks + first + i, 0),
                                       transforms=mma_tiles)]
            w_gmem_refs = (w_gmem,)
        else:
            w_specs = [spec((BN, block_k), h, True, mma_tiles) for h in (0, 1)]
            w_gmem_refs = (w_gmem, w_gmem)

        def decode(k0, u, *tiles):  # sub-step u of the step starting at half-row k0 -> two A tiles
            base7 = load_base7() if early_base else state["base7"]
            k0 = k0 + u * mma_k  # the sub-step's first half-row
            if planes == "packed":
                pk = tiles[0].at[pl.ds(wg * BN, BN)] if ws else tiles[0]  # this consumer's rows
                if xor_chunks and interpret:  # the stored bytes, put back in order by jnp (no PTX here)
                    pk_all = xor_tile_chunks(pk[...])
                    s_lo, s_hi, nb = (_Loaded(pk_all[:, q * block_k:(q + 1) * block_k]) for q in range(3))
                elif xor_chunks:  # the PTX decode loads from the tile itself
                    s_lo = s_hi = nb = None
                elif wide_swizzle:  # whole tiles (a slice inside a swizzled row is refused); the sub-step's
                    s_lo, s_hi, nb = (pk.at[:, pl.ds(q * block_k, block_k)] for q in range(3))  # columns below
                else:
                    s_lo, s_hi, nb = (pk.at[:, pl.ds(q * block_k + u * mma_k, mma_k)] for q in range(3))
                slot = tiles[1:]
            else:
                s_lo, s_hi, nb, *slot = tiles
            slot = [t.at[pl.ds(wg, 1)] for t in slot] if ws else slot  # this consumer's row
            if ptx_decode is not None:  # registers decoded by PTX, slot-table patches included
                planes_ = [pk] if xor_chunks else [tile(t, dec_layout) for t in (s_lo, s_hi, nb)]
                lo, hi = ptx_decode[u](*planes_, base7, *(slot[:1] if ptx_slots else ()))
                if ptx_slots or diagnostic:
                    return finish(lo, hi, in_wgmma=mma)
                lo = jax.lax.bitcast_convert_type(lo, jnp.uint16)  # the CSR patches work on the bits
                hi = jax.lax.bitcast_convert_type(hi, jnp.uint16)
                return csr_patches(k0, lo, hi)
            def plane(ref):  # a plane tile's values for this sub-step (interpreter, or the jnp decode)
                a = tile(ref, dec_layout)
                return a[:, u * mma_k:(u + 1) * mma_k] if wide_swizzle else a

            if diagnostic != "copies_only":
                nib = plane(nb).astype(jnp.int32) & 0xFF  # & 0xFF: packed planes hold it as int8
            if diagnostic == "copies_only":  # timing only: the planes are copied in but never loaded
                lo = hi = base7 + k0
            elif diagnostic == "load_only":  # timing only: one op per weight instead of the decode, no patches
                lo = plane(s_lo).astype(jnp.int32) ^ nib
                hi = plane(s_hi).astype(jnp.int32) ^ nib
            else:
                lo = (plane(s_lo).astype(jnp.int32) & 0x807F) | (((nib & 0xF) << 7) + base7)
                hi = (plane(s_hi).astype(jnp.int32) & 0x807F) | (((nib >> 4) << 7) + base7)
            lo, hi = lo.astype(jnp.uint16), hi.astype(jnp.uint16)  # the bf16 bits, unsigned like exc_val
            if diagnostic:  # "no_patch", "load_only": exceptions left unpatched (exact only without any)
                return finish(lo, hi)
            if use_slots:
                def one_slot(e, carry):  # entry: bits << 16 | half << 15 | n_local << 8 | k_local
                    lo, hi = carry
                    entry = slot[0][0, 1 + e]
                    key, v = entry & 0xFFFF, ((entry >> 16) & 0xFFFF).astype(jnp.uint16)
                    off = u * mma_k  # the sub-step's first column in the step's table row
                    return (jnp.where(state["pos_lo"] + off == key, v, lo),
                            jnp.where(state["pos_hi"] + off == key, v, hi))

                lo, hi = jax.lax.fori_loop(0, slot[0][0, 0], one_slot, (lo, hi))
                return finish(lo, hi)

            return csr_patches(k0, lo, hi)

        def csr_patches(k0, lo, hi):
            def one(e, carry):  # an exception at W[r, c] is A[c - n0, r - k0] of its half's tile
                lo, hi = carry
                r, c, v = row_gmem[e], col_gmem[e], val_gmem[e]
                n_iota, k_iota = state["n_iota"], state["k_iota"]
                at = (n_iota == c) & (k_iota == r - k0)
                lo = jnp.where(at, v, lo)
                return lo, jnp.where((n_iota == c) & (k_iota == r - kh - k0), v, hi)

            g0 = k0 // fmt["group_k"]
            g1 = (k0 + mma_k + fmt["group_k"] - 1) // fmt["group_k"]
            for c in range(max(1, BN // fmt["group_n"])):  # static: the CSR column cells this block spans
                cell = (state["row0"] // fmt["group_n"] + c) * fmt["n_groups_k"]
                lo, hi = jax.lax.fori_loop(ptr_gmem[cell + g0], ptr_gmem[cell + g1], one, (lo, hi))
            return finish(lo, hi)

        def finish(lo, hi, in_wgmma=False):
            if lo.dtype != jnp.bfloat16:
                lo = jax.lax.bitcast_convert_type(lo, jnp.bfloat16)
                hi = jax.lax.bitcast_convert_type(hi, jnp.bfloat16)
            if interpret and mma:  # the tiles were decoded in stored (mma) order: back to the true order
                lo, hi = _unpermute_jnp(lo), _unpermute_jnp(hi)
            if not interpret and dec_layout != wgmma_layout and not in_wgmma:
                lo, hi = plgpu.layout_cast(lo, wgmma_layout), plgpu.layout_cast(hi, wgmma_layout)
            if a_in_registers:  # the decoded tile never touches shared memory
                return lo, hi
            a_lo, a_hi = scr[0].at[wg], scr[1].at[wg]  # stored with the swizzle wgmma reads (interpreter: always)
            a_lo[...] = lo
            a_hi[...] = hi
            return a_lo, a_hi

        def b_operand(x_tile, h):  # x [Mp, BK] -> B = x^T [BK, Mp], K-major
            if not interpret:
                return plgpu.transpose_ref(x_tile, (1, 0))
            xt = scr[-2 + h].at[wg]  # the interpreter has no transposed refs: a transposed copy
            xt[...] = x_tile[...].T
            return xt

        def step(acc, indices, *tiles):
            (i,) = indices
            for v, u in np.ndindex(copy_steps, block_k // mma_k):  # the copy's steps; sub-steps (subtile)
                if fold_x:
                    x0 = v * 2 * block_k  # the step's folded x tile in the copy's
                    x_lo, x_hi = (tiles[0].at[:, pl.ds(x0 + h * block_k + u * mma_k, mma_k)] for h in (0, 1))
                    w_tiles = tiles[1:]
                    if copy_steps > 1:  # the step's 64 plane rows, its slot row
                        w_tiles = [tiles[1].at[pl.ds(v * cta, cta)], tiles[2 + v]]
                else:
                    x_lo, x_hi, *w_tiles = tiles
                if tiled and not w12:  # the twin's paired tile: lower | upper
                    w_tiles = [w_tiles[0].at[:, pl.ds(h * block_k, block_k)] for h in (0, 1)]
                if early_base and u == 0 and v == 0:  # the bases' copy, issued before the pipeline, is waited
                    @pl.when(i == 0)  # for once
                    def _():
                        plgpu.barrier_wait(bar.at[wg])
                if w12:
                    a_lo, a_hi = decode((first + copy_steps * i + v) * block_k, u, *w_tiles)
                elif a_in_registers:  # a diagnostic twin: the bf16 tiles through registers, as W12's are
                    a_lo, a_hi = (plgpu.load(t, (), layout=wgmma_layout) for t in w_tiles)
                else:
                    a_lo, a_hi = w_tiles
                b_lo, b_hi = b_operand(x_lo, 0), b_operand(x_hi, 1)
                if w12 and not a_in_registers:
                    plgpu.commit_smem()
                plgpu.wgmma(acc, a_lo, b_lo)
                plgpu.wgmma(acc, a_hi, b_hi)
                plgpu.wgmma_wait(0)  # before the pipeline refills these buffers (or the next sub-step)

        def put(idx, rows, value):  # sums [64, Mp] of W^T rows `rows` into o_gmem[idx] (`out_rows`: transposed)
            if not out_rows:
                o_gmem[idx, rows, :] = value
            elif interpret:
                o_gmem[idx, :, rows] = value.T
            else:
                plgpu.transpose_ref(o_gmem.at[idx, :, rows], (1, 0))[...] = plgpu.layout_cast(
                    value, plgpu.Layout.WGMMA_TRANSPOSED)

        def store(acc):  # the program's partial, or (sum_splits_in_kernel) the column block's sum
            rows = pl.ds(state["row0"], BN)
            if not fixup:  # (one split: si = 0, the sum's own index)
                put(si, rows, acc[...])
                return

            @pl.when(si < split - 1)
            def _():
                ws_gmem[si, rows, :] = acc[...]
                if sem is not None:  # release: the partial's stores are ordered before the signal
                    plgpu.semaphore_signal(sem.at[j], 1, memory_scope="gpu")

            @pl.when(si == split - 1)  # launched after its column block's other splits, so never waits on
            def _():  # a program not yet running (the interpreter runs the grid in order: no semaphores)
                if sem is not None:
                    plgpu.semaphore_wait(sem.at[j], split - 1, memory_scope="gpu")

                def part(q):
                    ref = ws_gmem.at[q, rows, :]
                    return ref[...] if interpret else plgpu.load(ref, (), layout=wgmma_layout, optimized=False)

                total = part(0)
                for q in range(1, split - 1):
                    total = total + part(q)
                put(0, rows, total + acc[...])

        def halves_body():
            xb, wb, sb, full, cons, acc_s, done = hrefs
            n_cb = n // cta

            def issue(i, slot):  # step i's tiles into buffer slot (warpgroup 0)
                kb = first + i
                plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(0, mp), pl.ds(kb * 2 * block_k, 2 * block_k)],
                                        xb.at[slot], full.at[slot])
                rows = pl.ds((j * half_blocks + kb) * BN, BN)  # the step's tile (`tile_rows`, `tile_twin`)
                plgpu.copy_gmem_to_smem((sm_gmem if w12 else w_gmem).at[rows], wb.at[slot], full.at[slot])
                if w12:
                    plgpu.copy_gmem_to_smem(slot_gmem.at[pl.ds(kb * n_cb + j, 1)], sb.at[slot], full.at[slot])

            def consumer(h):  # warpgroup h: the K half h of every step
                state["row0"] = j * BN
                if w12:
                    if h == 0:  # the bases first, then the pipeline's first steps
                        plgpu.copy_gmem_to_smem(base_gmem.at[pl.ds(state["row0"], BN)], bs.at[0], bar.at[0])
                    state["n_iota"], state["k_iota"] = iota(0) + state["row0"], iota(1)
                    state["pos_lo"] = (iota(0) << 8) | state["k_iota"]
                    state["pos_hi"] = state["pos_lo"] | 0x8000
                if h == 0:
                    for i in range(min(stages, steps)):
                        issue(i, i)
                if w12:
                    plgpu.barrier_wait(bar.at[0])
                    if not early_base:
                        state["base7"] = load_base7()

                def scope(acc):
                    def body(i, carry):
                        slot = jax.lax.rem(i, stages)
                        plgpu.barrier_wait(full.at[slot])
                        x_half = xb.at[slot].at[:, pl.ds(h * block_k, block_k)]
                        if w12 and ptx_half is not None:
                            base7 = load_base7() if early_base else state["base7"]
                            (a,) = ptx_half[h](wb.at[slot], base7, *((sb.at[slot],) if ptx_slots else ()))
                            if not mma:
                                a = plgpu.layout_cast(a, wgmma_layout)
                        elif w12:  # the interpreter: both halves decoded, this one's taken
                            a = decode((first + i) * block_k, 0, wb.at[slot], sb.at[slot])[h]
                        else:
                            a = wb.at[slot].at[:, pl.ds(h * block_k, block_k)]
                            if a_in_registers:
                                a = plgpu.load(a, (), layout=wgmma_layout)
                        plgpu.wgmma(acc, a, b_operand(x_half, h))
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(cons.at[slot])
                        if h == 0:
                            @pl.when(i + stages < steps)
                            def _():  # both warpgroups are done with the slot: step i + stages into it
                                plgpu.barrier_wait(cons.at[slot])
                                issue(i + stages, slot)
                        return carry

                    jax.lax.fori_loop(0, steps, body, 0)
                    if h == 0:  # the last steps' releases, so that every phase of the barriers is waited for
                        for i in range(max(0, steps - stages), steps):
                            plgpu.barrier_wait(cons.at[i % stages])
                    if h == 1:  # the upper half's sum to the first warpgroup
                        acc_s[...] = acc[...]
                        plgpu.barrier_arrive(done.at[0])
                        return
                    plgpu.barrier_wait(done.at[0])
                    upper = acc_s[...] if interpret else plgpu.load(acc_s, (), layout=wgmma_layout, optimized=False)
                    put(si, pl.ds(state["row0"], BN), acc[...] + upper)

                pl.run_scoped(scope, plgpu.ACC((BN, mp), jnp.float32))

            for h in (0, 1):
                pl.when(wg == h)(functools.partial(consumer, h))

        gmem_refs = (*(x_gmem,) * len(x_specs), *w_gmem_refs)
        if halves:
            halves_body()
            return
        if not ws:
            setup()

            def scope(acc):
                plgpu.emit_pipeline(functools.partial(step, acc), grid=(steps // copy_steps,),
                                    in_specs=[*x_specs, *w_specs], max_concurrent_steps=stages)(*gmem_refs)
                store(acc)

            pl.run_scoped(scope, plgpu.ACC((BN, mp), jnp.float32))
            return

        # Warp-specialized: a third warpgroup issues every copy; the two consumers decode and multiply their
        # own 64 rows of each step's tiles (x's tile is shared), with no barrier between them and the copies.
        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=40, in_specs=[*x_specs, *w_specs], wg_axis="wg",
                num_compute_wgs=nwg, max_concurrent_steps=stages, compute_context=context)

        def ignore(*_, **__):
            return None

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(*gmem_refs),
                           collective_axes="wg")
        def _(allocs):
            def context(eval_pipeline):
                setup()

                def scope(acc):
                    eval_pipeline(acc)
                    store(acc)

                pl.run_scoped(scope, plgpu.ACC((BN, mp), jnp.float32))

            def body(indices, *tiles_and_acc):
                *tiles, acc = tiles_and_acc
                step(acc, indices, *tiles)
                return acc

            pipeline(body, context)(*gmem_refs, allocations=allocs)

    scratch = []  # per consumer warpgroup:
    if w12:  # the bases of its rows
        scratch = [plgpu.SMEM((nwg, BN), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=nwg)]
    if w12 and not a_in_registers:  # the decoded A tiles
        scratch += [plgpu.SMEM((per_wg, BN, mma_k), jnp.bfloat16, transforms=mma_tiles)] * 2
    if interpret:  # the interpreter has no transposed refs: transposed x tiles
        x_t = _transforms(16, 2 * mp) if mp >= 16 else ()  # rows of 16 bytes have no swizzle
        scratch += [plgpu.SMEM((per_wg, mma_k, mp), jnp.bfloat16, transforms=x_t)] * 2
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_arg = InterpretGPUParams()
    else:
        interpret_arg = None
    scratch += halves_scratch
    threads = (dict(num_threads=nwg + 1, thread_name="wg") if ws
               else dict(num_threads=2, thread_name="wg") if halves else {})
    out_type = jax.ShapeDtypeStruct((1 if fixup else split,) + ((mp, n) if out_rows else (n, mp)), jnp.float32)
    if fixup:  # the workspace of splits 0 .. S-2 (an output XLA allocates; discarded)
        out_type = (out_type, jax.ShapeDtypeStruct((split - 1, n, mp), jnp.float32))
    call = plgpu.kernel(kernel, out_type=out_type,
                        grid=(n // cta, split), grid_names=("n", "s"), scratch_types=scratch,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                                             unsafe_no_auto_barriers=not auto_barriers),
                        interpret=interpret_arg, **threads)
    out = call(x, *operands)
    return out[0] if fixup else out


def _fold_x(x_p: jax.Array, block_k: int) -> jax.Array:
    """[Mp, K] -> [Mp, K]: step i's x tiles of the lower and upper K half side by side, so the pipeline
    brings both with one copy (`fold_x`). A permutation of a few KB per call."""
    mp, k = x_p.shape
    return x_p.reshape(mp, 2, k // 2 // block_k, block_k).transpose(0, 2, 1, 3).reshape(mp, k)


def _prepare_x(x: jax.Array, k: int, n: int, block_k: int, mp: int | None = None, pad_x: bool = True,
               interpret: bool = False, fold: bool = False):
    """x [M, K] -> (x as the kernel reads it, M, Mp). Mp (the wgmma N) defaults to the least of MP_CHOICES
    that holds M; `mp` asks for another multiple of 8. `pad_x=False` (compiled only) passes x as it is, unpadded
    and unfolded: the x tiles' copies then overhang its M rows, and TMA fills the rows beyond them with zeros,
    so no per-call fusion makes a padded copy of x (the interpreter refuses such reads: it always pads). TMA
    takes fewer rows than its 8-row tiling or a multiple of 8, so other M are padded to the next multiple."""
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x {x.shape} does not match a [{k}, {n}] weight")
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the kernel multiplies bf16 activations, got {x.dtype}")
    m = x.shape[0]
    _check(k, n, m, block_k)
    if mp is None:
        mp = next(p for p in MP_CHOICES if p >= m)
    elif mp % 8 or not m <= mp <= MP_CHOICES[-1]:
        raise ValueError(f"mp = {mp} must be a multiple of 8 in [M, {MP_CHOICES[-1]}] (M = {m})")
    if block_k % SWIZZLE_BF16:  # both operands' tiles have rows of 128 bytes
        raise ValueError(f"block_k = {block_k} must be a multiple of {SWIZZLE_BF16}")
    if not pad_x and fold:
        raise NotImplementedError("pad_x=False reads x as it is: it takes fold_x=False or adjacent row blocks")
    if not pad_x and not interpret:  # TMA takes a row count below its 8-row tiling or a multiple of it
        return (x if m < 8 or m % 8 == 0 else jnp.pad(x, ((0, -m % 8), (0, 0)))), m, mp
    x_p = jnp.pad(x, ((0, mp - m), (0, 0)))
    return (_fold_x(x_p, block_k) if fold else x_p), m, mp


@functools.partial(jax.jit, static_argnames=("block_k", "split", "stages", "interpret", "exceptions", "diagnostic",
                                             "planes", "a_operand", "decode", "fold_x", "warp_specialized",
                                             "subtile", "raw", "mp", "pad_x", "sum_splits_in_kernel",
                                             "early_base", "wide_swizzle", "plain_planes", "owner_branch",
                                             "halves", "auto_barriers", "prefetch_slots", "copy_steps",
                                             "row_branch", "out_rows"))
def w12_mosaic_partials(x: jax.Array, w: W12NK, block_k: int | None = None, split: int | None = None,
                        stages: int | None = None,
                        interpret: bool = False, exceptions: str = "auto", diagnostic: str = "",
                        planes: str = "auto", a_operand: str = "registers", decode: str = "auto",
                        fold_x: bool = True, warp_specialized: bool = False, subtile: bool = False,
                        raw: bool = False, mp: int | None = None, pad_x: bool = True,
                        sum_splits_in_kernel: bool = False, early_base: bool = False,
                        wide_swizzle: bool = False, plain_planes: bool = False,
                        owner_branch: bool = True, halves: bool = False, auto_barriers: bool = True,
                        prefetch_slots: int = 0, copy_steps: int = 1, row_branch: bool = False,
                        out_rows: bool = False) -> jax.Array:
    """x [M, K] bf16 (M <= 64), W12NK [K, N] -> partial products [split, M, N] float32.

    block_k: the step `to_nk` packed the planes for (`w.slot_k`) by default; stages: `default_stages`.
    exceptions: "auto" patches from the slot table when `w.slot_k == block_k` (`to_nk(w, block_k)`), else
    from the CSR lists; "csr" always from the CSR lists. planes: "auto" (default: "packed" where `to_nk`
    packed them, else "upcast"), "upcast", "wgmma" or "packed" (see `_kernel_call`). a_operand: wgmma
    takes the decoded tile from "registers" (default) or "smem". decode: "auto" (default: PTX where it can
    run, the jnp decode in the interpreter, for "wgmma" planes and the diagnostics), "ptx" (`_ptx_decode`;
    compiled only) or "jnp" (element-wise). fold_x (default): x's two K-half tiles of a step in one copy.
    The defaults are the fastest measured on the H200 (docs/performance.md). warp_specialized
    (exact against the twin on the H200, but not faster: docs/performance.md): programs of two consumer warpgroups
    (128 W^T rows, x's tile shared) and a third that only issues the copies
    (`plgpu.emit_pipeline_warp_specialized`); packed planes, x folded, N % 128 == 0.
    diagnostic (timing only, inexact with exceptions): "no_patch" skips the patches, "load_only" also
    replaces the decode by one XOR per weight (the element-wise path), "ptx_load_only" keeps the PTX
    path's loads with one XOR per output word instead of its decode, "copies_only" streams the planes but
    never loads them (the A tile is a constant): the cost of the copies alone; "patch_count" and
    "patch_entries" keep the patch path's count load, and for the latter its loop and entry loads, without
    compares; "patch_hidden" keeps all of the patch path and runs it with a count of 0 the compiler cannot
    see (`_ptx_decode`'s patch_probe; W12 with the slot table, compiled).
    owner_branch (default; PTX decode with the slot table): an exception's compares run only in the threads
    that hold its row (`_ptx_decode`); off, every thread compares every register with every exception.
    subtile: a step of block_k > 64 half-rows is copied whole but decoded and multiplied as 64-row
    sub-steps (half the live registers at 128); its products are then those of the twin at block_k 64 with
    the same split (`default_split(k, n, block_k)`), bit for bit. Exact on the H200 but slower than the
    whole-step decode at every M measured (docs/performance.md), so off by default.
    wide_swizzle (with subtile): the step's plane tiles are copied with rows of block_k bytes and their
    swizzle (128 bytes at block_k 128, with which the copies alone ran 10% faster on the H200), and each
    sub-step decodes its 64 columns of them (PTX: only that part's registers). Exact on the H200 but not
    faster (docs/performance.md, ninth pass).
    plain_planes: the packed plane tiles are copied as stored, without the tiling and swizzle, and loaded
    by plain loads (bank conflicts allowed); with planes packed `tiled`, one contiguous copy per step
    (the runs' choice, `PLAIN_PLANES`). Steps of 64 only (a TMA box row holds <= 256 bytes).
    raw: the kernel's own output, [split, N, Mp] (rows padded to Mp), untransposed: `sum_rows` adds the
    splits there and transposes only the sum (one small fusion instead of a transpose of every split).
    out_rows: the kernel stores its sums row by row, [split, Mp, N] raw (`_kernel_call`): the same bits, and
    no transpose after the call.
    mp, pad_x: how x's rows are padded (`_prepare_x`).
    sum_splits_in_kernel: the kernel adds the splits itself (the last split's program waits on a semaphore
    for the others' partials, then adds them in index order, its own last: `sum_splits`'s order and bits)
    and returns one "split", [1, N, Mp] raw; no XLA sum follows. Not with warp_specialized.
    early_base: the rows' bases are copied alongside the pipeline's first steps instead of before them
    (`_kernel_call`). Planes packed `tiled` (`to_nk`) are read one contiguous tile per step.
    halves: two warpgroups per program, one per K half of every step, their sums added at the end (lower +
    upper); the twin with `halves` gives the same bits. Planes packed tiled in chunk order with the slot
    table, x folded and padded.
    auto_barriers=False: Pallas inserts no warpgroup barriers (`_kernel_call` says why that is safe here).
    row_branch (with owner_branch): an exception's owning thread branches on which of its two rows holds it,
    then on its K half, and compares only those 4 registers (`_ptx_decode`); the same selects, the same bits.
    prefetch_slots: the PTX decode loads each step's count and first entries of the slot table before
    decoding and decides there which threads patch them (`_ptx_decode`); the rest go through the loop.
    copy_steps: the pipeline copies that many consecutive steps at once (planes tiled in chunk order, x
    folded), decoded and multiplied one after the other: the same bits as single steps (`_kernel_call`)."""
    k, n = w.shape
    block_k = block_k or w.slot_k or default_block_k(k, n)
    if (exceptions not in ("auto", "csr")
            or diagnostic not in ("", "no_patch", "load_only", "ptx_load_only", "copies_only", "patch_count",
                                  "patch_entries", "patch_hidden")
            or planes not in ("auto", "upcast", "wgmma", "packed")):
        raise ValueError(f"unknown exceptions={exceptions!r}, diagnostic={diagnostic!r} or planes={planes!r}")
    x_p, m, mp = _prepare_x(x, k, n, block_k, mp, pad_x, interpret, fold=fold_x and not w.adjacent)
    stages = stages or default_stages(block_k, mp)
    packed_shape = (n * (k // 2 // block_k), 3 * block_k) if w.tiled else (n, 3 * k // 2)
    has_packed = w.slot_k == block_k and w.packed.shape == packed_shape
    if planes == "auto":
        planes = "packed" if has_packed else "upcast"
    if planes == "packed" and not has_packed:
        raise ValueError(f"planes='packed' needs planes packed for block_k={block_k} "
                         f"(to_nk(w, {block_k}, pack=True))")
    if planes != "packed" and w.sm_t.shape != (n, k):
        raise ValueError(f"planes={planes!r} needs separate planes; these were packed (to_nk(w, pack=False) "
                         f"keeps them)")
    # the same split with or without warp specialization (so the same twin): the consumers are as many
    split = split or default_split(k, n, block_k)
    if subtile and planes != "packed":
        raise NotImplementedError(f"subtile takes packed planes, got planes={planes!r}")
    fmt = dict(group_n=w.group_n, group_k=w.group_k, n_groups_k=w.n_groups_k)
    use_slots = exceptions == "auto" and w.slot_k == block_k
    arrays = dict(planes=w.packed if planes == "packed" else w.sm_t, nib=w.nib_t, base7=w.base7, exc_ptr=w.exc_ptr,
                  exc_row=w.exc_row, exc_col=w.exc_col, exc_val=w.exc_val, slots=w.slots)
    out = _kernel_call(x_p, tuple(arrays[q] for q in w12_operand_names(planes, use_slots)),
                       k=k, n=n, mp=mp, block_k=block_k, split=split, stages=stages, w12=True, fmt=fmt,
                       interpret=interpret, use_slots=use_slots,
                       diagnostic=diagnostic, planes=planes, a_operand=a_operand, decode=decode, fold_x=fold_x,
                       warp_specialized=warp_specialized, subtile=subtile, mma=w.mma_order and planes == "packed",
                       adjacent=w.adjacent, sum_splits_in_kernel=sum_splits_in_kernel,
                       tiled=w.tiled and planes == "packed", early_base=early_base, wide_swizzle=wide_swizzle,
                       plain_planes=plain_planes, owner_branch=owner_branch,
                       xor_chunks=w.xor_chunks and planes == "packed", halves=halves, auto_barriers=auto_barriers,
                       prefetch_slots=prefetch_slots, copy_steps=copy_steps, row_branch=row_branch,
                       out_rows=out_rows)
    return out if raw else _rows_of(out, m, out_rows)


@functools.partial(jax.jit, static_argnames=("block_k", "split", "stages", "interpret", "a_operand", "fold_x",
                                             "raw", "adjacent", "mp", "pad_x", "sum_splits_in_kernel",
                                             "tiled", "halves", "auto_barriers", "out_rows"))
def bf16_mosaic_partials(x: jax.Array, w_t: jax.Array, block_k: int | None = None, split: int | None = None,
                         stages: int | None = None, interpret: bool = False, a_operand: str = "smem",
                         fold_x: bool = True, raw: bool = False, adjacent: bool = False, mp: int | None = None,
                         pad_x: bool = True, sum_splits_in_kernel: bool = False, tiled: bool = False,
                         halves: bool = False, auto_barriers: bool = True, out_rows: bool = False) -> jax.Array:
    """The twin: the same kernel over the original bf16 weight, given transposed (w_t [N, K] = W^T, stored
    once like `to_nk`'s planes), its tiles streamed by the same pipeline straight to the same wgmma calls.
    block_k and stages default as W12's do for the same shape, so the defaults of the two pair up.
    adjacent: each step pairs two adjacent row blocks, as W12 planes packed with `to_nk(adjacent=True)` do
    (the twin of such a matrix); x is then read as it is. mp, pad_x, sum_splits_in_kernel: as W12's.
    tiled: w_t is `tile_twin(W^T, block_k, adjacent)`, [N / 64 * steps * 64, 2 block_k]: one contiguous
    copy per step (the twin of W12 planes packed `tiled`; the same products, bit for bit).
    halves: one warpgroup per K half, as W12's `halves` (tiled weights only). auto_barriers, out_rows: as
    W12's."""
    if tiled:  # the step is the tiles' width; N follows from x's K
        k = x.shape[-1]
        if block_k and w_t.shape[1] != 2 * block_k:
            raise ValueError(f"tiled twin weights {w_t.shape} were tiled for block_k = {w_t.shape[1] // 2}, "
                             f"not {block_k}")
        block_k = w_t.shape[1] // 2
        if k % (2 * block_k) or w_t.shape[0] % (k // 2 // block_k):
            raise ValueError(f"tiled twin weights {w_t.shape} do not match x's K = {k}")
        n = w_t.shape[0] // (k // 2 // block_k)
    else:
        n, k = w_t.shape
    block_k = block_k or default_block_k(k, n)
    if w_t.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the twin reads bf16 weights, got {w_t.dtype}")
    x_p, m, mp = _prepare_x(x, k, n, block_k, mp, pad_x, interpret, fold=fold_x and not adjacent)
    stages = stages or default_stages(block_k, mp)
    split = split or default_split(k, n, block_k)
    out = _kernel_call(x_p, (w_t,), k=k, n=n, mp=mp, block_k=block_k, split=split, stages=stages, w12=False,
                       fmt={}, interpret=interpret, a_operand=a_operand, fold_x=fold_x, adjacent=adjacent,
                       sum_splits_in_kernel=sum_splits_in_kernel, tiled=tiled, halves=halves,
                       auto_barriers=auto_barriers, out_rows=out_rows)
    return out if raw else _rows_of(out, m, out_rows)


def _rows_of(raw: jax.Array, m: int, out_rows: bool) -> jax.Array:
    """The kernel's raw output -> partials [split, m, N]."""
    return raw[:, :m] if out_rows else jnp.swapaxes(raw, 1, 2)[:, :m]


def sum_rows(raw: jax.Array, m: int, out_rows: bool = False) -> jax.Array:
    """[split, N, Mp] (`raw=True`) -> y [m, N] float32: the splits added in index order (as
    `w12_matmul.sum_splits`, so the same bits as summing the transposed partials), then transposed.
    `out_rows` (raw [split, Mp, N]): the real rows' splits added, nothing transposed."""
    if out_rows:
        return sum_splits(raw[:, :m])
    return sum_splits(raw)[:, :m].T
