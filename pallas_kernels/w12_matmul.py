"""Fused W12 decode + matmul at decode / verify shapes (M = 1..64 rows), Pallas Triton backend.

y[M, N] = x[M, K] @ W[K, N] with W stored as W12 (`specpilot.formats.w12`), float32 accumulation.

Design choices:
- One body, two weight loaders: `_w12_loader` decodes each weight tile in registers, the twin
  (`_bf16_kernel`) loads the same tile from the original bf16 matrix; both hand a bf16 [block_k, block_n]
  pair to `_matmul_body`, which owns the tiling and the accumulation order. The W12 path is lossless iff
  the two agree bit for bit, which the tests check (neither can agree with XLA's dot: different summation
  order). `w12_decode_tiles` writes the loader's tiles out, so tests check it on every bit pattern.
- Tensor cores for every M: x is padded to Mp = max(16, 2^ceil(log2 M)) rows (`tl.dot` wants >= 16) and the
  MMA does the multiply-adds, leaving the CUDA cores to decoding. Padded rows are never stored (masked
  store), so split-K partials cost M rows of traffic, not Mp.
- K is processed as two halves side by side (rows k and Kh + k), matching the nibble plane where those
  rows share a byte: a nibble tile gives both code tiles with one AND and one SHIFT, no interleave.
- Decode per weight: sign-extended `sm` & 0x807F (sign to bit 15, mantissa bits 0..6) OR (code + base) << 7.
  Compiled kernels run it as PTX on packed registers (`_DECODE_PTX`: PRMT with sign replication and
  byte-wise exponent adds, ~2.5 instructions per weight); interpret mode runs the same formula in jnp.
  Loads are plain uint8 / int8 tiles, contiguous along N.
- Register prefetch (`W12Blocks.prefetch`): a step's planes and CSR ranges are loaded during the previous
  step and carried through the K loop. Measured on the H200 (docs/performance.md), this overlap was the
  largest gain.
- Exceptions stay out of the decode: per step, scalar loads of the CSR offsets give this tile's
  exception range (~0.5 exceptions per 8192 weights on trained weights); each listed exception is one
  `where` over the half tile that holds it. No gather (unsupported in Triton-backend kernels). Measured,
  this patch loop is now the kernel's largest cost.
- Split-K as in `gemv.py`: each program writes its own partial [M, BN]; the XLA sum over splits is tiny.
  Grid programs never accumulate into a shared output (they run in parallel on the GPU).
- An M = 1 CUDA-core path (`path="gemv"`, FMA chains row by row, with its own twin) exists and is exact,
  but measured slower than the tensor-core kernel on the H200 (docs/w12.md), so "auto" does not pick it.
- Shapes the kernel cannot tile (odd K, N without a 16-wide power-of-two block, non-bf16 x) raise
  NotImplementedError inside, and `implementation="pallas"` falls back to the XLA path (decode + dot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gemv import NUM_SMS_H200, _largest_pow2_divisor, _pow2
from specpilot.formats.w12 import W12, decode_jnp

MIN_DOT = 16  # Triton's tl.dot wants every dimension >= 16


@dataclasses.dataclass(frozen=True)
class W12Blocks:
    block_n: int = 128  # output columns per program
    block_k: int = 32  # rows of EACH K half per loop step (a step covers 2 * block_k rows of W)
    split_k: int = 1  # programs along the half-K axis; (K / 2) / split_k must be a power of two
    block_m: int = 64  # activation rows per program (more rows -> more programs, each re-decoding)
    num_warps: int = 4
    num_stages: int = 3
    # load each step's weight tiles one step ahead into registers (carried through the K loop), so their
    # global loads are in flight while the previous tiles are decoded and multiplied
    prefetch: bool = True
    # how a step patches its exceptions: "loop" (the patch loop runs every step, over a possibly empty CSR
    # range) or "branch" (the loop sits behind a per-step branch on "this step lists any exception", so
    # steps without exceptions skip it). Same tiles either way.
    exceptions: str = "loop"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_blocks(k: int, n: int, target_programs: int = 2 * NUM_SMS_H200, m: int = 1) -> W12Blocks:
    """Blocks for a [K, N] weight: 128-wide column blocks, 32-row half-steps, and the smallest split of K
    that gives `target_programs` programs (more splits only add partial-sum traffic). For M > 32 (x padded
    to 64 rows) exceptions are patched behind a per-step branch: on the H200 that took W12 at M = 64 from
    82.2 to 67.9 us (gate/up) and 83.7 to 69.5 us (down); at M = 16 it was mixed (bench_w12, 2026-11-29,
    docs/performance.md)."""
    if k % 2:
        raise NotImplementedError(f"the W12 kernel needs an even K, got {k}")
    kh = k // 2
    block_n = _largest_pow2_divisor(n, 128)
    if block_n < MIN_DOT:
        raise NotImplementedError(f"N = {n} has no power-of-two block >= {MIN_DOT}")
    splits = [s for s in range(1, kh + 1) if kh % s == 0 and _pow2(kh // s) and kh // s >= MIN_DOT]
    if not splits:
        raise NotImplementedError(f"K / 2 = {kh} has no power-of-two split >= {MIN_DOT}")
    block_k = min(32, kh // splits[0])
    splits = [s for s in splits if kh // s >= block_k]
    split_k = next((s for s in splits if (n // block_n) * s >= target_programs), splits[-1])
    return W12Blocks(block_n=block_n, block_k=block_k, split_k=split_k,
                     exceptions="branch" if m > 32 else "loop")


def default_gemv_blocks(k: int, n: int, target_programs: int = 2 * NUM_SMS_H200) -> W12Blocks:
    """Blocks of the M = 1 GEMV path: up to 1024 columns (one row of them per load), 8 half-rows per
    loop step (16 rows of W), and the smallest split of K that gives `target_programs` programs."""
    if k % 2:
        raise NotImplementedError(f"the W12 kernel needs an even K, got {k}")
    kh = k // 2
    block_n = _largest_pow2_divisor(n, 1024)
    splits = [s for s in range(1, kh + 1) if kh % s == 0 and _pow2(kh // s)]
    if block_n < 16 or not splits:
        raise NotImplementedError(f"the W12 GEMV cannot tile a [{k}, {n}] weight")
    block_k = min(8, kh // splits[0])
    splits = [s for s in splits if kh // s >= block_k]
    split_k = next((s for s in splits if (n // block_n) * s >= target_programs), splits[-1])
    return W12Blocks(block_n=block_n, block_k=block_k, split_k=split_k, num_stages=4)


def _tiles(k: int, n: int, b: W12Blocks) -> bool:
    """Even K, block_n | N, (K/2)/split_k a power of two divisible by block_k, power-of-two blocks."""
    kh, s = k // 2, b.split_k
    return (k % 2 == 0 and n % b.block_n == 0 and kh % s == 0 and _pow2(kh // s) and _pow2(b.block_n)
            and _pow2(b.block_k) and (kh // s) % b.block_k == 0)


def check_gemv_blocks(k: int, n: int, b: W12Blocks) -> None:
    if not _tiles(k, n, b):
        raise ValueError(f"GEMV blocks {b} do not tile a [{k}, {n}] weight")


def check_blocks(k: int, n: int, b: W12Blocks) -> None:
    if b.exceptions not in ("loop", "branch"):
        raise ValueError(f"exceptions must be 'loop' or 'branch', got {b.exceptions!r}")
    ok = _tiles(k, n, b) and _pow2(b.block_m) and min(b.block_n, b.block_k, b.block_m) >= MIN_DOT
    if not ok:
        raise ValueError(f"blocks {b} do not tile a [{k}, {n}] weight: need even K, powers of two >= "
                         f"{MIN_DOT}, block_n | N, (K/2)/split_k a power of two divisible by block_k")


# ---- kernel bodies ---------------------------------------------------------------------------------

def _matmul_body(x_lo_ref, x_hi_ref, o_ref, fetch, decode, *, block_k: int, m: int, swapped: bool = False,
                 prefetch: bool = True):
    # x_lo_ref, x_hi_ref: [BM, KS] this split's columns of the lower / upper K half of x ([KS, BM], x
    # transposed, when `swapped`); o_ref: [BM, BN] this split's partial product; fetch(k0) -> the raw
    # weight tiles of the step starting at half-row k0; decode(raw, k0) -> two bf16 [block_k, BN] tiles.
    # swapped: y^T = W^T x^T, so the decoded weight tile is the MMA's first operand (which the tensor
    # cores can take from registers; the second must sit in shared memory) and x's few rows are its
    # narrow N dimension.
    # prefetch: step i's tiles were fetched during step i - 1 (register double buffering); the loop then
    # carries raw tiles, and the last step fetches its own tiles again (in range, unused).
    if swapped:
        ks, block_m = x_lo_ref.shape
    else:
        block_m, ks = x_lo_ref.shape
    steps = ks // block_k

    def mma(acc, k0, w_lo, w_hi):
        if swapped:
            acc = acc + jnp.dot(w_lo.T, x_lo_ref[pl.ds(k0, block_k), :], preferred_element_type=jnp.float32)
            return acc + jnp.dot(w_hi.T, x_hi_ref[pl.ds(k0, block_k), :], preferred_element_type=jnp.float32)
        acc = acc + jnp.dot(x_lo_ref[:, pl.ds(k0, block_k)], w_lo, preferred_element_type=jnp.float32)
        return acc + jnp.dot(x_hi_ref[:, pl.ds(k0, block_k)], w_hi, preferred_element_type=jnp.float32)

    shape = o_ref.shape[::-1] if swapped else o_ref.shape
    acc = jnp.zeros(shape, jnp.float32)
    if prefetch:
        def step(i, carry):
            acc, raw = carry
            k0 = pl.multiple_of(i * block_k, block_k)
            nxt = fetch(pl.multiple_of(jnp.minimum(i + 1, steps - 1) * block_k, block_k))
            return mma(acc, k0, *decode(raw, k0)), nxt

        acc, _ = jax.lax.fori_loop(0, steps, step, (acc, fetch(0)))
    else:
        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            return mma(acc, k0, *decode(fetch(k0), k0))

        acc = jax.lax.fori_loop(0, steps, step, acc)
    if swapped:
        acc = acc.T
    rows = pl.program_id(2) * block_m + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    plt.store(o_ref, acc, mask=rows < m)  # x's padding rows are never written


def _bf16_kernel(x_lo_ref, x_hi_ref, w_lo_ref, w_hi_ref, o_ref, *, block_k: int, m: int, swapped: bool,
                 prefetch: bool):
    # w_lo_ref, w_hi_ref: [KS, BN] bf16, rows of the lower / upper K half
    def fetch(k0):
        return w_lo_ref[pl.ds(k0, block_k), :], w_hi_ref[pl.ds(k0, block_k), :]

    _matmul_body(x_lo_ref, x_hi_ref, o_ref, fetch, lambda raw, k0: raw, block_k=block_k, m=m, swapped=swapped,
                 prefetch=prefetch)


def _as_bf16(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


# Decode of 4 weights per instance in PTX, on packed registers: $2 holds four sign|mantissa bytes, $3 four
# nibble bytes, $4 four base bytes; $0, $1 receive the four bf16 bit patterns, two per register. Per byte,
# code + base <= 255 (bases <= 240), so the four exponent sums never carry into each other. PRMT with the
# sign-replicate selector (bit 3 of a selector nibble) turns two bytes into two sign-extended 16-bit
# halves in one instruction, and a second PRMT spreads two exponent bytes into the halves: about 2.5
# instructions per weight, against byte extraction, widening and re-packing of every element in the
# elementwise form. `{codes}` takes the nibble plane's low (lower K half) or high (upper half) codes.
_DECODE_PTX = """{{
.reg .b32 z, t, p, e;
mov.b32 z, 0;
{codes}
and.b32 t, t, 0x0F0F0F0F;
add.u32 t, t, $4;
prmt.b32 p, $2, z, 0x9180;
prmt.b32 e, t, z, 0x4140;
shl.b32 e, e, 7;
and.b32 p, p, 0x807F807F;
or.b32 $0, p, e;
prmt.b32 p, $2, z, 0xB3A2;
prmt.b32 e, t, z, 0x4342;
shl.b32 e, e, 7;
and.b32 p, p, 0x807F807F;
or.b32 $1, p, e;
}}"""
_DECODE_PTX_LO = _DECODE_PTX.format(codes="mov.b32 t, $3;")
_DECODE_PTX_HI = _DECODE_PTX.format(codes="shr.u32 t, $3, 4;")

DECODES = ("auto", "asm", "jnp")


@functools.cache
def _rocm() -> bool:
    """Whether the default backend is a ROCm GPU (PTX does not assemble there)."""
    try:
        client = jax.devices()[0].client
        return "rocm" in f"{client.platform} {client.platform_version}".lower()
    except Exception:  # noqa: BLE001 - no usable backend description: not ROCm
        return False


def _use_asm(decode: str, interpret: bool) -> bool:
    """"auto": the PTX decode when compiled for an NVIDIA GPU, the elementwise jnp decode in interpret mode
    (which cannot run PTX) and on ROCm. Both give the same bits (tests: every bit pattern through each)."""
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    if decode == "asm" and (interpret or _rocm()):
        raise ValueError("decode='asm' is PTX: it runs only compiled for an NVIDIA GPU, not in interpret mode "
                         "or on ROCm")
    return decode == "asm" or (decode == "auto" and not interpret and not _rocm())


def _decode_asm(sm, nib, base, ptx: str):
    """int8 sm / uint8 nib [BK, BN] and base [1, BN] -> int16 [BK, BN] bf16 bits, via `ptx`. (One result
    per call: Pallas' Triton lowering of multi-result inline asm returns a single value.)"""
    base = jnp.broadcast_to(base, nib.shape)
    [bits] = plt.elementwise_inline_asm(ptx, args=[sm, nib, base], constraints="=r,=r,r,r,r", pack=4,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(nib.shape, jnp.int16)])
    return bits


