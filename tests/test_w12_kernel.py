"""Fused W12 decode-matmul kernel: bit-identical to its bf16 twin (same tiling and order), close to the
XLA reference, exact decode of every bit pattern by the kernel's own loader, fallbacks, cuda lowering,
end-to-end greedy decoding of a tiny model, and the benchmark's CPU smoke run.

Interpret mode runs every case on the CPU; the GPU subclass reruns them compiled (`-m gpu`)."""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import w12_matmul as km
from pallas_kernels.w12_matmul import W12Blocks
from specpilot.cache import init_cache
from specpilot.formats import w12
from specpilot.models import dense, layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


CASES = [  # (K, N, M, blocks, format groups, finite weights); non-finite cases check the twin only
    (64, 32, 1, None, {}, True),
    (128, 64, 5, None, {}, False),
    (256, 256, 16, W12Blocks(block_n=64, block_k=16, split_k=2), {}, True),
    (512, 128, 64, None, {}, False),
    (256, 128, 100, W12Blocks(block_n=128, block_k=32, split_k=1, block_m=32), {}, True),  # 4 M blocks
    (384, 256, 3, W12Blocks(block_n=256, block_k=64, split_k=3), {}, False),  # tile spans 2 CSR columns
    (256, 64, 8, W12Blocks(block_n=16, block_k=16, split_k=4), {"group_n": 32, "group_k": 64}, True),
    (512, 64, 4, W12Blocks(block_n=32, block_k=16, split_k=2, prefetch=False), {}, False),  # no prefetch
    (256, 128, 16, W12Blocks(block_n=64, block_k=16, split_k=2, exceptions="branch"), {}, False),  # patch branch
]


class _KernelCases:
    interpret: bool

    @pytest.mark.parametrize("k,n,m,blocks,groups,finite", CASES)
    def test_bit_identical_to_bf16_twin(self, k, n, m, blocks, groups, finite):
        w = adversarial_weights(k, n, seed=k + n + m, finite=finite)
        enc = jax.device_put(w12.encode(w, **groups))
        assert enc.num_exceptions > 0
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
        got = km.w12_matmul_partials(x, enc, blocks=blocks, interpret=self.interpret)
        twin = km.bf16_matmul_partials(x, jnp.asarray(w), blocks=blocks, interpret=self.interpret)
        assert got.shape == (blocks.split_k if blocks else km.default_blocks(k, n).split_k, m, n)
        assert_same_bits(got, twin)
        if finite:
            assert_close_to_exact(got.sum(0), x, w)
            assert_close_to_exact(km.w12_matmul_reference(x, enc), x, w)
        else:
            assert np.isnan(np.asarray(got)).any()

    @pytest.mark.parametrize("shape,blocks,groups", [
        ((256, 256), None, {}),
        ((256, 256), W12Blocks(block_n=16, block_k=16, split_k=8), {}),  # tiles narrower than CSR cells
        ((512, 128), W12Blocks(block_n=64, block_k=32, split_k=2), {"group_n": 16, "group_k": 4}),
    ])
    def test_kernel_loader_decodes_every_bit_pattern(self, shape, blocks, groups):
        bits = np.random.default_rng(0).permutation(np.resize(np.arange(65536, dtype=np.uint16), shape))
        enc = jax.device_put(w12.encode(bits.view(jnp.bfloat16), **groups))
        got = km.w12_decode_tiles(enc, blocks=blocks, interpret=self.interpret)
        np.testing.assert_array_equal(np.asarray(got), bits)

    def test_no_exceptions(self):
        w = np.full((64, 64), 0.5, jnp.bfloat16)
        enc = jax.device_put(w12.encode(w))
        assert enc.num_exceptions == 0
        x = jnp.ones((2, 64), jnp.bfloat16)
        got = km.w12_matmul(x, enc, interpret=self.interpret)
        assert_same_bits(got, km.bf16_matmul(x, jnp.asarray(w), interpret=self.interpret))
        assert (np.asarray(got) == 32.0).all()


    @pytest.mark.parametrize("k,n,m,blocks,groups,finite", [CASES[0], CASES[1], CASES[2], CASES[4]])
    def test_swapped_path_bit_identical_to_its_twin(self, k, n, m, blocks, groups, finite):
        """path="mma_t" (y^T = W^T x^T): W12 vs the twin with the same swap, and vs exact products."""
        w = adversarial_weights(k, n, seed=k + n + m, finite=finite)
        enc = jax.device_put(w12.encode(w, **groups))
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
        got = km.w12_matmul_partials(x, enc, blocks=blocks, interpret=self.interpret, swapped=True)
        twin = km.bf16_matmul_partials(x, jnp.asarray(w), blocks=blocks, interpret=self.interpret, swapped=True)
        assert got.shape == twin.shape and got.shape[1:] == (m, n)
        assert_same_bits(got, twin)
        if finite:
            assert_close_to_exact(km.w12_matmul(x, enc, path="mma_t", blocks=blocks, interpret=self.interpret),
                                  x, w)

    @pytest.mark.parametrize("k,n,blocks,finite", [
        (64, 32, None, True),
        (256, 256, W12Blocks(block_n=64, block_k=16, split_k=2), False),
        (512, 512, None, True),
        (384, 256, W12Blocks(block_n=256, block_k=64, split_k=3), True),  # rows span 2 CSR column blocks
    ])
    def test_gemv_path_bit_identical_to_its_twin(self, k, n, blocks, finite):
        """The M = 1 CUDA-core path: W12 vs the same GEMV over bf16, exceptions included."""
        w = adversarial_weights(k, n, seed=k + n, finite=finite)
        enc = jax.device_put(w12.encode(w))
        assert enc.num_exceptions > 0
        x = jnp.asarray(np.random.default_rng(k).standard_normal((1, k)), jnp.bfloat16)
        got = km.w12_gemv_partials(x, enc, blocks=blocks, interpret=self.interpret)
        assert_same_bits(got, km.bf16_gemv_partials(x, jnp.asarray(w), blocks=blocks, interpret=self.interpret))
        full = km.w12_matmul(x, enc, path="gemv", blocks=blocks, interpret=self.interpret)
        assert_same_bits(full, km.bf16_matmul(x, jnp.asarray(w), path="gemv", blocks=blocks,
                                              interpret=self.interpret))
        if finite:
            assert_close_to_exact(full, x, w)

    @pytest.mark.parametrize("m", [1, 16, 64])
    def test_no_exceptions_random_values(self, m):
        """An exception-free matrix with values whose sums depend on order (on the H200 a kernel built
        without the patch loop for such matrices differed from the twin in the last bits at M <= 16)."""
        rng = np.random.default_rng(m)
        w = (rng.choice([-1.0, 1.0], (512, 256)) * rng.uniform(2.0 ** -8, 1.0, (512, 256))).astype(jnp.bfloat16)
        enc = jax.device_put(w12.encode(w))
        assert enc.num_exceptions == 0
        x = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
        got = km.w12_matmul(x, enc, interpret=self.interpret)
        assert_same_bits(got, km.bf16_matmul(x, jnp.asarray(w), interpret=self.interpret))
        assert_close_to_exact(got, x, w)


