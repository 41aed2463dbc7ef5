"""The PTX the Mosaic GPU W12 kernel decodes with when compiled: plane registers to bf16 pairs, and the
slot-table patches, as one `plgpu.inline_mgpu` function (`ptx_decode`). Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.w12_mosaic.layout import BN

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


# The PTX of `ptx_decode` (tests/test_w12_mosaic_ptx.py runs each on the CPU, instruction by instruction).
# One register of the upcast layout: $4 four sign|mantissa bytes of the lower K half's tile (K elements
# k..k+3 of one W^T row), $5 the same for the upper half, $6 the four nibble bytes, $7 the row's base << 7;
# out $0, $1 the lower half's four bf16 patterns (two per register, element 0 in the low half), $2, $3
# the upper half's.
DECODE4_PTX = _decode_ptx((0, 1))

# One exception entry $4 (bits << 16 | half << 15 | n_local << 8 | k_local) -> $0 its position without the
# two lane bits (compared with a register's key), $1 its bits in both halves, $2 / $3 the halfword mask
# that selects its lane in a register's first / second word (zero in the other word).
EXCEPTION_PTX = """{
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
PATCH_PTX = """{
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



def ptx_decode(shape, from_ref: bool):
    """The compiled decode of one step: an `inline_mgpu` function that takes the step's plane tiles (the
    three loaded [64, block_k] tiles in the upcast layout, or with `from_ref` the chunk-ordered [64, 192]
    tile in shared memory, loaded here), the rows' bases << 7 (upcast layout) and the step's slot-table
    row, and returns the lower and upper K halves' bf16 tiles in the WGMMA layout, exceptions patched."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, scf
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    dec_layout = plgpu.Layout.WGMMA_UPCAST_2X
    out = plgpu.ShapeDtypeStruct(shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)
    if from_ref and shape != (BN, 64):
        raise NotImplementedError(f"from_ref takes whole steps of 64, [{BN}, 64], got {shape}")
    planes_in = (plgpu.RefType(),) if from_ref else (dec_layout, dec_layout, dec_layout)

    @plgpu.inline_mgpu(arg_types=planes_in + (dec_layout, plgpu.RefType()), return_type=(out, out))
    def decode(ctx, *args):
        del ctx
        if from_ref:
            tile_ref, base7, slot_ref = args
        else:
            s_lo, s_hi, nib, base7, slot_ref = args
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

        # the planes' layout (base7's, when the function loads them itself) and, per register, the (row,
        # column) of its first element
        lay = base7.layout if from_ref else s_lo.layout
        regs_shape = base7.registers.shape if from_ref else s_lo.registers.shape
        positions = [tuple(arith.index_cast(i32, v) for v in rc) for rc in lay.thread_idxs(shape)]
        # per register, its row's static offset from the thread's first row (the layout's tile strides)
        strides = lay.tiling.tile_strides(tuple(mgpu_utils.get_contiguous_strides(shape)))
        row_offs = [sum(i * s for i, s in zip(idx, strides)) // shape[1] for idx in np.ndindex(regs_shape)]
        groups = [(off, [q for q, o in enumerate(row_offs) if o == off]) for off in sorted(set(row_offs))]
        row_first = arith.subi(positions[0][0], mgpu_utils.c(row_offs[0], i32))  # the thread's first row

        def group_conds(entry):  # per row group: whether the entry's row (bits 8-13) is that group's row here
            n_local = arith.andi(arith.shrui(entry, mgpu_utils.c(8, i32)), mgpu_utils.c(BN - 1, i32))
            return [arith.cmpi(arith.CmpIPredicate.eq, n_local, arith.addi(row_first, mgpu_utils.c(off, i32)))
                    for off, _ in groups]

        zero = arith.constant(index, 0)
        count = memref.load(slot_ref, [zero, zero])

        def load_entry(e):  # entry e (an i32 loop index); the count is first
            return memref.load(slot_ref, [zero, arith.addi(arith.index_cast(index, e), arith.constant(index, 1))])

        if from_ref:  # the three planes' registers, loaded here from the chunk-ordered tile
            ptr = mgpu_utils.memref_ptr(tile_ref)
            i8 = ir.IntegerType.get_signless(8)
            loaded = []  # per register: [lo, hi, nib] words
            for r, c in positions:
                chunk = arith.shli(arith.andi(arith.shrui(r, mgpu_utils.c(1, i32)), mgpu_utils.c(3, i32)),
                                   mgpu_utils.c(4, i32))  # ((r // 2) % 4) * 16: `chunk_order`
                off = arith.addi(arith.muli(r, mgpu_utils.c(3 * shape[1], i32)), arith.xori(c, chunk))
                loaded.append([llvm.load(i32, mgpu_utils.getelementptr(
                    ptr, [arith.addi(off, mgpu_utils.c(q * shape[1], i32))], i8), alignment=4) for q in range(3)])
        else:
            loaded = [[word(t.registers[idx]) for t in (s_lo, s_hi, nib)] for idx in np.ndindex(regs_shape)]
        words = [asm(4, [*loaded[q], word(base7.registers[idx])], DECODE4_PTX)  # per register: lo0, lo1, hi0, hi1
                 for q, idx in enumerate(np.ndindex(regs_shape))]
        keys = [arith.ori(arith.shli(r, mgpu_utils.c(8, i32)), c) for r, c in positions]  # row << 8 | column
        hi_bit = mgpu_utils.c(0x8000, i32)
        key_sets = [keys, [arith.ori(k, hi_bit) for k in keys]]  # the lower and upper K half's
        flat = [w for ws in words for w in ws]

        def patch_rows(conds, entry, flat):  # the entry's row group, then its K half
            for cond, (_, regs_q) in zip(conds, groups):
                branch = _if_else(scf, cond, [w.type for w in flat])
                with ir.InsertionPoint(branch.then_block):
                    keyq, vv, m0, m1 = asm(4, [entry], EXCEPTION_PTX)

                    def patch_half(h, flat):  # the group's registers' words of key set h
                        out_ = list(flat)
                        for q in regs_q:
                            w = 4 * q + 2 * h
                            out_[w:w + 2] = asm(2, [flat[w], flat[w + 1], keyq, key_sets[h][q], vv, m0, m1],
                                                PATCH_PTX)
                        return out_

                    upper = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(entry, hi_bit), mgpu_utils.c(0, i32))
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

        @mgpu_utils.fori(count, flat)
        def patched(e, flat):
            entry = load_entry(e)
            return patch_rows(group_conds(entry), entry, flat)

        flat = list(patched.results)
        words = [flat[4 * q:4 * (q + 1)] for q in range(len(words))]

        def array(first):  # upcast register [.., g, .., h, ..] -> WGMMA registers [.., 2g, .., h, ..], [.., 2g + 1, ..]
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

        return array(0), array(2)

    return decode
