"""Chain attention at the Qwen3-8B shape: XLA's masked attention over the whole cache against the ragged
kernel (pallas_kernels/ragged_attention.py) at several splits, by device kernel time and kernels per call.

    PYTHONPATH=. python3 experiments/bench/bench_attention.py --out attention.json   # GPU: B 1, 16 x T 1, 16
    PYTHONPATH=. python3 experiments/bench/bench_attention.py --shape tiny           # CPU smoke (interpreted)

Each row times a jitted chain of `--layers` attention calls, one distinct K/V cache per call (as a
model's layers: beyond L2 at batch 16), each call's output the next call's query, every row at
`--length` committed slots plus T new ones in a cache of `--slots`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels import ragged_attention as ra
from pallas_kernels.tree_attention import cache_attention
from specpilot.harness import bench

SHAPES = {  # heads, KV heads, head dim, cache slots, committed length, calls per chain, batches, tokens, block_s
    "qwen3-8b": dict(h=32, kvh=8, d=128, slots=1024, length=512, layers=36, batch="1,16", tokens="1,16", block_s=64),
    "tiny": dict(h=4, kvh=2, d=16, slots=64, length=20, layers=2, batch="1,2", tokens="1,8", block_s=16),
}


def xla_attention(q, k, v, lengths, counts):
    """What the plan's "xla" attention runs (`dispatch._attention_xla`): the mask by length, the whole cache."""
    return cache_attention(q, k, v, ra.visible_mask(lengths, counts, q.shape[1], k.shape[2]))


def make_chain(attn, layers: int):
    def chain(q, caches):
        ks, vs, lengths, counts = caches
        for i in range(layers):  # one distinct cache per call; the output is the next call's query
            q = attn(q, ks[i], vs[i], lengths, counts)
        return q
    return jax.jit(chain)


def wall_us(chain, q, caches, calls: int, trials: int = 5, reps: int = 5) -> float:
    """Median over trials of wall time per attention call, `reps` chains pipelined, one sync."""
    jax.block_until_ready(chain(q, caches))
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            last = chain(q, caches)
        jax.block_until_ready(last)
        out.append((time.perf_counter() - t0) / (reps * calls) * 1e6)
    return statistics.median(out)


def profile(chain, q, caches, calls: int, reps: int = 3) -> dict:
    """Device kernels per attention call and their time (JAX profiler trace)."""
    jax.block_until_ready(chain(q, caches))

    def run():
        out = None
        for _ in range(reps):
            out = chain(q, caches)
        return out

    return bench.traced_kernels(run, reps * calls)


def kv_bytes(b: int, kvh: int, d: int, ends: int, itemsize: int) -> int:
    """K and V bytes a call must read: each row's own slots (lengths + T), every KV head."""
    return 2 * b * kvh * ends * d * itemsize


def run_case(name, attn, shape, b, t, interpret, dtype) -> dict:
    h, kvh, d, s, length, layers = (shape[x] for x in ("h", "kvh", "d", "slots", "length", "layers"))
    key = jax.random.key(b * 100 + t)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, h, d), dtype)
    ks = tuple(jax.random.normal(k, (b, kvh, s, d), dtype) for k in jax.random.split(kk, layers))
    vs = tuple(jax.random.normal(k, (b, kvh, s, d), dtype) for k in jax.random.split(kv, layers))
    lengths = jnp.full((b,), length, jnp.int32)
    counts = jnp.full((b,), t, jnp.int32)
    caches = (ks, vs, lengths, counts)
    want = ra.ragged_attention_reference(q, ks[0], vs[0], lengths, counts)
    got = jax.jit(attn)(q, ks[0], vs[0], lengths, counts)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    chain = make_chain(attn, layers)
    row = {"variant": name, "B": b, "T": t, "max_abs_err_vs_reference": err,
           "wall_us_per_call": wall_us(chain, q, caches, layers, trials=2 if interpret else 5,
                                       reps=1 if interpret else 5)}
    if not interpret:
        prof = profile(chain, q, caches, layers)
        row["profile"] = prof
        if "busy_ms_per_step" in prof:
            row["kernel_us_per_call"] = prof["busy_ms_per_step"] * 1e3
            row["kernels_per_call"] = prof["kernels_per_step"]
            own = kv_bytes(b, kvh, d, length + t, jnp.dtype(dtype).itemsize)
            row["own_kv_tb_per_s"] = own / (row["kernel_us_per_call"] * 1e-6) / 1e12
    return row


