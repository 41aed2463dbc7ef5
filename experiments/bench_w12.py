"""Fused W12 decode-matmul vs XLA's bf16 dot vs the kernel's bf16 twin, per Qwen3-8B linear shape and M.

    PYTHONPATH=. python3 experiments/bench_w12.py --out w12.json        # H200: all shapes, M in 1..64
    PYTHONPATH=. python3 experiments/bench_w12.py --sweep --only q/o    # + block-size variants
    PYTHONPATH=. python3 experiments/bench_w12.py --tiny                # CPU smoke (interpret mode)

Design choices:
- Each measurement is a chain of products over `n` distinct matrices of one shape inside one jit, each
  output (cut or tiled back to K, rescaled) feeding the next: distinct matrices keep the L2 from serving
  repeats, the dependency matches a decode step, and XLA cannot merge the products. Time per matrix =
  chain time / n (launch gaps included, as in a real step); median over `--trials` pipelined runs.
- One random N(0, 0.02) bf16 matrix per shape is encoded on the device (`w12.encode_device`); its
  exception rate, ~7e-5, is close to trained weights'. The chain's other matrices are device copies:
  distinct buffers, same content.
- Bandwidth counts the bytes each implementation must read: 2 per weight for bf16, everything stored for
  W12 (planes, bases, CSR, exceptions). "bf16-eq" is 2 bytes/weight over W12's time: the speed-up as a
  bandwidth, comparable with the bf16 columns and the card's copy bandwidth.
- `w12_noexc` times the same planes with the exception list dropped (every CSR range empty, so no tile
  patches anything): w12 vs w12_noexc is the price of the exceptions themselves.
- `--swapped` adds `w12_t` / `twin_t`: the kernel computing y^T = W^T x^T, so the decoded weight tile
  is the MMA's first operand (the tensor cores can take it from registers; the second operand must be
  in shared memory, which is where the default path has to put the decoded tile) and x's rows fill the
  MMA's narrow dimension.
- `--mosaic` adds `w12_mg` / `twin_mg`: the Mosaic GPU kernel (`pallas_kernels/w12_mosaic.py`, planes in
  N-major order, made once per matrix by `to_nk`) and its twin over W^T, for M <= 64.
- `--diagnose` adds `w12_loadonly`: the same kernel loading the same planes, with the decode replaced by
  one XOR per weight and no exception patching (its outputs are meaningless and unchecked). Its time
  against w12_noexc is the cost of the decode arithmetic; against the twin, the cost of loading 12-bit
  planes into registers instead of bf16 tiles.
- Every (shape, M) checks W12 against the twin bit for bit (NaN as NaN) on the device itself: the GPU
  run doubles as the losslessness test of compiled code.
- No hydra, no specpilot.bench: a self-contained script that runs in one device call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import w12_matmul as km  # noqa: E402
from pallas_kernels import w12_mosaic as mk  # noqa: E402
from specpilot import bench  # noqa: E402
from specpilot.bench import make_chain  # noqa: E402
from specpilot.formats import w12  # noqa: E402

QWEN3_8B = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288), "down": (12288, 4096),
            "lm_head": (4096, 151936)}
TINY = {"tiny": (256, 512)}
NO_BLOCKS = ("xla_bf16", "twin_mg", "w12_mg")  # implementations without W12Blocks
SWEEP = [{}, {"block_k": 16}, {"block_k": 64}, {"block_n": 64}, {"num_warps": 8}, {"num_stages": 2},
         {"num_stages": 4}, {"split": 0.5}, {"split": 2}]


def edit_blocks(base: km.W12Blocks, edit: dict, k: int, n: int) -> km.W12Blocks:
    edit = dict(edit)
    if "split" in edit:
        edit["split_k"] = max(1, int(base.split_k * edit.pop("split")))
    b = dataclasses.replace(base, **edit)
    km.check_blocks(k, n, b)
    return b


def timed(fn, reps: int, trials: int) -> float:
    """Median over trials of (seconds per call, `reps` calls pipelined, one sync)."""
    jax.block_until_ready(fn())
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        last = None
        for _ in range(reps):
            last = fn()
        jax.block_until_ready(last)
        out.append((time.perf_counter() - t0) / reps)
    return statistics.median(out)


def profile_chain(chain, x, ws, count: int, reps: int = 3) -> dict | None:
    """Kernel durations on the device for `reps` runs of a compiled chain (JAX profiler, Perfetto trace),
    per matrix: busy (kernels) against span (first kernel start to last end), and each kernel's
    min/median/max per call: whether a slow time is the kernel itself, varying, or the gaps between."""
    jax.block_until_ready(chain(x, ws))
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(reps):
                    out = chain(x, ws)
                jax.block_until_ready(out)
            return bench.kernel_summary(d, reps * count, top=6)
        except Exception as e:  # noqa: BLE001 - profiling is evidence, never fatal
            return {"error": repr(e)[:500]}


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Bytes read + written per second by an elementwise XOR over nbytes of uint32 (the card's ceiling)."""
    x = jnp.zeros(nbytes // 4, jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    return 2 * x.size * 4 / timed(lambda: f(x), reps, 3)


# The largest relative error (Frobenius) a product may have against XLA's dot before the row is flagged
# WRONG: every path sums the same bf16 products in float32, in its own order (the recorded rows of exact
# kernels sit below 1e-5), so 1e-2 only catches a wrong product, e.g. a K split that dropped steps from
# W12 and its twin alike (which the bit-for-bit check against the twin cannot see; docs/performance.md,
# thirteenth pass). Rows that multiply other values by design (exceptions dropped, diagnostics) are not
# checked.
REL_ERR_VS_XLA_MAX = 1e-2


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return bool(np.array_equal(a[keep].view(np.uint32), b[keep].view(np.uint32)))


def bench_shape(name, k, n, ms, args, interpret, copy_bw, record):
    count = max(2, min(64, math.ceil(args.min_bytes / (2 * k * n))))
    w_bf16 = jax.jit(lambda key: (0.02 * jax.random.normal(key, (k, n), jnp.float32)).astype(jnp.bfloat16))(
        jax.random.PRNGKey(0))
    t0 = time.perf_counter()
    enc = jax.block_until_ready(w12.encode_device(w_bf16))
    enc_s = time.perf_counter() - t0
    st = w12.stats(enc)
    ws_bf16 = [w_bf16] + [jnp.copy(w_bf16) for _ in range(count - 1)]
    ws_w12 = [enc] + [jax.tree.map(jnp.copy, enc) for _ in range(count - 1)]
    # The same planes with the exception list dropped (a valid W12 of a nearby matrix): the kernel then
    # patches nothing, so w12 vs w12_noexc is the cost of the exceptions.
    none = jnp.zeros((0,), jnp.int32)
    enc_clean = dataclasses.replace(enc, exc_ptr=jnp.zeros_like(enc.exc_ptr), exc_row=none, exc_col=none,
                                    exc_val=jnp.zeros((0,), jnp.uint16))
    clean = jax.jit(w12.decode_jnp)(enc_clean)
    ws_clean = [enc_clean] + [jax.tree.map(jnp.copy, enc_clean) for _ in range(count - 1)]
    bytes_clean = w12.storage_bytes(enc_clean)["total"]
    bytes_w12 = w12.storage_bytes(enc)["total"]
    print(f"{name}: [{k}, {n}] x{count} matrices, {st['bits_per_weight']:.4f} bits/weight, exception rate "
          f"{st['exception_rate']:.2e}, encode {enc_s:.1f} s", flush=True)
    base_blocks = km.default_blocks(k, n)
    variants = block_variants(base_blocks, k, n) if args.sweep else [None]
    for edit in parse_edits(args.edits):
        b = edit_blocks(base_blocks, edit, k, n)
        if b not in variants:
            variants.append(b)
    ws_nk = ws_t = None
    twin_of = {}  # a Mosaic variant's label -> its twin's label
    for m in ms:
        x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.bfloat16)
        ref = jnp.einsum("mk,kn->mn", x, w_bf16, preferred_element_type=jnp.float32)
        impls = [("xla_bf16", None, lambda xx, w: jnp.einsum("mk,kn->mn", xx, w,
                                                              preferred_element_type=jnp.float32), ws_bf16)]
        for b in [] if args.no_triton else variants:
            impls.append(("bf16_twin", b, kernel_mm(km.bf16_matmul, b, interpret), ws_bf16))
            impls.append(("w12", b, kernel_mm(km.w12_matmul, b, interpret), ws_w12))
            impls.append(("w12_noexc", b, kernel_mm(km.w12_matmul, b, interpret), ws_clean))
            if args.diagnose:
                impls.append(("w12_loadonly", b, diagnostic_mm(b, interpret, diagnostic_load_only=True), ws_w12))
                impls.append(("w12_nopatch", b, diagnostic_mm(b, interpret, diagnostic_no_patch=True), ws_clean))
            if args.jnp_decode and not interpret:  # the elementwise decoder the PTX one replaced
                impls.append(("w12_jnp", b, kernel_mm(functools.partial(km.w12_matmul, decode="jnp"), b,
                                                      interpret), ws_w12))
        if args.swapped:  # y^T = W^T x^T: the decoded tile as the MMA's register operand
            impls.append(("twin_t", None, kernel_mm(km.bf16_matmul, None, interpret, "mma_t"), ws_bf16))
            impls.append(("w12_t", None, kernel_mm(km.w12_matmul, None, interpret, "mma_t"), ws_w12))
        if args.mosaic and m <= max(mk.MP_CHOICES):  # the Mosaic GPU kernel (N-major planes) and its twin
            if ws_t is None:
                ws_nk = {}  # (block_k, packed) -> N-major planes with the exception slots of that step size
                ws_t = [jnp.copy(w.T) for w in ws_bf16]
                ws_t_tiled = {}  # (block_k, adjacent) -> the twin's weights stored tile by tile
            twins_timed = set()
            for mg in parse_edits(args.mg_edits) or [{}]:
                mg_key = tuple(sorted(mg.items()))  # the variant's label and its pairing with its twin
                bk = int(mg.get("block_k", 0)) or mk.default_block_k(k, n)  # the kernel's default step for this shape
                pack = mg.get("planes", "packed") == "packed"
                mma = bool(mg.get("mma", mk.default_mma(k, n))) and pack  # planes packed in the wgmma register order
                adj = bool(mg.get("adjacent", False)) and pack  # adjacent row blocks per step (and in the twin)
                tiled = bool(mg.get("tiled", False)) and pack  # each step's tile contiguous (and in the twin)
                xor = bool(mg.get("xor_chunks", False)) and tiled  # tiles stored in `chunk_order`
                if (bk, pack, mma, adj, tiled, xor) not in ws_nk:
                    ws_nk[bk, pack, mma, adj, tiled, xor] = [
                        mk.to_nk(e, block_k=bk, pack=pack, mma=mma, adjacent=adj, tiled=tiled, xor_chunks=xor)
                        for e in ws_w12]
                twin_opts = {key: v for key, v in mg.items()
                             if key in ("block_k", "stages", "split", "fold_x", "adjacent", "mp", "pad_x",
                                        "sum_splits_in_kernel", "tiled", "halves", "auto_barriers")}
                if mg.get("subtile"):  # 64-row sub-steps: the twin at block_k 64, with W12's split
                    twin_opts.update(block_k=64, split=int(mg.get("split", 0)) or mk.default_split(k, n, bk))
                if "twin_a" in mg:  # the twin's A operand ("registers": its bf16 tiles through registers)
                    twin_opts["a_operand"] = mg.pop("twin_a")
                twin_key = twin_of[mg_key] = tuple(sorted(twin_opts.items()))
                if twin_key not in twins_timed:  # each distinct twin once; variants share it
                    twins_timed.add(twin_key)
                    if twin_opts.get("tiled") and (bk, adj) not in ws_t_tiled:  # the twin's tiles, contiguous
                        ws_t_tiled[bk, adj] = [mk.tile_twin(w, bk, adj) for w in ws_t]
                    impls.append(("twin_mg", twin_key, mosaic_mm(mk.bf16_mosaic_partials, interpret, twin_opts),
                                  ws_t_tiled[bk, adj] if twin_opts.get("tiled") else ws_t))
                kernel_opts = {key: v for key, v in mg.items()
                               if key not in ("mma", "adjacent", "tiled", "xor_chunks")}  # packing
                impls.append(("w12_mg", mg_key, mosaic_mm(mk.w12_mosaic_partials, interpret, kernel_opts),
                              ws_nk[bk, pack, mma, adj, tiled, xor]))
        if m == 1 and args.gemv:  # the CUDA-core path and its twin
            for gb in gemv_variants(k, n, args.sweep):
                impls.append(("twin_gemv", gb, kernel_mm(km.bf16_matmul, gb, interpret, "gemv"), ws_bf16))
                impls.append(("w12_gemv", gb, kernel_mm(km.w12_matmul, gb, interpret, "gemv"), ws_w12))
        outs = {}
        for impl, b, mm, ws in impls:
            row = {"shape": name, "k": k, "n": n, "m": m, "impl": impl, "matrices": count,
                   "blocks": None if impl in NO_BLOCKS else dataclasses.asdict(b or km.default_blocks(k, n, m=m))}
            if impl in ("twin_mg", "w12_mg"):
                row["mg"] = dict(b)
            try:
                t0 = time.perf_counter()
                chain = make_chain(k, mm).lower(x, ws).compile()
                row["compile_s"] = time.perf_counter() - t0
                per = timed(lambda: chain(x, ws), args.reps, args.trials) / count
                if any(impl.startswith(prefix) for prefix in args.profile):
                    prof = row["profile"] = profile_chain(chain, x, ws, count) or {}
                    top = prof.get("top") or [{}]
                    print(f"  M={m:3d} {impl} profile: busy {prof.get('busy_ms_per_step', float('nan')) * 1e3:.1f}"
                          f" of span {prof.get('span_ms_per_step', float('nan')) * 1e3:.1f} us per matrix; "
                          f"top kernel {top[0].get('name', '?')[:40]} us min/median/max "
                          f"{top[0].get('us_min', float('nan')):.1f}/{top[0].get('us_median', float('nan')):.1f}/"
                          f"{top[0].get('us_max', float('nan')):.1f}", flush=True)
                y = jax.jit(mm)(x, ws[0])
                nbytes = {"w12": bytes_w12, "w12_jnp": bytes_w12, "w12_mg": bytes_w12, "w12_gemv": bytes_w12,
                          "w12_t": bytes_w12, "w12_noexc": bytes_clean, "w12_loadonly": bytes_clean,
                          "w12_nopatch": bytes_clean}.get(impl, 2 * k * n)
                if impl == "w12_mg" and ws[0].slot_k:  # the slot table is read too (the CSR is not)
                    nbytes += ws[0].slots.size * 4
                row.update(us_per_matrix=per * 1e6, bytes=nbytes, tb_s=nbytes / per / 1e12,
                           bf16_eq_tb_s=2 * k * n / per / 1e12, pct_copy=100 * nbytes / per / copy_bw,
                           rel_err_vs_xla=float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)))
                meaningless = impl in ("w12_loadonly", "w12_noexc", "w12_nopatch") or "diagnostic" in row.get("mg", {})
                if not meaningless and not row["rel_err_vs_xla"] <= REL_ERR_VS_XLA_MAX:  # also NaN
                    row["wrong_vs_xla"] = True
                    print(f"  M={m:3d} {impl} WRONG: relative error {row['rel_err_vs_xla']:.3g} against XLA's "
                          f"product (at most {REL_ERR_VS_XLA_MAX})", flush=True)
                if impl == "w12":
                    row.update(bits_per_weight=st["bits_per_weight"], exception_rate=st["exception_rate"])
                    row["bit_exact"] = same_bits(y, outs.get(("bf16_twin", b)))
                if impl == "w12_jnp":
                    row["bit_exact"] = same_bits(y, outs.get(("bf16_twin", b)))
                if impl == "w12_gemv":
                    row["bit_exact"] = same_bits(y, outs.get(("twin_gemv", b)))
                if impl == "w12_mg":
                    row["bit_exact"] = same_bits(y, outs.get(("twin_mg", twin_of[b])))
                if impl == "w12_t":
                    row["bit_exact"] = same_bits(y, outs.get(("twin_t", b)))
                if impl in ("w12_noexc", "w12_nopatch"):
                    twin_clean = jax.jit(kernel_mm(km.bf16_matmul, b, interpret))(x, clean)
                    row["bit_exact"] = same_bits(y, twin_clean)
                outs[(impl, b)] = y
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
                row["error"] = repr(e)[:400]
                print(f"  M={m:3d} {impl:9s} ERROR {row['error'][:200]}", flush=True)
            record["rows"].append(row)
        _print_m(record["rows"], name, m)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)


