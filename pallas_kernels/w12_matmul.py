"""Fused W12 decode + matmul at decode / verify shapes (M = 1..64 rows) on Pallas' Triton backend, and its
bf16 twin: both hand their weight tiles to one tiled body, so W12 is lossless iff the two agree bit for
bit. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import NUM_SMS_H200, exception_lists, largest_pow2_divisor, pow2, sum_splits
from specpilot.formats.w12 import W12, decode_jnp

MIN_DOT = 16  # Triton's tl.dot wants every dimension >= 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


def _nextpow2(n: int) -> int:
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
    block_n = largest_pow2_divisor(n, 128)
    if block_n < MIN_DOT:
        raise NotImplementedError(f"N = {n} has no power-of-two block >= {MIN_DOT}")
    splits = [s for s in range(1, kh + 1) if kh % s == 0 and pow2(kh // s) and kh // s >= MIN_DOT]
    if not splits:
        raise NotImplementedError(f"K / 2 = {kh} has no power-of-two split >= {MIN_DOT}")
    block_k = min(32, kh // splits[0])
    splits = [s for s in splits if kh // s >= block_k]
    split_k = next((s for s in splits if (n // block_n) * s >= target_programs), splits[-1])
    return W12Blocks(block_n=block_n, block_k=block_k, split_k=split_k,
                     exceptions="branch" if m > 32 else "loop")


def _tiles(k: int, n: int, b: W12Blocks) -> bool:
    """Even K, block_n | N, (K/2)/split_k a power of two divisible by block_k, power-of-two blocks."""
    kh, s = k // 2, b.split_k
    return (k % 2 == 0 and n % b.block_n == 0 and kh % s == 0 and pow2(kh // s) and pow2(b.block_n)
            and pow2(b.block_k) and (kh // s) % b.block_k == 0)


def check_blocks(k: int, n: int, b: W12Blocks) -> None:
    if b.exceptions not in ("loop", "branch"):
        raise ValueError(f"exceptions must be 'loop' or 'branch', got {b.exceptions!r}")
    ok = _tiles(k, n, b) and pow2(b.block_m) and min(b.block_n, b.block_k, b.block_m) >= MIN_DOT
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
                asm: bool = False, patch_branch: bool = False):
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
        if asm:
            lo = _decode_asm(sm_lo, nib, base, _DECODE_PTX_LO)
            hi = _decode_asm(sm_hi, nib, base, _DECODE_PTX_HI)
        else:
            nib = nib.astype(jnp.int32)  # zero-extended; int8 -> int32 sign-extends: bit 15 is the sign
            lo = (sm_lo.astype(jnp.int32) & 0x807F) | (((nib & 0xF) << 7) + base7)
            hi = (sm_hi.astype(jnp.int32) & 0x807F) | (((nib >> 4) << 7) + base7)
        if patch_branch:  # W12Blocks.exceptions == "branch"
            listed = sum(stop - start for start, stop in bounds)
            lo, hi = jax.lax.cond(listed > 0, lambda lo, hi: patch(s * ks + k0, lo, hi, bounds),
                                  lambda lo, hi: (lo, hi), lo, hi)
        else:  # compiled in even for matrices without exceptions (see _w12_operands)
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


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "swapped", "decode"))
def w12_matmul_partials(x: jax.Array, w: W12, blocks: W12Blocks | None = None,
                        interpret: bool = False, swapped: bool = False, decode: str = "auto") -> jax.Array:
    """x [M, K] bf16, W12 [K, N] -> per-split partial products [split_k, M, N] float32.

    `decode`: "asm" (PTX on packed registers, compiled kernels only), "jnp" (elementwise, any backend) or
    "auto" (asm unless interpreting). `swapped`: y^T = W^T x^T (the decoded tile as the MMA's first
    operand); the same products."""
    k, n = w.shape
    m = x.shape[0]
    xp, b, x_specs, common = _setup(x, k, n, blocks, swapped)
    specs, operands, fmt = _w12_operands(w, b)
    fmt.update(asm=_use_asm(decode, interpret), patch_branch=b.exceptions == "branch")
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


# ---- public API ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class W12TritonConfig:
    """The Triton-backend W12 kernel's settings: blocks (None: `default_blocks` by shape and rows), the
    decoder ("auto": PTX when compiled for NVIDIA, jnp in the interpreter), the operand order
    (`swapped`) and interpret (None: on CPU backends)."""

    blocks: W12Blocks | None = None
    decode: str = "auto"
    swapped: bool = False
    interpret: bool | None = None

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {self.decode!r}")


def _run(partials_fn, x: jax.Array, w, config: W12TritonConfig) -> jax.Array:
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        raise NotImplementedError(f"the Triton-backend W12 kernel runs on GPUs (or interpreted on CPUs), "
                                  f"not {backend!r}")
    interpret = backend == "cpu" if config.interpret is None else config.interpret
    k, n = w.shape
    y = sum_splits(partials_fn(x.reshape(-1, k), w, blocks=config.blocks, interpret=interpret,
                               swapped=config.swapped))
    return y.reshape(*x.shape[:-1], n)


def w12_matmul(x: jax.Array, w: W12, config: W12TritonConfig = W12TritonConfig()) -> jax.Array:
    """x [..., K] @ W12 [K, N] -> [..., N] float32 through the kernel. Raises NotImplementedError where the
    kernel does not apply (shape, dtype or backend)."""
    if not isinstance(w, W12):
        raise NotImplementedError(f"the Triton W12 kernel multiplies W12 weights, got {type(w).__name__}")
    return _run(functools.partial(w12_matmul_partials, decode=config.decode), x, w, config)


def bf16_matmul(x: jax.Array, w: jax.Array, config: W12TritonConfig = W12TritonConfig()) -> jax.Array:
    """The twin's public function: x [..., K] @ bf16 W [K, N] -> [..., N] float32, same tiling and order,
    so it equals `w12_matmul` bit for bit."""
    return _run(bf16_matmul_partials, x, w, config)


def w12_matmul_reference(x: jax.Array, w: W12) -> jax.Array:
    """Pure jnp: decode the whole matrix, then XLA's dot. x [..., K] -> [..., N] float32."""
    return jnp.einsum("...k,kn->...n", x, decode_jnp(w), preferred_element_type=jnp.float32)


def bf16_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """Pure jnp: XLA's dot of x [..., K] and the bf16 [K, N] weight, float32 accumulation."""
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