def variants(splits: list[int], block_s: int, interpret: bool, merges: list[str]):
    out = [("xla", xla_attention)]
    for sp in splits:
        for merge in (merges if sp != 1 else merges[:1]):  # one split writes its output itself: no merge
            config = ra.RaggedAttentionConfig(block_s=block_s, splits=sp, merge=merge, interpret=interpret)
            tag = f" {merge}" if len(merges) > 1 and sp != 1 else ""
            out.append((f"kernel{tag} splits={sp or 'auto'}", lambda *a, c=config: ra.ragged_attention(*a, c)))
    return out


def print_table(rows: list[dict], shape: dict, sms: int, block_s: int) -> None:
    print(f"\nper attention call (chain of {shape['layers']} calls, H {shape['h']}, KVH {shape['kvh']}, "
          f"D {shape['d']}, {shape['slots']} cache slots, length {shape['length']} + T; block_s {block_s}; "
          f"auto splits = min(ceil(2 x {sms} SMs / (B x KVH)), slots / block_s))")
    print("kernel us: summed device kernel time per call (all kernels: mask, layout, combine); kernels: their "
          "count per call; wall us: host time per call, chains pipelined; err: max |out - reference| of one call")
    print(f"{'B':>3} {'T':>3}  {'variant':<26} {'splits':>6} {'kernel us':>10} {'kernels':>8} {'own K/V TB/s':>12} "
          f"{'wall us':>9} {'err':>9}")
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else format("-", f">{fmt.split('.')[0]}")
        print(f"{r['B']:>3} {r['T']:>3}  {r['variant']:<26} {r.get('splits', '-'):>6} {f('kernel_us_per_call', '10.1f')} "
              f"{f('kernels_per_call', '8.1f')} {f('own_kv_tb_per_s', '12.2f')} {f('wall_us_per_call', '9.1f')} "
              f"{r['max_abs_err_vs_reference']:9.1e}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: the CPU smoke shape")
    p.add_argument("--batch", default="", help="comma list of batch sizes (default: the shape's)")
    p.add_argument("--tokens", default="", help="comma list of new tokens per row T (default: the shape's)")
    p.add_argument("--splits", default="1,0", help="comma list of kernel splits (0: automatic)")
    p.add_argument("--block-s", type=int, default=0, help="the kernel's block_s (default: the shape's)")
    p.add_argument("--merge", default="xla", help=f"comma list of split merges, of {sorted(ra.MERGES)}")
    p.add_argument("--out", default="", help="write the JSON record here")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    args.block_s = args.block_s or shape["block_s"]
    interpret = jax.default_backend() != "gpu"
    if interpret and args.shape != "tiny":
        p.error(f"the {args.shape} shape needs a GPU (the kernel is interpreted on {jax.default_backend()}); "
                f"use --shape tiny")
    dtype = jnp.float32 if interpret else jnp.bfloat16
    batches = bench.comma_list(args.batch or shape["batch"], int)
    tokens = bench.comma_list(args.tokens or shape["tokens"], int)
    splits = bench.comma_list(args.splits, int)
    sms = ra.device_sms()
    record = {"device": bench.device_info(), "shape": {"name": args.shape, **shape}, "block_s": args.block_s,
              "interpret": interpret, "sms": sms, "rows": []}
    print(f"{record['device']}  {'interpreted kernel' if interpret else ''}", flush=True)
    t0 = time.perf_counter()
    for b in batches:
        for t in tokens:
            for name, attn in variants(splits, args.block_s, interpret, bench.comma_list(args.merge, str)):
                row = run_case(name, attn, shape, b, t, interpret, dtype)
                if name != "xla":
                    sp = int(name.split("=")[1]) if name[-1].isdigit() else ra.auto_splits(
                        b, shape["kvh"], shape["slots"], args.block_s, sms)
                    row["splits"] = min(sp, shape["slots"] // args.block_s)
                record["rows"].append(row)
                print(f"  B {b} T {t} {name}: {row.get('kernel_us_per_call', math.nan):.1f} us kernel, "
                      f"{row['wall_us_per_call']:.1f} us wall ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(record["rows"], shape, sms, args.block_s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return record


if __name__ == "__main__":
    main()