def _w12_loader(sm_lo_ref, sm_hi_ref, nib_ref, base_ref, ptr_ref, row_ref, col_ref, val_ref, *,
                block_k: int, k_half: int, group_n: int, group_k: int, n_groups_k: int,
                asm: bool = False, diagnostic_load_only: bool = False, patch_exceptions: bool = True,
                patch_branch: bool = False):
    # sm_lo_ref, sm_hi_ref: [KS, BN] int8 sign|mantissa of the lower / upper K half
    # nib_ref: [KS, BN] uint8 codes (low nibble: lower half, high nibble: upper half); base_ref: [1, BN]
    # ptr_ref: [n_cb * n_g + 1] int32 CSR offsets; row_ref, col_ref: [E] int32; val_ref: [E] uint16
    # asm: decode with `_DECODE_PTX` (compiled GPU kernels) instead of elementwise jnp (any backend)
    j, s = pl.program_id(0), pl.program_id(1)
    ks, block_n = nib_ref.shape
    base = base_ref[...]  # [1, BN], once per program
    base7 = base.astype(jnp.int32) << 7
    cols = j * block_n + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    tile_rows = jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)

    def ranges(k0):
        # The CSR ranges listing this step's exceptions, one (start, stop) per column cell the tile spans
        # (static). Rows are global, so a superset range is harmless: the CSR cells (group_n columns x
        # group_k paired rows) need not match the kernel's blocks. Fetched with the planes, so that with
        # `prefetch` the scalar loads are in flight a step early too.
        row0 = s * ks + k0
        g0, g1 = row0 // group_k, (row0 + block_k + group_k - 1) // group_k
        cells = [((j * block_n) // group_n + c) * n_groups_k for c in range(max(1, block_n // group_n))]
        return tuple((ptr_ref[cell + g0], ptr_ref[cell + g1]) for cell in cells)

    def patch(row0, lo, hi, bounds):
        # Overwrite this tile's exceptions (lo, hi: integer bit tiles); each one touches only the half
        # (lower or upper K rows) that holds it.
        rows_lo = row0 + tile_rows  # [BK, 1] global rows of the lower-half tile

        def one(e, carry):
            r, c = row_ref[e], col_ref[e]
            # the tiles hold int16 bits after the PTX decode, int32 after the jnp one
            v = jax.lax.bitcast_convert_type(val_ref[e], jnp.int16) if asm else val_ref[e].astype(jnp.int32)
            at_col = cols == c

            def in_lo(lo, hi):
                return jnp.where((rows_lo == r) & at_col, v, lo), hi

            def in_hi(lo, hi):
                return lo, jnp.where((rows_lo + k_half == r) & at_col, v, hi)

            return jax.lax.cond(r < k_half, in_lo, in_hi, *carry)

        for start, stop in bounds:
            lo, hi = jax.lax.fori_loop(start, stop, one, (lo, hi))
        return lo, hi

    def fetch(k0):  # one step's raw planes (two int8 sign|mantissa tiles, the nibble tile), CSR ranges
        rows = pl.ds(k0, block_k)
        return sm_lo_ref[rows, :], sm_hi_ref[rows, :], nib_ref[rows, :], ranges(k0)

    def decode(raw, k0):
        sm_lo, sm_hi, nib, bounds = raw
        if diagnostic_load_only:  # benchmark only, wrong values: the planes' loads with one op per weight
            nib = nib.astype(jnp.int32)
            return _as_bf16(sm_lo.astype(jnp.int32) ^ nib), _as_bf16(sm_hi.astype(jnp.int32) ^ nib)
        if asm:
            lo = _decode_asm(sm_lo, nib, base, _DECODE_PTX_LO)
            hi = _decode_asm(sm_hi, nib, base, _DECODE_PTX_HI)
        else:
            nib = nib.astype(jnp.int32)  # zero-extended; int8 -> int32 sign-extends: bit 15 is the sign
            lo = (sm_lo.astype(jnp.int32) & 0x807F) | (((nib & 0xF) << 7) + base7)
            hi = (sm_hi.astype(jnp.int32) & 0x807F) | (((nib >> 4) << 7) + base7)
        if patch_exceptions and patch_branch:  # W12Blocks.exceptions == "branch"
            listed = sum(stop - start for start, stop in bounds)
            lo, hi = jax.lax.cond(listed > 0, lambda lo, hi: patch(s * ks + k0, lo, hi, bounds),
                                  lambda lo, hi: (lo, hi), lo, hi)
        elif patch_exceptions:  # compiled in even for matrices without exceptions (see _w12_operands)
            lo, hi = patch(s * ks + k0, lo, hi, bounds)
        if asm:
            return jax.lax.bitcast_convert_type(lo, jnp.bfloat16), jax.lax.bitcast_convert_type(hi, jnp.bfloat16)
        return _as_bf16(lo), _as_bf16(hi)

    return fetch, decode


def _w12_kernel(x_lo_ref, x_hi_ref, *refs, block_k: int, m: int, swapped: bool, prefetch: bool, **fmt):
    # refs: the 8 W12 refs of `_w12_loader`, then o_ref [BM, BN]
    *w_refs, o_ref = refs
    fetch, decode = _w12_loader(*w_refs, block_k=block_k, **fmt)
    _matmul_body(x_lo_ref, x_hi_ref, o_ref, fetch, decode, block_k=block_k, m=m, swapped=swapped,
                 prefetch=prefetch)


def _w12_decode_kernel(*refs, block_k: int, **fmt):
    # refs: the 8 W12 refs, then o_lo_ref, o_hi_ref: [KS, BN] uint16, the bits of the matmul kernel's
    # tiles (stored as integers: XLA:CPU, running interpret mode, canonicalizes NaN payloads of bf16)
    *w_refs, o_lo_ref, o_hi_ref = refs
    fetch, decode = _w12_loader(*w_refs, block_k=block_k, **fmt)

    def step(i, carry):
        k0 = pl.multiple_of(i * block_k, block_k)
        lo, hi = decode(fetch(k0), k0)
        o_lo_ref[pl.ds(k0, block_k), :] = jax.lax.bitcast_convert_type(lo, jnp.uint16)
        o_hi_ref[pl.ds(k0, block_k), :] = jax.lax.bitcast_convert_type(hi, jnp.uint16)
        return carry

    jax.lax.fori_loop(0, o_lo_ref.shape[0] // block_k, step, 0)


# ---- M = 1: CUDA-core GEMV bodies (no tensor cores) ----------------------------------------------------
# Rows of W are taken one at a time, each a [1, BN] vector, and every output column's sum is one chain of
# FMAs in row order (lower-half row k, then upper-half row Kh + k, then k + 1, ...). No reduction across
# threads, so the summation order is the same whatever layout the compiler gives each load: the W12 path
# and its twin agree bit for bit by construction (a bf16 x bf16 product is exact in float32).

_SIGN_MANT_F32 = np.uint32(0x807F0000).view(np.int32)  # sign bit and the 7 mantissa bits of a bf16 in f32


def _gemv_body(x_lo_ref, x_hi_ref, o_ref, load_rows, *, block_k: int):
    # x_lo_ref, x_hi_ref: [KS, 1] bf16, this split's rows of the lower / upper K half of x (transposed);
    # o_ref: [1, BN] this split's partial row; load_rows(k0) -> block_k pairs of float32 [1, BN] rows.
    ks = x_lo_ref.shape[0]

    def step(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        for r, (w_lo, w_hi) in enumerate(load_rows(k0)):  # static: block_k rows per loop step
            acc = acc + x_lo_ref[pl.ds(k0 + r, 1), :].astype(jnp.float32) * w_lo
            acc = acc + x_hi_ref[pl.ds(k0 + r, 1), :].astype(jnp.float32) * w_hi
        return acc

    o_ref[...] = jax.lax.fori_loop(0, ks // block_k, step, jnp.zeros(o_ref.shape, jnp.float32))


def _bf16_gemv_kernel(x_lo_ref, x_hi_ref, w_lo_ref, w_hi_ref, o_ref, *, block_k: int):
    def load_rows(k0):  # bf16 -> float32 is exact
        return [(w_lo_ref[pl.ds(k0 + r, 1), :].astype(jnp.float32),
                 w_hi_ref[pl.ds(k0 + r, 1), :].astype(jnp.float32)) for r in range(block_k)]

    _gemv_body(x_lo_ref, x_hi_ref, o_ref, load_rows, block_k=block_k)


def _w12_gemv_kernel(x_lo_ref, x_hi_ref, sm_lo_ref, sm_hi_ref, nib_ref, base_ref, ptr_ref, row_ref, col_ref,
                     val_ref, o_ref, *, block_k: int, k_half: int, group_n: int, group_k: int,
                     n_groups_k: int):
    # Decodes straight to float32 bits: sext(sm) << 16 puts the sign at bit 31 and the mantissa at bits
    # 16..22; the exponent is (code + base) << 23. Exceptions patch the float32 bits (val << 16), in a
    # branch taken only by steps whose CSR cells list any.
    j, s = pl.program_id(0), pl.program_id(1)
    ks, block_n = nib_ref.shape
    base23 = base_ref[...].astype(jnp.int32) << 23  # [1, BN]
    cols = j * block_n + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    cells = [((j * block_n) // group_n + c) * n_groups_k for c in range(max(1, block_n // group_n))]

    def decode(k0):
        out = []
        for r in range(block_k):
            nib = nib_ref[pl.ds(k0 + r, 1), :].astype(jnp.int32)
            lo = ((sm_lo_ref[pl.ds(k0 + r, 1), :].astype(jnp.int32) << 16) & _SIGN_MANT_F32) | (
                ((nib & 0xF) << 23) + base23)
            hi = ((sm_hi_ref[pl.ds(k0 + r, 1), :].astype(jnp.int32) << 16) & _SIGN_MANT_F32) | (
                ((nib >> 4) << 23) + base23)
            out += [lo, hi]
        return out

    def load_rows(k0):
        row0 = s * ks + k0  # global half-row of this step's first row
        g0, g1 = row0 // group_k, (row0 + block_k + group_k - 1) // group_k
        count = sum(ptr_ref[c + g1] - ptr_ref[c + g0] for c in cells)
        rows = decode(k0)

        def patch(rows):
            rows = list(rows)
            for c in cells:
                def one(e, rows):
                    r, col, v = row_ref[e], col_ref[e], val_ref[e].astype(jnp.int32) << 16
                    at_col = cols == col
                    return tuple(jnp.where((r == row0 + i // 2 + (i % 2) * k_half) & at_col, v, x)
                                 for i, x in enumerate(rows))
                rows = list(jax.lax.fori_loop(ptr_ref[c + g0], ptr_ref[c + g1], one, tuple(rows)))
            return tuple(rows)

        rows = jax.lax.cond(count > 0, patch, lambda rows: tuple(rows), tuple(rows))
        f32 = [jax.lax.bitcast_convert_type(x, jnp.float32) for x in rows]
        return list(zip(f32[0::2], f32[1::2]))

    _gemv_body(x_lo_ref, x_hi_ref, o_ref, load_rows, block_k=block_k)


# ---- pallas_call wrappers ------------------------------------------------------------------------------

def _setup(x: jax.Array, k: int, n: int, blocks: W12Blocks | None, swapped: bool = False):
    """Validate and pad x to Mp rows (transposed to [K, Mp] when `swapped`); returns (x operand, blocks,
    x's two BlockSpecs, shared call kwargs)."""
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x {x.shape} does not match a [{k}, {n}] weight")
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the kernel multiplies bf16 activations, got {x.dtype}")
    m = x.shape[0]
    b = blocks or default_blocks(k, n, m=m)
    check_blocks(k, n, b)
    mp = max(MIN_DOT, _next_pow2(m))
    bm = min(mp, b.block_m)
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
    s, ks = b.split_k, k // 2 // b.split_k
    grid = (n // b.block_n, s, mp // bm)
    x_specs = [pl.BlockSpec((bm, ks), lambda j, si, mi: (mi, si)),
               pl.BlockSpec((bm, ks), lambda j, si, mi: (mi, s + si))]
    if swapped:
        x = x.T
        x_specs = [pl.BlockSpec((ks, bm), lambda j, si, mi: (si, mi)),
                   pl.BlockSpec((ks, bm), lambda j, si, mi: (s + si, mi))]
    common = dict(
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((s, mp, n), jnp.float32),
        out_specs=pl.BlockSpec((None, bm, b.block_n), lambda j, si, mi: (si, mi, j)),
        compiler_params=plt.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
    )
    return x, b, x_specs, common


def _half_specs(b: W12Blocks, ks: int):
    """Lower / upper K-half row blocks of a [K, N] plane, on a grid (j, si, ...)."""
    return [pl.BlockSpec((ks, b.block_n), lambda j, si, *_: (si, j)),
            pl.BlockSpec((ks, b.block_n), lambda j, si, *_: (b.split_k + si, j))]


def _whole(a) -> pl.BlockSpec:
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def no_exception_lists() -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows, cols, bits) standing for no exceptions: one sentinel at row -1, which matches nothing."""
    return jnp.full((1,), -1, jnp.int32), jnp.full((1,), -1, jnp.int32), jnp.zeros((1,), jnp.uint16)


def exception_lists(w: W12) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows, cols, bits) of the exceptions as kernel operands: zero-size operands do not lower, so a
    matrix without exceptions gets `no_exception_lists`."""
    if w.num_exceptions == 0:
        return no_exception_lists()
    return w.exc_row, w.exc_col, w.exc_val


def _w12_operands(w: W12, b: W12Blocks):
    """(in_specs, operands, format kwargs) for the 8 W12 refs of `_w12_loader`, on a grid (j, si, ...)."""
    k, n = w.shape
    ks = k // 2 // b.split_k
    exc = exception_lists(w)
    specs = [*_half_specs(b, ks), pl.BlockSpec((ks, b.block_n), lambda j, si, *_: (si, j)),
             pl.BlockSpec((1, b.block_n), lambda j, si, *_: (0, j)), _whole(w.exc_ptr), *map(_whole, exc)]
    operands = (w.sm, w.sm, w.nib, w.base.reshape(1, n), w.exc_ptr, *exc)
    # The patch loop is compiled in even without exceptions (its range is then empty): on the H200 the
    # kernel compiled without it gave products differing from the twin's in the last bits at M <= 16
    # (bench_w12 "w12_noexc", 2026-11-29), while with it every shape and M matched bit for bit.
    fmt = dict(k_half=k // 2, group_n=w.group_n, group_k=w.group_k, n_groups_k=w.n_groups_k)
    return specs, operands, fmt


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "diagnostic_load_only", "swapped", "decode",
                                             "diagnostic_no_patch"))
def w12_matmul_partials(x: jax.Array, w: W12, blocks: W12Blocks | None = None,
                        interpret: bool = False, diagnostic_load_only: bool = False,
                        swapped: bool = False, decode: str = "auto", diagnostic_no_patch: bool = False) -> jax.Array:
    """x [M, K] bf16, W12 [K, N] -> per-split partial products [split_k, M, N] float32.

    `decode`: "asm" (PTX on packed registers, compiled kernels only), "jnp" (elementwise, any backend) or
    "auto" (asm unless interpreting).

    `diagnostic_load_only` (benchmarks only; the result is NOT the product) loads every plane as usual
    but builds the tiles with one XOR per weight instead of decoding, and skips exceptions: its time
    against the real kernel's separates the decode arithmetic from the loads and the matmul.
    `diagnostic_no_patch` (benchmarks only) compiles the kernel without the exception patch loop: exact
    only for matrices without exceptions; it measures what the nested loop costs the K loop."""
    k, n = w.shape
    m = x.shape[0]
    xp, b, x_specs, common = _setup(x, k, n, blocks, swapped)
    specs, operands, fmt = _w12_operands(w, b)
    fmt.update(asm=_use_asm(decode, interpret), patch_branch=b.exceptions == "branch")
    if diagnostic_load_only:
        fmt = {**fmt, "diagnostic_load_only": True}
    if diagnostic_no_patch:  # benchmarks only: exact only for matrices without exceptions
        fmt = {**fmt, "patch_exceptions": False}
    out = pl.pallas_call(
        functools.partial(_w12_kernel, block_k=b.block_k, m=m, swapped=swapped, prefetch=b.prefetch, **fmt),
        in_specs=[*x_specs, *specs], interpret=interpret, **common,
    )(xp, xp, *operands)
    return out[:, :m]


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "decode"))
def w12_decode_tiles(w: W12, blocks: W12Blocks | None = None, interpret: bool = False,
                     decode: str = "auto") -> jax.Array:
    """uint16 bits [K, N] of the bf16 matrix exactly as the matmul kernel's loader builds it (same code,
    same tiles): the direct check that the kernel decodes every bit pattern."""
    k, n = w.shape
    b = blocks or default_blocks(k, n)
    check_blocks(k, n, b)
    specs, operands, fmt = _w12_operands(w, b)
    fmt.update(asm=_use_asm(decode, interpret), patch_branch=b.exceptions == "branch")
    ks = k // 2 // b.split_k
    out_spec = pl.BlockSpec((ks, b.block_n), lambda j, si: (si, j))
    lo, hi = pl.pallas_call(
        functools.partial(_w12_decode_kernel, block_k=b.block_k, **fmt),
        grid=(n // b.block_n, b.split_k), in_specs=specs, out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((k // 2, n), jnp.uint16)] * 2,
        compiler_params=plt.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
        interpret=interpret,
    )(*operands)
    return jnp.concatenate([lo, hi], axis=0)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "swapped"))
def bf16_matmul_partials(x: jax.Array, w: jax.Array, blocks: W12Blocks | None = None,
                         interpret: bool = False, swapped: bool = False) -> jax.Array:
    """The twin: same tiling and accumulation order over the original bf16 [K, N] weight."""
    k, n = w.shape
    m = x.shape[0]
    if w.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the twin reads bf16 weights, got {w.dtype}")
    xp, b, x_specs, common = _setup(x, k, n, blocks, swapped)
    out = pl.pallas_call(
        functools.partial(_bf16_kernel, block_k=b.block_k, m=m, swapped=swapped, prefetch=b.prefetch),
        in_specs=[*x_specs, *_half_specs(b, k // 2 // b.split_k)],
        interpret=interpret, **common,
    )(xp, xp, w, w)
    return out[:, :m]


def _gemv_setup(x: jax.Array, k: int, n: int, blocks: W12Blocks | None):
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x {x.shape} does not match a [{k}, {n}] weight")
    if x.shape[0] != 1:
        raise NotImplementedError(f"the GEMV path takes M = 1, got {x.shape[0]}")
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the kernel multiplies bf16 activations, got {x.dtype}")
    b = blocks or default_gemv_blocks(k, n)
    check_gemv_blocks(k, n, b)
    s, ks = b.split_k, k // 2 // b.split_k
    x_specs = [pl.BlockSpec((ks, 1), lambda j, si: (si, 0)),
               pl.BlockSpec((ks, 1), lambda j, si: (s + si, 0))]
    common = dict(
        grid=(n // b.block_n, s),
        out_shape=jax.ShapeDtypeStruct((s, 1, n), jnp.float32),
        out_specs=pl.BlockSpec((None, 1, b.block_n), lambda j, si: (si, 0, j)),
        compiler_params=plt.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
    )
    return x.T, b, x_specs, common


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def w12_gemv_partials(x: jax.Array, w: W12, blocks: W12Blocks | None = None,
                      interpret: bool = False) -> jax.Array:
    """M = 1 path: x [1, K] bf16, W12 [K, N] -> partial products [split_k, 1, N] float32 (CUDA cores)."""
    k, n = w.shape
    xt, b, x_specs, common = _gemv_setup(x, k, n, blocks)
    specs, operands, fmt = _w12_operands(w, b)
    return pl.pallas_call(
        functools.partial(_w12_gemv_kernel, block_k=b.block_k, **fmt),
        in_specs=[*x_specs, *specs], interpret=interpret, **common,
    )(xt, xt, *operands)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def bf16_gemv_partials(x: jax.Array, w: jax.Array, blocks: W12Blocks | None = None,
                       interpret: bool = False) -> jax.Array:
    """The GEMV path's twin over the original bf16 [K, N] weight: same tiling, same order."""
    k, n = w.shape
    if w.dtype != jnp.bfloat16:
        raise NotImplementedError(f"the twin reads bf16 weights, got {w.dtype}")
    xt, b, x_specs, common = _gemv_setup(x, k, n, blocks)
    return pl.pallas_call(
        functools.partial(_bf16_gemv_kernel, block_k=b.block_k),
        in_specs=[*x_specs, *_half_specs(b, k // 2 // b.split_k)], interpret=interpret, **common,
    )(xt, xt, w, w)


# ---- public API ----------------------------------------------------------------------------------------

def w12_matmul_reference(x: jax.Array, w: W12) -> jax.Array:
    """Pure jnp: decode the whole matrix, then XLA's dot. x [..., K] -> [..., N] float32."""
    return jnp.einsum("...k,kn->...n", x, decode_jnp(w), preferred_element_type=jnp.float32)


def sum_splits(partials: jax.Array) -> jax.Array:
    """[S, M, N] -> [M, N], adding the splits in index order as one chain of adds. An XLA reduce picks its
    summation order by fusion context (eager vs inside a larger jit gave different bits on the H200), so
    the order is written out: the W12 path and its twin then agree bit for bit wherever they are called."""
    acc = partials[0]
    for i in range(1, partials.shape[0]):
        acc = acc + partials[i]
    return acc


M1_PATH = "mma"  # the path "auto" takes at M = 1: "mma" (tensor cores) or "gemv" (CUDA cores)
PATHS = ("auto", "mma", "mma_t", "gemv")


def _dispatch(partials_fn, gemv_fn, reference_fn, x, w, implementation, path, blocks, interpret):
    if implementation not in ("pallas", "xla"):
        raise ValueError(f"implementation must be 'pallas' or 'xla', got {implementation!r}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    k, n = w.shape
    backend = jax.default_backend()
    if implementation == "pallas" and backend in ("cpu", "gpu"):
        interpret = backend == "cpu" if interpret is None else interpret
        x2 = x.reshape(-1, k)
        if path == "auto":
            path = "gemv" if x2.shape[0] == 1 and M1_PATH == "gemv" else "mma"
        fn = {"gemv": gemv_fn, "mma": partials_fn,
              "mma_t": functools.partial(partials_fn, swapped=True)}[path]
        try:
            y = sum_splits(fn(x2, w, blocks=blocks, interpret=interpret))
            return y.reshape(*x.shape[:-1], n)
        except NotImplementedError:
            pass
    return reference_fn(x, w)


def w12_matmul(x: jax.Array, w: W12, *, implementation: str = "pallas", path: str = "auto",
               blocks: W12Blocks | None = None, interpret: bool | None = None, decode: str = "auto") -> jax.Array:
    """x [..., K] @ W12 [K, N] -> [..., N] float32. "pallas" falls back to "xla" (decode + XLA dot) where
    the kernel does not apply; interpret=None runs the kernel in interpret mode on CPU backends. `path`
    picks the tensor-core kernel ("mma"), the same with operands swapped (y^T = W^T x^T: "mma_t"), the
    M = 1 CUDA-core GEMV ("gemv"), or by M ("auto"). `decode` picks the tensor-core paths' decoder
    (`w12_matmul_partials`)."""
    partials = functools.partial(w12_matmul_partials, decode=decode)
    return _dispatch(partials, w12_gemv_partials, w12_matmul_reference, x, w, implementation,
                     path, blocks, interpret)


def bf16_matmul(x: jax.Array, w: jax.Array, *, implementation: str = "pallas", path: str = "auto",
                blocks: W12Blocks | None = None, interpret: bool | None = None) -> jax.Array:
    """The twin's public function: x [..., K] @ bf16 W [K, N] -> [..., N] float32 (same paths and
    fallbacks, so it equals `w12_matmul` bit for bit)."""

    def reference(x, w):
        return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)

    return _dispatch(bf16_matmul_partials, bf16_gemv_partials, reference, x, w, implementation, path, blocks,
                     interpret)