def kernel_mm(fn, blocks, interpret, path="mma"):
    def mm(x, w):
        return fn(x, w, implementation="pallas", path=path, blocks=blocks, interpret=interpret)
    return mm


GEMV_SWEEP = [{}, {"block_n": 512}, {"block_n": 2048}, {"block_k": 4}, {"block_k": 16}, {"num_warps": 8},
              {"num_stages": 2}, {"split": 0.5}, {"split": 2}]


def gemv_variants(k: int, n: int, sweep: bool) -> list:
    base = km.default_gemv_blocks(k, n)
    out = [base]
    for edit in GEMV_SWEEP[1:] if sweep else []:
        edit = dict(edit)
        if "split" in edit:
            edit["split_k"] = max(1, int(base.split_k * edit.pop("split")))
        b = dataclasses.replace(base, **edit)
        try:
            km.check_gemv_blocks(k, n, b)
        except ValueError:
            continue
        if b not in out:
            out.append(b)
    return out


def diagnostic_mm(blocks, interpret, **flag):
    """The W12 kernel with one diagnostic switch of `w12_matmul_partials`: `diagnostic_load_only` (the
    decode replaced by one XOR per weight: wrong values) or `diagnostic_no_patch` (compiled without the
    exception patch loop: exact only for exception-free matrices)."""
    def mm(x, w):
        return km.sum_splits(km.w12_matmul_partials(x, w, blocks=blocks, interpret=interpret, **flag))
    return mm


