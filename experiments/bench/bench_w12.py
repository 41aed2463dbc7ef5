"""W12 kernels vs their bf16 twins vs XLA's bf16 dot, per Qwen3-8B linear shape and M.

    PYTHONPATH=. python3 experiments/bench/bench_w12.py --out w12.json                     # H200: Mosaic, every shape
    PYTHONPATH=. python3 experiments/bench/bench_w12.py --kernel mosaic,triton --m 1,16    # both kernels
    PYTHONPATH=. python3 experiments/bench/bench_w12.py --shape tiny --m 1,16              # CPU smoke (interpreters)
    PYTHONPATH=. python3 experiments/bench/bench_w12.py --table mg68.json,mg69.json        # a markdown table

Design notes: docs/design/bench.md.
"""

from __future__ import annotations

import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels import w12_matmul as km
from pallas_kernels import w12_mosaic as mk
from specpilot.harness import bench
from specpilot.harness.bench import make_chain
from specpilot.formats import w12

QWEN3_8B = {"q/o": (4096, 4096), "k/v": (4096, 1024), "gate/up": (4096, 12288), "down": (12288, 4096),
            "lm_head": (4096, 151936)}
# the products a run makes (q/k/v and gate/up fused, `dense.fuse_projections`), the skinny-product goal's shapes
QWEN3_8B_RUN = {"8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 24576), "8b.down": (12288, 4096),
                "8b.lm_head": (4096, 151936)}
QWEN3_4B_RUN = {"4b.qkv": (2560, 6144), "4b.o": (4096, 2560), "4b.gate_up": (2560, 19456), "4b.down": (9728, 2560),
                "4b.lm_head": (2560, 151936)}
SHAPE_SETS = {"all": QWEN3_8B, "qwen3-8b": QWEN3_8B_RUN, "qwen3-4b": QWEN3_4B_RUN}
TINY = {"tiny": (256, 512)}
KERNELS = ("mosaic", "triton")  # the implementations with a W12 kernel and a bf16 twin

# The largest relative error (Frobenius) a product may have against XLA's dot before the row is flagged
# WRONG: every path sums the same bf16 products in float32, in its own order (the recorded rows of exact
# kernels sit below 1e-5), so 1e-2 only catches a wrong product, e.g. a K split that dropped steps from
# W12 and its twin alike (which the bit-for-bit check against the twin cannot see).
REL_ERR_VS_XLA_MAX = 1e-2


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


