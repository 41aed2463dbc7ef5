"""The Mosaic GPU W12 kernel's PTX (`pallas_kernels.w12_mosaic.ptx`), executed instruction by instruction on
the CPU: the decode gives every bf16 pattern's bits, and a slot-table entry's patch replaces exactly its
element."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels.w12_mosaic import ptx
from specpilot.formats import w12
from w12_helpers import pack4, run_ptx


def test_ptx_decode_every_bit_pattern():
    """`DECODE4_PTX`, run instruction by instruction on the CPU over the registers the kernel forms (four
    consecutive K elements of one W^T row per register, both K halves, the row's base << 7), gives each
    of the 65,536 bf16 patterns' planes the element-wise decode's bits, and the weight itself wherever it
    is not an exception."""
    # Column c holds the patterns 512 c ... 512 c + 511 in (exponent, sign, mantissa) order, rows shuffled
    # per column: two exponents per column, so nearly every pattern decodes from the planes, and the four
    # elements of a register differ in every bit (a byte taken from the wrong position shows).
    pats = np.arange(65536, dtype=np.uint32)
    order = np.argsort(((pats >> 7) & 0xFF) * 256 + (pats & 0xFF), kind="stable")
    rng = np.random.default_rng(1)
    bits = np.stack([rng.permutation(c) for c in pats[order].astype(np.uint16).reshape(128, 512)]).T.copy()
    enc = w12.encode(bits.view(jnp.bfloat16))
    assert enc.num_exceptions < 2048
    sm, nib, base = np.asarray(enc.sm), np.asarray(enc.nib), np.asarray(enc.base).astype(np.uint32)
    kh, n = nib.shape
    exc = np.zeros(bits.shape, bool)
    exc[np.asarray(enc.exc_row), np.asarray(enc.exc_col)] = True
    reg = [pack4(np.ascontiguousarray(a.T).view(np.uint8)) for a in (sm[:kh], sm[kh:], nib)]  # [N, Kh/4]
    reg_base = np.broadcast_to((base << 7)[:, None], reg[0].shape)
    regs = run_ptx(ptx.DECODE4_PTX, [None] * 4 + reg + [reg_base])
    for half, (w0, w1) in enumerate((("$0", "$1"), ("$2", "$3"))):
        r0, r1 = regs[w0], regs[w1]
        got = np.stack([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], axis=-1).reshape(n, kh).T.astype(np.uint16)
        rows = slice(half * kh, (half + 1) * kh)
        codes = (nib >> 4) if half else (nib & 0xF)
        want = ((sm[rows].astype(np.int32) & 0x807F) | ((codes.astype(np.int32) + base.astype(np.int32)) << 7))
        np.testing.assert_array_equal(got, want.astype(np.uint16))
        keep = ~exc[rows]
        np.testing.assert_array_equal(got[keep], bits[rows][keep])
        assert len(np.unique(sm[rows][keep])) == 256  # every sign|mantissa byte decoded by the PTX alone


def test_ptx_patch_replaces_exactly_the_listed_element():
    """`EXCEPTION_PTX` + `PATCH_PTX` on the CPU: an entry (bits, half, row, column) changes exactly the
    16-bit lane of the one register (of the upper or lower tile) whose key is its position, and nothing
    else, for every lane and both halves."""
    rng = np.random.default_rng(0)
    n_local, col0 = rng.integers(0, 64, 4096), rng.integers(0, 16, 4096) * 4  # registers: row, first column
    words = rng.integers(0, 2**32, (4096, 2), dtype=np.uint64).astype(np.uint32)
    key = ((n_local << 8) | col0).astype(np.uint32)
    for half in (0, 1):
        for lane in range(4):
            hit = rng.random(4096) < 0.5  # half the entries point into their register, half elsewhere
            e_col = np.where(hit, col0 + lane, (col0 + 4 + lane) % 64)
            value = rng.integers(0, 2**16, 4096).astype(np.uint32)
            entry = (value << 16) | (half << 15) | (n_local << 8).astype(np.uint32) | e_col.astype(np.uint32)
            prep = run_ptx(ptx.EXCEPTION_PTX, [None] * 4 + [entry.astype(np.uint32)])
            reg_key = key | np.uint32(half << 15)  # the register of the half the entry names
            out = run_ptx(ptx.PATCH_PTX, [None, None, words[:, 0], words[:, 1], prep["$0"], reg_key,
                                           prep["$1"], prep["$2"], prep["$3"]])
            got = np.stack([out["$0"], out["$1"]], axis=-1)
            halves = words.view(np.uint16).reshape(4096, 4).copy()  # lane j = halfword j (little-endian)
            halves[hit, lane] = value[hit]
            np.testing.assert_array_equal(got.view(np.uint16).reshape(4096, 4), halves)
            other = run_ptx(ptx.PATCH_PTX, [None, None, words[:, 0], words[:, 1], prep["$0"],
                                             key | np.uint32((1 - half) << 15), prep["$1"], prep["$2"], prep["$3"]])
            np.testing.assert_array_equal(np.stack([other["$0"], other["$1"]], -1), words)  # other half: untouched