def mosaic_mm(partials_fn, interpret, options=None):
    """A Mosaic GPU kernel's partials summed in the fixed order, as runs do (`w12_mosaic.sum_rows`: the
    untransposed splits added, then the sum transposed); `options`: block_k, stages, split, ..."""
    options = {key: v if isinstance(v, str) else int(v) for key, v in (options or {}).items()}

    def mm(x, w):
        return mk.sum_rows(partials_fn(x, w, interpret=interpret, raw=True, **options), x.shape[0],
                           bool(options.get("out_rows")))
    return mm


def parse_edits(text: str) -> list:
    """"prefetch=1,block_k=64;exceptions=branch" -> [{"prefetch": True, "block_k": 64},
    {"exceptions": "branch"}]."""
    out = []
    for group in filter(None, text.split(";")):
        edit = {}
        for item in group.split(","):
            key, value = item.split("=")
            if key in ("prefetch", "fold_x", "warp_specialized", "subtile", "mma", "adjacent", "pad_x",
                       "sum_splits_in_kernel", "tiled", "early_base", "wide_swizzle", "plain_planes",
                       "owner_branch", "xor_chunks", "halves", "auto_barriers", "row_branch", "out_rows"):
                edit[key] = bool(int(value))
            elif key in ("exceptions", "diagnostic", "planes", "a_operand", "twin_a", "decode"):
                edit[key] = value
            else:  # block_k, stages, split, mp, prefetch_slots, ...
                edit[key] = float(value) if key == "split" else int(value)
        out.append(edit)
    return out


