"""Helpers shared by the W12 kernel tests (imported as a plain module: pytest puts tests/ on sys.path):
adversarial weights, bit and error-bound assertions, what this jax can run on a CPU, and a CPU emulator
of the PTX subset the kernels' decoders use."""

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.formats import w12


def adversarial_weights(k: int, n: int, seed: int, finite: bool = True) -> np.ndarray:
    """bf16 [K, N]: a trained-like body with 2% exceptions (zeros, -0, subnormals, tiny and large values;
    with finite=False also Inf and NaN payloads), in both K halves and at the matrix corners."""
    rng = np.random.default_rng(seed)
    bits = (rng.standard_normal((k, n)) * 0.02).astype(np.float32).astype(jnp.bfloat16).view(np.uint16)
    special = [0x0000, 0x8000, 0x0001, 0x807F, 0x0A00, 0x4700, 0xC6FF] + ([] if finite else
                                                                         [0x7F80, 0xFF80, 0x7F81, 0xFFC3])
    idx = rng.choice(k * n, size=max(4, k * n // 50), replace=False)
    bits.ravel()[idx] = rng.choice(special, idx.size)
    for r, c in ((0, 0), (k - 1, n - 1), (k // 2, 0), (k // 2 - 1, n - 1)):
        bits[r, c] = special[(r + c) % len(special)]
    return bits.view(jnp.bfloat16)


def assert_same_bits(a, b):
    """Bit equality, NaN compared as NaN: a matmul's NaN payload is not defined by its inputs."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    keep = ~np.isnan(a)
    np.testing.assert_array_equal(a[keep].view(np.uint32), b[keep].view(np.uint32))


def assert_close_to_exact(got, x, w):
    """|got - x @ w| within the float32 summation bound K * eps * sum |x| |w| (float64 reference)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact, scale = x64 @ w64, np.abs(x64) @ np.abs(w64)
    bound = x64.shape[-1] * np.finfo(np.float32).eps * scale + 1e-37
    assert (np.abs(np.asarray(got, np.float64) - exact) <= bound).all()


def assert_close_to_reference(got, ref, x, w):
    """|got - ref| within twice the float32 summation bound (both within it of the exact product): a kernel
    against its pure-jnp reference, whose summation orders differ."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = 2 * x64.shape[-1] * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64)) + 1e-37
    assert (np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)) <= bound).all()


def cuda_lowering_available() -> bool:
    """Whether this jax can lower for cuda without a GPU (`jit(f).trace(...).lower(lowering_platforms=)`)."""
    try:
        jax.jit(lambda a: a).trace(jax.ShapeDtypeStruct((1,), jnp.float32)).lower(lowering_platforms=("cuda",))
    except Exception:  # noqa: BLE001 - any failure means the API is absent or different
        return False
    return True


def mosaic_interpreter_available() -> bool:
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401
    except ImportError:
        return False
    return True


def w12_struct(k, n, e=1000):
    """A [K, N] W12 matrix as shape structs (for lowering without data)."""
    s = jax.ShapeDtypeStruct
    kh = k // 2
    cells = -(-n // w12.DEFAULT_GROUP_N) * -(-kh // w12.DEFAULT_GROUP_K)
    return w12.W12(sm=s((k, n), jnp.int8), nib=s((kh, n), jnp.uint8), base=s((n,), jnp.uint8),
                   exc_ptr=s((cells + 1,), jnp.int32), exc_row=s((e,), jnp.int32),
                   exc_col=s((e,), jnp.int32), exc_val=s((e,), jnp.uint16), shape=(k, n))


def run_ptx(ptx: str, args: list) -> dict:
    """Execute the straight-line PTX subset of the GPU kernels' decoders (`w12_matmul._DECODE_PTX`, the Mosaic
    kernel's `DECODE4_PTX`, `EXCEPTION_PTX`, `PATCH_PTX`: mov, and, or, add, mad.lo, shl, shr, prmt,
    lop3 on b32; setp.lt/eq.u32, selp.b32 and @p / @!p guards) over numpy uint32 arrays, following the PTX
    ISA's definitions; `args` are $0.. in order (outputs None). An instruction outside the subset fails
    the test instead of being skipped."""
    regs = {f"${i}": a for i, a in enumerate(args)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 16) if tok.lower().startswith("0x") else int(tok))

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg") or not line:
            continue
        guard = None
        if line.startswith("@"):  # a predicated instruction: only where the predicate holds (@!p: fails)
            guard, line = line.split(None, 1)
        op, rest = line.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op in ("setp.lt.u32", "setp.eq.u32"):
            regs[d] = np.asarray(a[0] < a[1] if op == "setp.lt.u32" else a[0] == a[1])
            continue
        if op == "selp.b32":
            r = np.where(a[2], a[0], a[1])
        elif op == "mad.lo.u32":
            r = a[0] * a[1] + a[2]  # the low 32 bits: uint32 arithmetic wraps
        elif op == "lop3.b32":  # bit i of d = bit (a_i << 2 | b_i << 1 | c_i) of the lookup table
            lut = int(a[3])
            r = np.zeros_like(np.asarray(a[0] | a[1] | a[2]), dtype=np.uint32)
            for idx in range(8):
                if lut >> idx & 1:
                    r = r | ((a[0] if idx & 4 else ~a[0]) & (a[1] if idx & 2 else ~a[1]) & (a[2] if idx & 1 else ~a[2]))
        elif op == "mov.b32":
            r = a[0]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "add.u32":
            r = a[0] + a[1]  # uint32 arithmetic wraps, as add.u32 does
        elif op == "shl.b32":
            r = a[0] << a[1]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "prmt.b32":  # default mode: byte i of d <- selector nibble i over the bytes {b, a}
            src8 = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            sel = int(a[2])
            r = np.zeros_like(np.asarray(a[0]), dtype=np.uint32)
            for i in range(4):
                s = (sel >> (4 * i)) & 0xF
                byte = src8[s & 7]
                if s & 8:  # replicate the byte's sign bit
                    byte = np.where(byte & 0x80, 0xFF, 0x00).astype(np.uint32)
                r = r | (np.asarray(byte, np.uint32) << np.uint32(8 * i))
        else:
            raise AssertionError(f"PTX op {op!r} not emulated")
        r = np.asarray(r, np.uint32)
        if guard is not None:
            p = regs[guard.lstrip("@!")]
            r = np.where(~p if guard.startswith("@!") else p, r, regs[d])
        regs[d] = r
    return regs


def pack4(bytes_: np.ndarray) -> np.ndarray:
    """[..., 4 * G] bytes -> [..., G] uint32, element j of each group at byte j (how Triton packs an
    inline-asm operand of 8-bit elements with pack=4)."""
    b = bytes_.astype(np.uint8).reshape(*bytes_.shape[:-1], -1, 4).astype(np.uint32)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