def profile_chain(chain, x, ws, count: int, reps: int = 3) -> dict:
    """Kernel durations on the device for `reps` runs of a compiled chain (JAX profiler, Perfetto trace),
    per matrix: busy (kernels) against span, and each kernel's min/median/max per call."""
    jax.block_until_ready(chain(x, ws))

    def run():
        out = None
        for _ in range(reps):
            out = chain(x, ws)
        return out

    return bench.traced_kernels(run, reps * count, top=6)


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Bytes read + written per second by an elementwise XOR over nbytes of uint32 (the card's ceiling)."""
    x = jnp.zeros(nbytes // 4, jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    return 2 * x.size * 4 / timed(lambda: f(x), reps, 3)


def kernel_fields(profile: dict, nbytes: int, copy_bw: float) -> dict:
    """The product's own kernel (the profile's longest per call) against copy bandwidth: the skinny-product
    goal's measure (the chain's glue between matrices excluded)."""
    top = (profile.get("top") or [{}])[0]
    us = top.get("us_median")
    if not us:
        return {}
    return {"kernel_us": us, "kernel_name": top.get("name", ""), "kernel_pct_copy": 100 * nbytes / (us * 1e-6) / copy_bw}


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return bool(np.array_equal(a[keep].view(np.uint32), b[keep].view(np.uint32)))


def layout_bytes(w) -> int:
    if isinstance(w, mk.W12NK):
        return mk.storage_bytes(w)["total"]
    if isinstance(w, w12.W12):
        return w12.storage_bytes(w)["total"]
    return 2 * int(np.prod(w.shape))


def kernel_rows(impl: str, config, w_bf16, enc, rows: int, interpret: bool):
    """(twin row, W12 row) of one kernel: (name, product function, weight layout) each."""
    if impl == "mosaic":
        c = dispatch.OpChoice(("mosaic",), config)
        return [(f"{kind}_mosaic", lambda x, w: mk.mosaic_matmul(x, w, c.config or mk.W12MosaicConfig()),
                 dispatch.prepare_weight(src, c, rows)) for kind, src in (("twin", w_bf16), ("w12", enc))]
    cfg = config or km.W12TritonConfig(interpret=interpret)
    return [("twin_triton", lambda x, w: km.bf16_matmul(x, w, cfg), w_bf16),
            ("w12_triton", lambda x, w: km.w12_matmul(x, w, cfg), enc)]


def bench_shape(name, k, n, args, interpret, copy_bw, record):
    count = max(2, min(64, math.ceil(args.min_bytes / (2 * k * n))))
    w_bf16 = jax.jit(lambda key: (0.02 * jax.random.normal(key, (k, n), jnp.float32)).astype(jnp.bfloat16))(
        jax.random.PRNGKey(0))
    t0 = time.perf_counter()
    enc = jax.block_until_ready(w12.encode_device(w_bf16))
    st = w12.stats(enc)
    print(f"{name}: [{k}, {n}] x{count} matrices, {st['bits_per_weight']:.4f} bits/weight, exception rate "
          f"{st['exception_rate']:.2e}, encode {time.perf_counter() - t0:.1f} s", flush=True)
    xla = ("xla_bf16", lambda x, w: jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32), w_bf16)
    layouts = {}  # (implementation, step) -> its rows: the runs' layout for each M (the step follows the rows)
    chains = {}  # a row's weight layout (by id) -> the chain's `count` distinct copies of it
    for m in args.m:
        impls = [xla]
        for impl in (i for i in args.choice.implementation if i in KERNELS):
            config = args.choice.config if impl == args.choice.implementation[0] else None
            step = mk.default_block_k(k, n, m, config or mk.DEFAULT) if impl == "mosaic" else None
            if (impl, step) not in layouts:
                try:
                    layouts[impl, step] = kernel_rows(impl, config, w_bf16, enc, m, interpret)
                except NotImplementedError as e:  # a shape the kernel does not tile is a result too
                    print(f"  {impl}: {e}", flush=True)
                    layouts[impl, step] = []
            impls += layouts[impl, step]
        for _, _, w in impls:
            if id(w) not in chains:
                chains[id(w)] = [w] + [jax.tree.map(jnp.copy, w) for _ in range(count - 1)]
        x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.bfloat16)
        ref = jnp.einsum("mk,kn->mn", x, w_bf16, preferred_element_type=jnp.float32)
        outs = {}
        for label, mm, w in impls:
            row = {"shape": name, "k": k, "n": n, "m": m, "impl": label, "matrices": count,
                   "layout": type(w).__name__, **({"step": w.slot_k} if isinstance(w, mk.W12NK) else {})}
            try:
                ws = chains[id(w)]
                t0 = time.perf_counter()
                chain = make_chain(k, mm).lower(x, ws).compile()
                row["compile_s"] = time.perf_counter() - t0
                per = timed(lambda: chain(x, ws), args.reps, args.trials) / count
                nbytes = layout_bytes(w)
                if any(label.startswith(prefix) for prefix in args.profile):
                    row["profile"] = profile_chain(chain, x, ws, count) or {}
                    row.update(kernel_fields(row["profile"], nbytes, copy_bw))
                y = jax.jit(mm)(x, w)
                row.update(us_per_matrix=per * 1e6, bytes=nbytes, tb_s=nbytes / per / 1e12,
                           bf16_eq_tb_s=2 * k * n / per / 1e12, pct_copy=100 * nbytes / per / copy_bw,
                           rel_err_vs_xla=float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)))
                if not row["rel_err_vs_xla"] <= REL_ERR_VS_XLA_MAX:  # also NaN
                    row["wrong_vs_xla"] = True
                    print(f"  M={m:3d} {label} WRONG: relative error {row['rel_err_vs_xla']:.3g} against XLA's "
                          f"product (at most {REL_ERR_VS_XLA_MAX})", flush=True)
                if label.startswith("w12_"):
                    row.update(bits_per_weight=8 * nbytes / (k * n), exception_rate=st["exception_rate"])
                    twin = outs.get("twin_" + label[4:])
                    row["bit_exact"] = twin is not None and same_bits(y, twin)
                outs[label] = y
            except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is a result too
                row["error"] = repr(e)[:400]
                print(f"  M={m:3d} {label:12s} ERROR {row['error'][:200]}", flush=True)
            record["rows"].append(row)
        print_m(record["rows"], name, m)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)