class TestKernelInterpret(_KernelCases):
    interpret = True


@pytest.mark.gpu
class TestKernelGPU(_KernelCases):
    interpret = False


def test_fallbacks_and_arguments():
    w = adversarial_weights(64, 32, seed=0)
    enc = jax.device_put(w12.encode(w))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.bfloat16)
    ref = km.w12_matmul_reference(x, enc)
    assert_same_bits(km.w12_matmul(x, enc, implementation="xla"), ref)
    assert_same_bits(km.w12_matmul(x.astype(jnp.float32), enc), km.w12_matmul_reference(x.astype(jnp.float32),
                                                                                           enc))
    odd = jax.device_put(w12.encode(adversarial_weights(63, 32, seed=1)))  # odd K: no kernel, exact fallback
    assert_same_bits(km.w12_matmul(x[:, :63], odd), km.w12_matmul_reference(x[:, :63], odd))
    with pytest.raises(ValueError, match="implementation"):
        km.w12_matmul(x, enc, implementation="triton")
    with pytest.raises(ValueError, match="exceptions must be"):
        km.w12_matmul_partials(x, enc, blocks=W12Blocks(exceptions="skip"), interpret=True)
    with pytest.raises(ValueError, match="do not tile"):
        km.w12_matmul_partials(x, enc, blocks=W12Blocks(block_n=48), interpret=True)
    # leading dims are kept
    assert km.w12_matmul(x.reshape(3, 1, 64), enc).shape == (3, 1, 32)