def block_variants(base: km.W12Blocks, k: int, n: int) -> list:
    """The valid, distinct edits of SWEEP (default first as None)."""
    out = [None]
    for edit in SWEEP[1:]:
        try:
            b = edit_blocks(base, edit, k, n)
        except ValueError:
            continue
        if b != base and b not in out:
            out.append(b)
    return out


def _print_m(rows, name, m):
    rows = [r for r in rows if r["shape"] == name and r["m"] == m and "us_per_matrix" in r]
    xla = next((r["us_per_matrix"] for r in rows if r["impl"] == "xla_bf16"), float("nan"))
    for r in rows:
        b = r["blocks"]
        label = r["impl"] + (" " + ",".join(f"{key}{v}" for key, v in r["mg"].items()) if r.get("mg") else "")
        label += ("" if b is None else f" bn{b['block_n']} bk{b['block_k']} s{b['split_k']} "
                                                   f"w{b['num_warps']} st{b['num_stages']}"
                             + (" pf" if b.get("prefetch") else "")
                             + (" br" if b.get("exceptions") == "branch" else ""))
        extra = f" exact={r['bit_exact']}" if "bit_exact" in r else ""
        print(f"  M={m:3d} {label:38s} {r['us_per_matrix']:9.2f} us {r['tb_s']:6.3f} TB/s "
              f"({r['pct_copy']:5.1f}% copy) bf16-eq {r['bf16_eq_tb_s']:6.3f} TB/s "
              f"x{xla / r['us_per_matrix']:5.2f} vs xla{extra}", flush=True)


