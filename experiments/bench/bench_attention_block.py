"""The fused attention block (`pallas_kernels.attention_block`) against its reference jitted as one function
(what XLA runs in the model between the qkv and o products), per call: device time and kernels per call,
over 36 layers' distinct caches in turn (beyond L2), and the kernel's agreement with the reference.

    PYTHONPATH=. python3 experiments/bench/bench_attention_block.py                 # H200, Qwen3-8B shape
    PYTHONPATH=. python3 experiments/bench/bench_attention_block.py --splits 0,1,4,8,16 --out ab.json
    PYTHONPATH=. python3 experiments/bench/bench_attention_block.py --shape tiny     # CPU (interpreter)

Design notes: docs/design/kernels.md (`pallas_kernels/attention_block.py`).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention_block as ab
from specpilot.harness import bench

# heads, KV heads, head dim, cache slots, context (committed slots), layers in the chain, interpret
SHAPES = {
    "qwen3-8b": dict(heads=32, kv_heads=8, head_dim=128, slots=1024, context=512, layers=36),
    "tiny": dict(heads=4, kv_heads=2, head_dim=32, slots=64, context=20, layers=3),
}
EPS = 1e-6


def layer_inputs(key, b: int, t: int, shape: dict, layers: int):
    """Per layer: qkv [B, T, (H + 2 KVH) D] bf16 and distinct caches (drawn on the device: the 8B shape's
    36 caches at B = 16 are 2.4 GB); shared norm weights, RoPE tables, lengths and counts."""
    h, kvh, d, s = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["slots"]
    bf = jnp.bfloat16
    keys = iter(jax.random.split(key, 3 * layers + 2))
    qkvs = [jax.random.normal(next(keys), (b, t, (h + 2 * kvh) * d), bf) for _ in range(layers)]
    caches = [(jax.random.normal(next(keys), (b, kvh, s, d), bf), jax.random.normal(next(keys), (b, kvh, s, d), bf))
              for _ in range(layers)]
    weights = tuple((1 + 0.1 * jax.random.normal(next(keys), (d,), jnp.float32)).astype(bf) for _ in range(2))
    lengths = jnp.full((b,), shape["context"], jnp.int32)
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(1e6 ** (-np.arange(0, d, 2) / d), jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return qkvs, caches, weights, (jnp.cos(emb), jnp.sin(emb)), lengths, jnp.full((b,), t, jnp.int32)


def profile(block, qkvs, weights, tables, caches, lengths, counts, reps: int):
    """(caches, kernel summary per call from the device trace) of `reps` passes over the layers, one
    jitted call per layer with its caches donated (each write in place, one compile for all layers)."""
    step = jax.jit(block, donate_argnums=(5, 6))

    def one_pass(caches):
        out, new = None, []
        for qkv, (kc, vc) in zip(qkvs, caches):
            out, kc, vc = step(qkv, *weights, *tables, kc, vc, lengths, counts)
            new.append((kc, vc))
        return out, new

    out, caches = one_pass(caches)
    jax.block_until_ready(out)
    carried = [caches]

    def run():
        out = None
        for _ in range(reps):
            out, carried[0] = one_pass(carried[0])
        return out

    summary = bench.traced_kernels(run, reps * len(qkvs))
    return carried[0], summary


def agreement(kernel, reference, qkv, weights, tables, caches, lengths, counts, dims: dict, context: int) -> dict:
    """One layer through both: the attention's max |difference| against the bound the tests hold
    (tests/test_attention_block.py: 2^-7 (max|v| + |ref|) + 1e-5 max|v|), and the written K/V's bit agreement."""
    new_v = ab.split_heads(qkv, dims["num_heads"], dims["num_kv_heads"], dims["head_dim"])[2]
    v_max = max(float(jnp.abs(caches[1][:, :, :context].astype(jnp.float32)).max()),
                float(jnp.abs(new_v.astype(jnp.float32)).max()))
    got = jax.jit(kernel)(qkv, *weights, *tables, *caches, lengths, counts)
    ref = jax.jit(reference)(qkv, *weights, *tables, *caches, lengths, counts)
    a, r = (np.asarray(x[0], np.float32) for x in (got, ref))
    slack = np.abs(a - r) - 2.0 ** -7 * (v_max + np.abs(r)) - 1e-5 * v_max
    return {"attn_max_abs_diff": float(np.abs(a - r).max()), "attn_within_bound": bool((slack <= 0).all()),
            "k_same_bits": float(np.mean(np.asarray(got[1]).view(np.uint16) == np.asarray(ref[1]).view(np.uint16))),
            "v_same_bits": float(np.mean(np.asarray(got[2]).view(np.uint16) == np.asarray(ref[2]).view(np.uint16)))}


