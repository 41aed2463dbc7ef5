"""The Mosaic GPU kernel body shared by W12 and its bf16 twin, and its `plgpu.kernel` call (`kernel_call`):
y^T = W^T x^T, one program per 64 W^T rows and split of K, the steps streamed by TMA through
`plgpu.emit_pipeline`. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.w12_mosaic.layout import BN, XOR_STEP, unpermute_jnp, xor_tile_chunks
from pallas_kernels.w12_mosaic.ptx import ptx_decode

SWIZZLE = 128  # bytes: the swizzle of both wgmma operands in shared memory (TMA's widest, bank-conflict free)
SWIZZLE_BF16 = SWIZZLE // 2  # bf16 elements per swizzled row: block_k is a multiple of it


def _transforms(bits: int, swizzle: int):
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def kernel_call(x, operands, *, k: int, n: int, mp: int, block_k: int, split: int, stages: int, w12: bool,
                interpret: bool):
    """x [Mp, K] bf16 folded (`api.fold_x`); operands: W12NK's (packed, base7, slots) or the twin's tiles
    -> partial products [split, N, Mp] float32."""
    kh = k // 2
    if split < 1 or kh % (split * block_k):  # a split must cover whole steps, or the rows left over are dropped
        raise ValueError(f"split {split} does not divide the {kh // block_k} steps of {block_k} half-rows of a "
                         f"[{k}, {n}] weight into whole steps per program")
    steps = kh // split // block_k  # K steps per program (each covers block_k rows of both K halves)
    half_blocks = kh // block_k  # steps per column block
    mma_tiles = _transforms(16, SWIZZLE)  # bf16 tiles with 128-byte rows: x [Mp, BK] and the twin's W^T
    wgmma_layout = plgpu.Layout.WGMMA
    dec_layout = plgpu.Layout.WGMMA_UPCAST_2X  # the planes' registers: 4 bytes per thread, as for upcasts
    xor_chunks = w12 and block_k == XOR_STEP  # chunk-ordered tiles, copied plain, loaded by the PTX decode
    plane_tiles = () if xor_chunks else _transforms(8, block_k)
    a_in_registers = w12 and not interpret
    decode_ptx = ptx_decode((BN, block_k), from_ref=xor_chunks) if w12 and not interpret else None

    def tile(ref, layout):  # the interpreter has no layouts; compiled, they are explicit (plain loads with
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout, optimized=not xor_chunks)  # plain copies

    def kernel(x_gmem, *refs):
        if w12:
            planes_gmem, base_gmem, slot_gmem, o_gmem, bs, bar, *scr = refs
            w_gmem_refs = (planes_gmem, slot_gmem)
        else:
            w_gmem, o_gmem, *scr = refs
            w_gmem_refs = (w_gmem,)
        j, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        first = si * steps  # this program's first step (in each half)
        row0 = j * BN  # its first W^T row
        x_specs = [plgpu.BlockSpec((mp, 2 * block_k), lambda i: (0, first + i), transforms=mma_tiles)]
        if w12:  # tile (j, kb) is the planes' block row j * half_blocks + kb (`layout.tile_rows`); its slot row
            w_specs = [plgpu.BlockSpec((BN, 3 * block_k), lambda i: (j * half_blocks + first + i, 0),
                                       transforms=plane_tiles),
                       plgpu.BlockSpec((1, slot_gmem.shape[1]), lambda i: ((first + i) * (n // BN) + j, 0))]
        else:  # the twin's two tiles of a step side by side, contiguous (`layout.tile_twin`): one copy
            w_specs = [plgpu.BlockSpec((BN, 2 * block_k), lambda i: (j * half_blocks + first + i, 0),
                                       transforms=mma_tiles)]

        def load_base7():  # the bases of this program's rows (base << 7), broadcast over a tile's columns
            base7 = jax.lax.broadcast_in_dim(tile(bs.at[0], dec_layout.reduce(1)), (BN, block_k), (0,))
            return base7 if interpret else plgpu.layout_cast(base7, dec_layout)

        def iota(dim):
            if interpret:
                return jax.lax.broadcasted_iota(jnp.int32, (BN, block_k), dim)
            return plgpu.broadcasted_iota(jnp.int32, (BN, block_k), dim, layout=dec_layout)

        if w12:  # the bases' copy, issued before the pipeline, waited for in its first step
            plgpu.copy_gmem_to_smem(base_gmem.at[pl.ds(row0, BN)], bs.at[0], bar.at[0])

        def decode(pk, slot):  # the step's packed tile and slot row -> the two A tiles
            base7 = load_base7()
            if decode_ptx is not None:  # registers decoded by PTX, slot-table patches included
                planes = [pk] if xor_chunks else [tile(pk.at[:, pl.ds(q * block_k, block_k)], dec_layout)
                                                  for q in range(3)]
                return decode_ptx(*planes, base7, slot)
            pk = xor_tile_chunks(pk[...]) if xor_chunks else pk[...]  # the interpreter: the bytes in order
            s_lo, s_hi, nb = (pk[:, q * block_k:(q + 1) * block_k] for q in range(3))
            nib = nb.astype(jnp.int32) & 0xFF  # & 0xFF: packed planes hold it as int8
            lo = (s_lo.astype(jnp.int32) & 0x807F) | (((nib & 0xF) << 7) + base7)
            hi = (s_hi.astype(jnp.int32) & 0x807F) | (((nib >> 4) << 7) + base7)
            lo, hi = lo.astype(jnp.uint16), hi.astype(jnp.uint16)  # the bf16 bits, unsigned like the entries
            pos_lo = (iota(0) << 8) | iota(1)  # an element's packed position in the table (stored columns)
            pos_hi = pos_lo | 0x8000

            def one_slot(e, carry):  # entry: bits << 16 | half << 15 | n_local << 8 | k_local
                lo, hi = carry
                entry = slot[0, 1 + e]
                key, v = entry & 0xFFFF, ((entry >> 16) & 0xFFFF).astype(jnp.uint16)
                return jnp.where(pos_lo == key, v, lo), jnp.where(pos_hi == key, v, hi)

            lo, hi = jax.lax.fori_loop(0, slot[0, 0], one_slot, (lo, hi))
            lo = unpermute_jnp(jax.lax.bitcast_convert_type(lo, jnp.bfloat16))  # stored (mma) order -> true
            hi = unpermute_jnp(jax.lax.bitcast_convert_type(hi, jnp.bfloat16))
            a_lo, a_hi = scr[0].at[0], scr[1].at[0]  # the interpreter's A operand: shared memory
            a_lo[...] = lo
            a_hi[...] = hi
            return a_lo, a_hi

        def b_operand(x_tile, h):  # x [Mp, BK] -> B = x^T [BK, Mp], K-major
            if not interpret:
                return plgpu.transpose_ref(x_tile, (1, 0))
            xt = scr[-2 + h].at[0]  # the interpreter has no transposed refs: a transposed copy
            xt[...] = x_tile[...].T
            return xt

        def step(acc, indices, x_tile, w_tile, *slot):
            (i,) = indices
            x_lo, x_hi = (x_tile.at[:, pl.ds(h * block_k, block_k)] for h in (0, 1))
            if w12:
                @pl.when(i == 0)
                def _():
                    plgpu.barrier_wait(bar.at[0])

                a_lo, a_hi = decode(w_tile, slot[0])
            else:  # the twin's paired tile: lower | upper
                a_lo, a_hi = (w_tile.at[:, pl.ds(h * block_k, block_k)] for h in (0, 1))
            b_lo, b_hi = b_operand(x_lo, 0), b_operand(x_hi, 1)
            if w12 and not a_in_registers:
                plgpu.commit_smem()
            plgpu.wgmma(acc, a_lo, b_lo)
            plgpu.wgmma(acc, a_hi, b_hi)
            plgpu.wgmma_wait(0)  # before the pipeline refills these buffers

        def scope(acc):
            plgpu.emit_pipeline(functools.partial(step, acc), grid=(steps,), in_specs=[*x_specs, *w_specs],
                                max_concurrent_steps=stages)(x_gmem, *w_gmem_refs)
            o_gmem[si, pl.ds(row0, BN), :] = acc[...]

        pl.run_scoped(scope, plgpu.ACC((BN, mp), jnp.float32))

    scratch = []
    if w12:  # the bases of the program's rows
        scratch = [plgpu.SMEM((1, BN), jnp.int32), plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    if w12 and not a_in_registers:  # the decoded A tiles
        scratch += [plgpu.SMEM((1, BN, block_k), jnp.bfloat16, transforms=mma_tiles)] * 2
    if interpret:  # the interpreter has no transposed refs: transposed x tiles
        x_t = _transforms(16, 2 * mp) if mp >= 16 else ()  # rows of 16 bytes have no swizzle
        scratch += [plgpu.SMEM((1, block_k, mp), jnp.bfloat16, transforms=x_t)] * 2
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_arg = InterpretGPUParams()
    else:
        interpret_arg = None
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((split, n, mp), jnp.float32),
                        grid=(n // BN, split), grid_names=("n", "s"), scratch_types=scratch,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                                             unsafe_no_auto_barriers=True),
                        interpret=interpret_arg)
    return call(x, *operands)