def summary(rows) -> None:
    """Best w12 and twin per (shape, M) against XLA (the Mosaic kernel's diagnostic variants left out: they
    are timing probes with wrong values)."""
    print(f"\n{'shape':8s} {'M':>3s} {'xla us':>8s} {'twin us':>8s} {'w12 us':>8s} {'jnp us':>8s} {'noexc us':>8s} "
          f"{'load us':>8s} {'tgemv us':>8s} {'wgemv us':>8s} {'twin_t us':>9s} {'w12_t us':>8s} "
          f"{'twin_mg us':>10s} {'w12_mg us':>9s} {'w12/xla':>8s} "
          f"{'w12/twin':>8s} exact")
    keys = sorted({(r["shape"], r["m"]) for r in rows}, key=lambda t: (t[0], t[1]))
    rows = [r for r in rows if not (r.get("mg") or {}).get("diagnostic")]
    for s, m in keys:
        best = {}
        for r in rows:
            if (r["shape"], r["m"]) == (s, m) and "us_per_matrix" in r:
                if r["impl"] not in best or r["us_per_matrix"] < best[r["impl"]]["us_per_matrix"]:
                    best[r["impl"]] = r
        t = {i: best[i]["us_per_matrix"] if i in best else float("nan")
             for i in ("xla_bf16", "bf16_twin", "w12", "w12_jnp", "w12_noexc", "w12_loadonly", "twin_gemv", "w12_gemv",
                       "twin_t", "w12_t", "twin_mg", "w12_mg")}
        best_w12 = min((v for v in (t["w12"], t["w12_gemv"], t["w12_t"], t["w12_mg"]) if not math.isnan(v)),
                       default=float("nan"))
        exact = all(r.get("bit_exact", True) for r in rows if (r["shape"], r["m"]) == (s, m))
        print(f"{s:8s} {m:3d} {t['xla_bf16']:8.1f} {t['bf16_twin']:8.1f} {t['w12']:8.1f} {t['w12_jnp']:8.1f} "
              f"{t['w12_noexc']:8.1f} {t['w12_loadonly']:8.1f} {t['twin_gemv']:8.1f} {t['w12_gemv']:8.1f} "
              f"{t['twin_t']:9.1f} {t['w12_t']:8.1f} {t['twin_mg']:10.1f} {t['w12_mg']:9.1f} "
              f"{t['xla_bf16'] / best_w12:8.2f} {t['bf16_twin'] / best_w12:8.2f} {exact}")