def bench_case(shape_name: str, b: int, t: int, args, record: dict) -> None:
    shape = SHAPES[shape_name]
    layers, interpret = shape["layers"], jax.default_backend() == "cpu"
    dims = dict(num_heads=shape["heads"], num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], eps=EPS)
    qkvs, caches, weights, tables, lengths, counts = layer_inputs(jax.random.key(0), b, t, shape, layers)
    reference = functools.partial(ab.attention_block_reference, **dims)
    variants = [("xla", reference)]
    for s in comma_ints(args.splits):
        for w in comma_ints(args.num_warps):
            config = ab.AttentionBlockConfig(splits=s, block_s=args.block_s, num_warps=w, interpret=interpret)
            resolved = s or ab.auto_splits(b, shape["kv_heads"], shape["slots"], args.block_s)
            name = f"kernel splits={resolved}{'(auto)' if s == 0 else ''} warps={w}"
            variants.append((name, functools.partial(ab.attention_block, **dims, config=config)))
    for name, block in variants:
        row = {"shape": shape_name, "batch": b, "tokens": t, "context": shape["context"], "impl": name}
        try:
            if name != "xla":
                row.update(agreement(block, reference, qkvs[0], weights, tables, caches[0], lengths, counts, dims,
                                     shape["context"]))
            caches, summary = profile(block, qkvs, weights, tables, caches, lengths, counts, args.reps)
            if summary and "busy_ms_per_step" in summary:
                row.update(kernels_per_call=summary["kernels_per_step"],
                           busy_us_per_call=1e3 * summary["busy_ms_per_step"],
                           top=[(k["name"][:60], round(k["calls_per_step"], 2), round(k["us_median"], 2))
                                for k in summary["top"]])
                xla = next((x for x in record["rows"] if x["impl"] == "xla" and x["batch"] == b and x["tokens"] == t
                            and "busy_us_per_call" in x), None)
                if xla and name != "xla":
                    row["xla_over_kernel"] = xla["busy_us_per_call"] / row["busy_us_per_call"]
            elif summary:
                row["profile"] = summary
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            row["error"] = repr(e)[:400]
        record["rows"].append(row)
        print(format_row(row), flush=True)


def comma_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def format_row(r: dict) -> str:
    if "error" in r:
        return f"B={r['batch']:2d} T={r['tokens']:2d} {r['impl']:30s} ERROR {r['error'][:300]}"
    busy = f"{r['busy_us_per_call']:7.2f}" if "busy_us_per_call" in r else "      -"
    kernels = f"{r['kernels_per_call']:5.1f}" if "kernels_per_call" in r else "    -"
    check = ""
    if "attn_max_abs_diff" in r:
        check = (f"  |diff| {r['attn_max_abs_diff']:.2e} {'ok' if r['attn_within_bound'] else 'OUT OF BOUND'}"
                 f"  K bits {100 * r['k_same_bits']:.3f}%  V bits {100 * r['v_same_bits']:.1f}%")
    ratio = f"  {r['xla_over_kernel']:5.2f}x" if "xla_over_kernel" in r else "       "
    return f"B={r['batch']:2d} T={r['tokens']:2d} {r['impl']:30s} {busy} us{ratio}  {kernels} kernels{check}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--batch", default="1,16", help="comma list of batch sizes")
    p.add_argument("--tokens", default="16", help="comma list of tokens per row (chain verification's T)")
    p.add_argument("--splits", default="0,1", help="comma list of kernel splits (0: automatic)")
    p.add_argument("--block-s", type=int, default=64)
    p.add_argument("--num-warps", default="4", help="comma list of the kernel's warps per program")
    p.add_argument("--reps", type=int, default=3, help="chain calls per timed pass")
    p.add_argument("--out", default="", help="write the record as JSON here")
    args = p.parse_args(argv)
    if args.shape == "tiny":
        args.reps = min(args.reps, 1)
    d = jax.devices()[0]
    record = {"device": {"platform": d.platform, "kind": getattr(d, "device_kind", str(d)), "jax": jax.__version__},
              "args": vars(args), "rows": []}
    print(record["device"], flush=True)
    for b in comma_ints(args.batch):
        for t in comma_ints(args.tokens):
            bench_case(args.shape, b, t, args, record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