def print_m(rows, name, m):
    rows = [r for r in rows if r["shape"] == name and r["m"] == m and "us_per_matrix" in r]
    xla = next((r["us_per_matrix"] for r in rows if r["impl"] == "xla_bf16"), float("nan"))
    for r in rows:
        extra = f" exact={r['bit_exact']}" if "bit_exact" in r else ""
        prof = r.get("profile") or {}
        busy = f" busy {1e3 * prof['busy_ms_per_step']:.1f} us" if "busy_ms_per_step" in prof else ""
        if r.get("kernel_pct_copy") is not None:
            busy += f" kernel {r['kernel_us']:.1f} us ({r['kernel_pct_copy']:.1f}% copy)"
        print(f"  M={m:3d} {r['impl']:12s} {r['us_per_matrix']:9.2f} us {r['tb_s']:6.3f} TB/s "
              f"({r['pct_copy']:5.1f}% copy) bf16-eq {r['bf16_eq_tb_s']:6.3f} TB/s "
              f"x{xla / r['us_per_matrix']:5.2f} vs xla{busy}{extra}", flush=True)


def summary(rows) -> list[str]:
    """Per (shape, M): each row's us per matrix, and W12 against the faster bf16 path of its kernel
    (XLA's dot or the twin)."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lines = [f"{'shape':8s} {'M':>3s} " + " ".join(f"{i:>12s}" for i in impls) + "  w12 vs best bf16  exact"]
    for s, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        cell = {r["impl"]: r for r in rows if (r["shape"], r["m"]) == (s, m) and "us_per_matrix" in r}
        t = {i: cell[i]["us_per_matrix"] if i in cell else math.nan for i in impls}
        ratios = [f"{i}: {min(t['xla_bf16'], t.get('twin_' + i[4:], math.nan)) / t[i]:.2f}x"
                  for i in impls if i.startswith("w12_") and i in cell]
        exact = all(r.get("bit_exact", True) for r in cell.values())
        lines.append(f"{s:8s} {m:3d} " + " ".join(f"{t[i]:12.1f}" for i in impls) + f"  {', '.join(ratios)}  {exact}")
    print("\n" + "\n".join(lines))
    return lines


def profile_table(paths: list[str], kernel: str = "mosaic") -> list[str]:
    """Markdown rows from recorded runs with `--profile xla,twin,w12`: per (shape, M), the wall, busy and
    main-kernel time of XLA, the kernel's twin and its W12, and W12 against the faster bf16 path on busy
    and on kernel time (docs/performance.md's layer tables)."""
    cells = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if "us_per_matrix" not in r:
                    continue
                prof = r.get("profile") or {}
                top = (prof.get("top") or [{}])[0]
                busy = 1e3 * prof.get("busy_ms_per_step", math.nan)
                cells[r["shape"], r["m"], r["impl"]] = (r["us_per_matrix"], busy, top.get("us_median", math.nan))
    out = ["| shape | M | wall: XLA / twin / W12 (us) | busy: XLA / twin / W12 (us) | kernel: XLA / twin / W12 (us) "
           "| W12 vs best bf16, busy | kernel |", "| --- | ---: | --- | --- | --- | ---: | ---: |"]
    named = {key[0] for key in cells}  # Qwen3-8B's in their order, then other shapes in the records' order
    shapes = [s for s in QWEN3_8B if s in named]
    shapes += list(dict.fromkeys(key[0] for key in cells if key[0] not in QWEN3_8B))
    for name in shapes:
        for m in sorted({key[1] for key in cells if key[0] == name}):
            got = [cells.get((name, m, i)) for i in ("xla_bf16", f"twin_{kernel}", f"w12_{kernel}")]
            if None in got:
                continue
            x, t, w = got
            cols = [" / ".join(f"{v[q]:.1f}" for v in got) for q in range(3)]
            out.append(f"| {name} | {m} | {cols[0]} | {cols[1]} | {cols[2]} | {min(x[1], t[1]) / w[1]:.2f}x "
                       f"| {min(x[2], t[2]) / w[2]:.2f}x |")
    return out


def parse_shapes(p, text: str) -> dict:
    """"all" -> Qwen3-8B's matrices; "tiny"; or a comma list of shape sets ("qwen3-8b", "qwen3-4b": the
    products runs make, q/k/v and gate/up fused), single names of any set ("4b.o") and KxN shapes."""
    if text == "tiny":
        return dict(TINY)
    out = {}
    for item in bench.comma_list(text):
        if item in SHAPE_SETS:
            out.update(SHAPE_SETS[item])
            continue
        named = next((d for d in (QWEN3_8B, QWEN3_8B_RUN, QWEN3_4B_RUN) if item in d), None)
        if named is not None:
            out[item] = named[item]
            continue
        try:
            k, n = (int(v) for v in item.split("x"))
        except ValueError:
            p.error(f"--shape takes 'tiny' or a comma list of {', '.join(SHAPE_SETS)}, {', '.join(QWEN3_8B)} and "
                    f"KxN, got {item!r}")
        out[item] = (k, n)
    return out


def main(argv=None) -> dict:
    p = bench.common_parser(__doc__.split("\n")[0], shape_default="all",
                            shape_help=f"'all' (Qwen3-8B's: {', '.join(QWEN3_8B)}), 'tiny', or a comma list of "
                                       f"those names and KxN shapes", m_default="1,4,8,16,32,64",
                            kernel_default="mosaic")
    p.add_argument("--min-bytes", type=float, default=1.0e9, help="bf16 bytes of weights per chain")
    p.add_argument("--reps", type=int, default=10, help="chain calls per timed pass")
    p.add_argument("--table", default="", help="comma list of recorded JSON files: print their markdown table")
    args = bench.parse_common(p, argv)
    if args.table:
        kernel = next((i for i in args.choice.implementation if i in KERNELS), "mosaic")
        lines = profile_table(bench.comma_list(args.table), kernel)
        print("\n".join(lines))
        return {"table": lines}
    shapes = parse_shapes(p, args.shape)
    interpret = jax.default_backend() == "cpu"
    if args.shape == "tiny":
        args.min_bytes, args.trials, args.reps = 0, min(args.trials, 2), min(args.reps, 2)
    copy_bw = copy_bandwidth((16 << 20) if interpret else (2 << 30))
    d = jax.devices()[0]
    record = {"device": {"platform": d.platform, "kind": getattr(d, "device_kind", str(d)), "jax": jax.__version__},
              "copy_bw": copy_bw, "interpret": interpret, "kernel": list(args.choice.implementation),
              "kernel_config": repr(args.choice.config), "rows": []}
    print(f"{record['device']}  copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    for name, (k, n) in shapes.items():
        bench_shape(name, k, n, args, interpret, copy_bw, record)
    summary(record["rows"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