def profile_table(paths: list[str], w12_variant: dict | None = None, twin_variant: dict | None = None) -> list[str]:
    """Markdown rows from recorded runs with `--profile xla,twin_mg,w12_mg`: per (shape, M), the wall,
    busy and main-kernel time of XLA, the Mosaic twin and Mosaic W12 (default variants, or the W12 and twin
    variants recorded with the `--mg-edits` options `w12_variant` and the twin's options `twin_variant`,
    e.g. {"tiled": True}), and W12 against the faster bf16 path on busy and on kernel time
    (docs/performance.md's layer tables)."""
    defaults = ({}, {"block_k": 64})
    cells = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                mg = r.get("mg") or {}
                if w12_variant and r["impl"] == "w12_mg":
                    wanted = [w12_variant]
                elif twin_variant and r["impl"] == "twin_mg":
                    wanted = [twin_variant]
                else:
                    wanted = defaults
                if "us_per_matrix" not in r or mg not in wanted:
                    continue
                prof = r.get("profile") or {}
                top = (prof.get("top") or [{}])[0]
                busy = 1e3 * prof.get("busy_ms_per_step", math.nan)
                cells[r["shape"], r["m"], r["impl"]] = (r["us_per_matrix"], busy, top.get("us_median", math.nan))
    out = ["| shape | M | wall: XLA / twin / W12 (us) | busy: XLA / twin / W12 (us) | kernel: XLA / twin / W12 (us) "
           "| W12 vs best bf16, busy | kernel |", "| --- | ---: | --- | --- | --- | ---: | ---: |"]
    named = {key[0] for key in cells}  # Qwen3-8B's in their order, then --shapes' (KxN) in the records' order
    shapes = [s for s in QWEN3_8B if s in named] + list(dict.fromkeys(
        key[0] for key in cells if key[0] not in QWEN3_8B))
    for name in shapes:
        for m in sorted({key[1] for key in cells if key[0] == name}):
            got = [cells.get((name, m, i)) for i in ("xla_bf16", "twin_mg", "w12_mg")]
            if None in got:
                continue
            x, t, w = got
            cols = [" / ".join(f"{v[q]:.1f}" for v in got) for q in range(3)]
            out.append(f"| {name} | {m} | {cols[0]} | {cols[1]} | {cols[2]} | {min(x[1], t[1]) / w[1]:.2f}x "
                       f"| {min(x[2], t[2]) / w[2]:.2f}x |")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke: one small shape, interpret mode")
    p.add_argument("--only", default="", help="comma list of shape names")
    p.add_argument("--m", default="1,4,8,16,32,64", help="comma list of activation rows")
    p.add_argument("--min-bytes", type=float, default=1.0e9, help="bf16 bytes of weights per chain")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time block-size variants of the kernels")
    p.add_argument("--swapped", action="store_true", help="also time path mma_t (y^T = W^T x^T) and its twin")
    p.add_argument("--gemv", action="store_true", help="at M = 1 also time the CUDA-core GEMV path and its twin")
    p.add_argument("--mosaic", action="store_true",
                   help="also time the Mosaic GPU kernel (w12_mg) and its twin (twin_mg), M <= 64")
    p.add_argument("--mg-edits", default="",
                   help="variants of the Mosaic kernel (with --mosaic), e.g. 'block_k=128;stages=4,split=1;"
                        "exceptions=csr;diagnostic=no_patch;mma=1' (split: the number of K splits, not a factor; "
                        "mma: planes packed in the wgmma register order, w12_mosaic.mma_order)")
    p.add_argument("--no-triton", action="store_true",
                   help="skip the Triton kernels (bf16_twin, w12, w12_noexc): XLA and the Mosaic kernels only")
    p.add_argument("--edits", default="", help="extra block variants, e.g. 'prefetch=1;prefetch=1,block_k=64'")
    p.add_argument("--jnp-decode", action="store_true",
                   help="also time w12_jnp: the kernel with the elementwise decoder instead of the PTX one")
    p.add_argument("--diagnose", action="store_true",
                   help="also time w12_loadonly: the kernel's loads + matmul without the decode arithmetic")
    p.add_argument("--profile", default="",
                   help="comma list of implementation-name prefixes (e.g. 'w12_mg,twin_mg') whose chains are also "
                        "traced: kernel time per call (min/median/max) and busy vs span per matrix")
    p.add_argument("--shapes", default="",
                   help="comma list of KxN weight shapes to time instead of Qwen3-8B's (e.g. '1024x12288,8192x12288'); "
                        "--only then takes their names as given")
    p.add_argument("--out", default="")
    p.add_argument("--table", default="",
                   help="comma list of recorded --out files (run with --profile xla,twin_mg,w12_mg): print the "
                        "wall / busy / kernel table of docs/performance.md from them and exit")
    p.add_argument("--table-w12", default="",
                   help="with --table: the W12 variant's --mg-edits options (one group, e.g. 'mma=1'), "
                        "against the default twin")
    p.add_argument("--table-twin", default="",
                   help="with --table: the twin variant's options as recorded (one group, e.g. 'tiled=1'); "
                        "default: the default twin")
    args = p.parse_args(argv)
    if args.table:
        variant = parse_edits(args.table_w12)
        twin = parse_edits(args.table_twin)
        print("\n".join(profile_table(args.table.split(","), variant[0] if variant else None,
                                       twin[0] if twin else None)))
        return {}
    args.profile = [s for s in args.profile.split(",") if s]
    interpret = jax.default_backend() == "cpu"
    shapes = TINY if args.tiny else QWEN3_8B
    if args.shapes:  # other [K, N] shapes, in the order given (e.g. a sweep of K at one N)
        try:
            shapes = {f"{k}x{n}": (int(k), int(n)) for k, n in (item.split("x") for item in args.shapes.split(","))}
        except ValueError:
            p.error(f"--shapes takes a comma list of KxN, got {args.shapes!r}")
    ms = [1, 16] if args.tiny and args.m == p.get_default("m") else [int(v) for v in args.m.split(",")]
    if args.tiny:
        args.min_bytes, args.trials = 0, min(args.trials, 2)
    copy_bw = copy_bandwidth((16 << 20) if interpret else (2 << 30))
    d = jax.devices()[0]
    record = {"device": {"platform": d.platform, "kind": getattr(d, "device_kind", str(d)),
                         "jax": jax.__version__}, "copy_bw": copy_bw, "interpret": interpret, "rows": []}
    print(f"{record['device']}  copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    only = [s for s in args.only.split(",") if s]
    for name, (k, n) in shapes.items():
        if not only or name in only:
            bench_shape(name, k, n, ms, args, interpret, copy_bw, record)
    summary(record["rows"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