def _w12_struct(k, n, e=1000):
    s = jax.ShapeDtypeStruct
    kh = k // 2
    cells = -(-n // w12.DEFAULT_GROUP_N) * -(-kh // w12.DEFAULT_GROUP_K)
    return w12.W12(sm=s((k, n), jnp.int8), nib=s((kh, n), jnp.uint8), base=s((n,), jnp.uint8),
                   exc_ptr=s((cells + 1,), jnp.int32), exc_row=s((e,), jnp.int32),
                   exc_col=s((e,), jnp.int32), exc_val=s((e,), jnp.uint16), shape=(k, n))


def _cuda_lowering_available() -> bool:
    """Whether this jax can lower for cuda without a GPU (`jit(f).trace(...).lower(lowering_platforms=)`)."""
    try:
        jax.jit(lambda a: a).trace(jax.ShapeDtypeStruct((1,), jnp.float32)).lower(lowering_platforms=("cuda",))
    except Exception:  # noqa: BLE001 - any failure means the API is absent or different
        return False
    return True


@pytest.mark.skipif(not _cuda_lowering_available(), reason="GPU-free cuda lowering unavailable")
@pytest.mark.parametrize("k,n", [(4096, 1024), (4096, 12288), (12288, 4096), (4096, 151936)])
def test_lowers_for_cuda(k, n):
    """GPU-free check that both kernels lower to Triton IR (catches unsupported ops before device time)."""
    s = jax.ShapeDtypeStruct
    b = km.default_blocks(k, n)
    cases = [(functools.partial(km.w12_matmul_partials, blocks=b),
              (s((16, k), jnp.bfloat16), _w12_struct(k, n))),
             (functools.partial(km.bf16_matmul_partials, blocks=b),
              (s((1, k), jnp.bfloat16), s((k, n), jnp.bfloat16))),
             (functools.partial(km.w12_decode_tiles, blocks=b), (_w12_struct(k, n, e=0),)),
             (km.w12_gemv_partials, (s((1, k), jnp.bfloat16), _w12_struct(k, n))),
             (functools.partial(km.w12_matmul_partials, blocks=dataclasses.replace(b, prefetch=False)),
              (s((16, k), jnp.bfloat16), _w12_struct(k, n))),
             (functools.partial(km.w12_matmul_partials, blocks=dataclasses.replace(b, exceptions="branch")),
              (s((16, k), jnp.bfloat16), _w12_struct(k, n))),
             (functools.partial(km.w12_matmul_partials, blocks=b, swapped=True),
              (s((4, k), jnp.bfloat16), _w12_struct(k, n))),
             (km.bf16_gemv_partials, (s((1, k), jnp.bfloat16), s((k, n), jnp.bfloat16)))]
    for i, (fn, args) in enumerate(cases):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower()
        is_w12_mma = i in (0, 2, 4, 5, 6)  # the tensor-core W12 kernels (and the decode-tiles kernel)
        assert ("prmt.b32" in text) == is_w12_mma  # compiled for CUDA, they decode with the PTX


def tiny_bf16_params(cfg, seed: int = 0, std: float = 0.5) -> dict:
    """Random bf16 params from numpy (much faster on CPU than eager `dense.init`); norms are ones."""
    rng = np.random.default_rng(seed)

    def make(name, shape):
        if name.endswith("norm"):
            return jnp.ones(shape, jnp.bfloat16)
        return jnp.asarray(rng.standard_normal(shape) * std, jnp.bfloat16)

    shapes = dense.param_shapes(cfg)
    params = {k: make(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = tuple({k: make(k, v) for k, v in layer.items()} for layer in shapes["layers"])
    return params


def _greedy(monkeypatch, params, cfg, prompt, steps, matmul):
    """Greedy decoding with every linear layer and the LM head routed through `matmul`."""
    monkeypatch.setattr(layers, "linear", matmul)
    monkeypatch.setattr(dense, "linear", matmul)
    monkeypatch.setattr(dense, "lm_head", lambda p, cfg, x: matmul(x, p["lm_head"], out_dtype=jnp.float32))
    fwd = jax.jit(lambda p, tokens, cache: dense.forward(p, cfg, tokens, cache))  # fresh trace per call
    cache = init_cache(cfg, 1, len(prompt) + steps, jnp.bfloat16)
    tokens, out_logits, out_tokens = jnp.asarray([prompt], jnp.int32), [], []
    for _ in range(steps):
        logits, _, cache = fwd(params, tokens, cache)
        cache = cache.commit(tokens.shape[1])
        tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        out_logits.append(np.asarray(logits))
        out_tokens.append(int(tokens[0, 0]))
    return out_tokens, out_logits


def test_end_to_end_greedy_equals_bf16_twin(monkeypatch, tiny_cfg):
    params = tiny_bf16_params(tiny_cfg)
    enc = w12.encode_params(params)
    assert isinstance(enc["layers"][0]["gate"], w12.W12) and isinstance(enc["lm_head"], w12.W12)
    prompt = [3, 17, 42, 9, 100]
    lin = functools.partial(w12.linear, interpret=True, dense_kernel=True)
    tok_w12, log_w12 = _greedy(monkeypatch, enc, tiny_cfg, prompt, 6, lin)
    tok_bf16, log_bf16 = _greedy(monkeypatch, params, tiny_cfg, prompt, 6, lin)
    assert tok_w12 == tok_bf16
    for a, b in zip(log_w12, log_bf16):
        assert_same_bits(a, b)


def test_bench_tiny_smoke(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import bench_w12
    finally:
        sys.path.pop(0)
    out = tmp_path / "w12.json"
    record = bench_w12.main(["--tiny", "--m", "1", "--reps", "2", "--out", str(out)])
    assert out.exists() and record["rows"]
    assert all(r.get("bit_exact") for r in record["rows"] if r["impl"].startswith("w12"))
    assert {r["impl"] for r in record["rows"]} == {"w12", "w12_noexc", "bf16_twin", "xla_bf16"}
    # every product is also close to XLA's (a shared tiling bug would pass the twin check, not this one)
    assert all(r["rel_err_vs_xla"] <= bench_w12.REL_ERR_VS_XLA_MAX and "wrong_vs_xla" not in r
               for r in record["rows"])


def test_bench_other_shapes():
    """`bench_w12.py --shapes KxN,...` times those shapes instead of Qwen3-8B's; a malformed list is refused."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import bench_w12
    finally:
        sys.path.pop(0)
    record = bench_w12.main(["--shapes", "128x64,256x128", "--m", "1", "--reps", "1", "--trials", "1",
                             "--min-bytes", "0", "--no-triton"])
    assert [(r["shape"], r["k"], r["n"], r["impl"]) for r in record["rows"]] == [
        ("128x64", 128, 64, "xla_bf16"), ("256x128", 256, 128, "xla_bf16")]
    with pytest.raises(SystemExit):
        bench_w12.main(["--shapes", "128x"])


def test_bench_profile_table(tmp_path, capsys):
    """`bench_w12.py --table`: rows from recorded profiles, the ratio taken against the faster bf16 path;
    non-default Mosaic variants and unprofiled implementations are left out."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        import bench_w12
    finally:
        sys.path.pop(0)

    def row(impl, wall, busy, kern, mg=None):
        r = {"shape": "q/o", "m": 1, "impl": impl, "us_per_matrix": wall,
             "profile": {"busy_ms_per_step": busy / 1e3, "top": [{"us_median": kern}]}}
        return {**r, "mg": mg} if mg is not None else r

    rec = {"rows": [row("xla_bf16", 16.0, 15.0, 12.0), row("twin_mg", 15.0, 14.0, 10.0, {}),
                    row("w12_mg", 30.0, 14.0, 8.0, {}), row("w12_mg", 1.0, 1.0, 1.0, {"subtile": True}),
                    {"shape": "q/o", "m": 4, "impl": "xla_bf16", "us_per_matrix": 1.0}]}
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    table = bench_w12.profile_table([str(path)])
    assert table[2:] == ["| q/o | 1 | 16.0 / 15.0 / 30.0 | 15.0 / 14.0 / 14.0 | 12.0 / 10.0 / 8.0 | 1.00x | 1.25x |"]
    # --table-w12 picks a recorded W12 variant against the default twin
    table = bench_w12.profile_table([str(path)], {"subtile": True})
    assert table[2:] == ["| q/o | 1 | 16.0 / 15.0 / 1.0 | 15.0 / 14.0 / 1.0 | 12.0 / 10.0 / 1.0 | 14.00x | 10.00x |"]
    # shapes given by --shapes (named KxN) follow Qwen3-8B's, in the records' order
    other = [{**r, "shape": "4096x24576"} for r in rec["rows"][:3]]
    path.write_text(json.dumps({"rows": other + rec["rows"][:3]}))
    assert [line.split(" | ")[0] for line in bench_w12.profile_table([str(path)])[2:]] == ["| q/o", "| 4096x24576"]
    # the closing summary never takes a diagnostic variant (wrong values) as the best W12, nor its
    # inexact check as the row's
    diag = {**row("w12_mg", 0.5, 1.0, 1.0, {"diagnostic": "copies_only"}), "bit_exact": False}
    good = {**row("w12_mg", 20.0, 1.0, 1.0, {}), "bit_exact": True}
    bench_w12.summary([row("xla_bf16", 16.0, 15.0, 12.0), diag, good])
    line = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert line[13] == "20.0" and line[14] == "0.80" and line[-1] == "True"


# ---- the PTX decoder, executed on the CPU -------------------------------------------------------------

def _run_ptx(ptx: str, args: list) -> dict:
    """Execute the straight-line PTX subset of the GPU kernels' decoders (`km._DECODE_PTX`, the Mosaic
    kernel's `_DECODE4_PTX`, `_EXCEPTION_PTX`, `_PATCH_PTX`: mov, and, or, add, mad.lo, shl, shr, prmt,
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


def _pack4(bytes_: np.ndarray) -> np.ndarray:
    """[..., 4 * G] bytes -> [..., G] uint32, element j of each group at byte j (how Triton packs an
    inline-asm operand of 8-bit elements with pack=4)."""
    b = bytes_.astype(np.uint8).reshape(*bytes_.shape[:-1], -1, 4).astype(np.uint32)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


@pytest.mark.parametrize("weights,groups", [("all", {}), ("all", {"group_n": 16, "group_k": 4}),
                                             ("trained", {})])
def test_ptx_decoder_every_bit_pattern(weights, groups):
    """The PTX decode of the GPU kernels, run instruction by instruction on the CPU: each of the 65,536
    bf16 patterns ("all") and a trained-like matrix with 2% exceptions come out exact outside the exception
    list, and every slot equals the elementwise jnp decoder's pre-patch value (so the shared exception
    patch completes both the same way)."""
    if weights == "all":
        bits = np.random.default_rng(1).permutation(np.resize(np.arange(65536, dtype=np.uint16), (512, 128)))
    else:
        bits = adversarial_weights(512, 128, seed=2).view(np.uint16)
    enc = w12.encode(bits.view(jnp.bfloat16), **groups)
    sm, nib, base = np.asarray(enc.sm), np.asarray(enc.nib), np.asarray(enc.base)
    kh = sm.shape[0] // 2
    base_t = np.broadcast_to(base, nib.shape)
    exc = np.zeros(bits.shape, bool)
    exc[np.asarray(enc.exc_row), np.asarray(enc.exc_col)] = True
    for half, ptx, codes in ((0, km._DECODE_PTX_LO, nib & 0xF), (1, km._DECODE_PTX_HI, nib >> 4)):
        rows = slice(half * kh, (half + 1) * kh)
        regs = _run_ptx(ptx, [None, None, _pack4(sm[rows].view(np.uint8)), _pack4(nib), _pack4(base_t)])
        r0, r1 = regs["$0"], regs["$1"]
        got = np.stack([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], axis=-1).reshape(kh, -1).astype(np.uint16)
        want = ((sm[rows].astype(np.int32) & 0x807F) | ((codes.astype(np.int32) + base) << 7)).astype(np.uint16)
        np.testing.assert_array_equal(got, want)
        keep = ~exc[rows]
        np.testing.assert_array_equal(got[keep], bits[rows][keep])
        # the in-window values (decoded by the PTX alone) cover every sign|mantissa byte
        assert len(np.unique(sm[rows][keep])) == 256
        if weights == "trained":
            assert keep.mean() > 0.95


def test_decode_argument():
    enc = jax.device_put(w12.encode(adversarial_weights(64, 32, seed=0)))
    x = jnp.ones((1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="decode must be"):
        km.w12_matmul_partials(x, enc, interpret=True, decode="fast")
    with pytest.raises(ValueError, match="not in interpret mode"):
        km.w12_matmul_partials(x, enc, interpret=True, decode="asm")


def test_default_blocks_branch_on_exceptions_above_m32():
    """Default blocks patch exceptions behind a per-step branch only where it was measured faster (x padded
    to 64 rows); the case (512, 128, 64, None) of CASES runs that default through the kernel."""
    assert km.default_blocks(4096, 12288, m=64).exceptions == "branch"
    assert km.default_blocks(4096, 12288, m=33).exceptions == "branch"
    assert km.default_blocks(4096, 12288, m=32).exceptions == "loop"
    assert km.default_blocks(4096, 12288).exceptions == "loop"
