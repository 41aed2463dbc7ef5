"""Per-shape GEMV bandwidth at M = 1: XLA's dot ([in,out] and [out,in] weights) vs the Pallas split-K GEMV.

    PYTHONPATH=. python3 experiments/bench_gemv.py --out gemv.json            # Qwen3-8B matrix shapes
    PYTHONPATH=. python3 experiments/bench_gemv.py --shapes tiny              # CPU smoke (interpret)

Design choices:
- Each measurement is a chain of products over `n` distinct matrices of one shape inside one jit,
  each product's output (cut or tiled back to K) feeding the next: distinct matrices keep the 60 MB L2
  from serving repeats, the dependency matches a decode step, and XLA cannot merge the dots.
- Time per matrix = pipelined chain time / n, so a launch gap between products is charged to the
  product, as it is in a real step; GB/s = matrix bytes / time per matrix.
- Pallas block configurations are swept as small edits of `default_blocks`; invalid ones (not powers
  of two, not tiling) are skipped, failing ones recorded with their error.
- Every implementation is checked on a fresh random x against the XLA reference (relative error).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.gemv import GemvBlocks, check_blocks, default_blocks, gemv  # noqa: E402
from specpilot import bench  # noqa: E402
from specpilot.bench import make_chain  # noqa: E402

SHAPE_SETS = {
    "qwen3-8b": {"k/v": (4096, 1024), "q/o": (4096, 4096), "qkv": (4096, 6144), "gate/up": (4096, 12288),
                 "gate_up": (4096, 24576), "down": (12288, 4096), "lm_head": (4096, 151936)},
    "tiny": {"sq": (256, 256), "wide": (256, 1024)},
}
KN_EDITS = [{}, {"block_k": 16}, {"block_k": 64}, {"num_warps": 8}, {"num_stages": 2}, {"split": 0.5},
            {"split": 2}, {"block_n": 128}]
NK_EDITS = [{}, {"block_k": 128}, {"block_n": 16}, {"block_n": 64}, {"num_warps": 8}, {"split": 2}]


def edit_blocks(base: GemvBlocks, edit: dict, k: int, n: int) -> GemvBlocks:
    """base with edit applied; ValueError if the result does not tile a [k, n] weight."""
    edit = dict(edit)
    if "split" in edit:
        edit["split_k"] = int(base.split_k * edit.pop("split"))
        if edit["split_k"] < 1:
            raise ValueError("split_k < 1")
    blocks = dataclasses.replace(base, **edit)
    check_blocks(k, n, blocks)
    return blocks


def measure(name, k, n, layout, mm, ws_kn, x, reps, ref_fn):
    ws = ws_kn if layout == "kn" else [w.T for w in ws_kn]
    ws = jax.block_until_ready(ws)
    chain = make_chain(k, mm)
    compiled, compile_s = bench.timed_compile(chain, x, ws)
    xe = jax.random.normal(jax.random.PRNGKey(7), (1, k), jnp.bfloat16)
    got = jax.jit(mm)(xe, ws[0])
    want = ref_fn(xe, ws_kn[0])
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    t = bench.pipelined(lambda: compiled(x, ws), reps)
    per = t / len(ws)
    return {"name": name, "layout": layout, "us_per_matrix": per * 1e6, "bw": k * n * 2 / per,
            "rel_err": err, "compile_s": compile_s}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="qwen3-8b")
    p.add_argument("--only", default="", help="comma list of shape names to run")
    p.add_argument("--min-bytes", type=float, default=1.5e9, help="bytes of weights per chain")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-sweep", action="store_true", help="default Pallas blocks only")
    p.add_argument("--kn-edits", default="", help="JSON list of GemvBlocks edits replacing KN_EDITS")
    p.add_argument("--nk-edits", default="", help="JSON list of GemvBlocks edits replacing NK_EDITS")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    interpret = jax.devices()[0].platform == "cpu"
    record = {"device": bench.device_info(), "copy": bench.copy_bandwidth(
        (64 << 20) if interpret else (4 << 30)), "rows": []}
    copy_bw = record["copy"]["bw"]
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)
    shapes = SHAPE_SETS[args.shapes]
    only = [s for s in args.only.split(",") if s]
    ref = jax.jit(lambda x, w: jnp.einsum("mk,kn->mn", x.astype(jnp.float32), w.astype(jnp.float32)))
    for sname, (k, n) in shapes.items():
        if only and sname not in only:
            continue
        count = max(2, min(64, math.ceil(args.min_bytes / (k * n * 2))))
        keys = jax.random.split(jax.random.PRNGKey(0), count)
        ws = [jax.jit(lambda kk: (0.02 * jax.random.normal(kk, (k, n), jnp.float32)).astype(jnp.bfloat16))(kk)
              for kk in keys]
        x = jax.random.normal(jax.random.PRNGKey(1), (1, k), jnp.bfloat16)
        impls = [("xla", "kn", None), ("xla", "nk", None)]
        kn_edits = json.loads(args.kn_edits) if args.kn_edits else KN_EDITS
        nk_edits = json.loads(args.nk_edits) if args.nk_edits else NK_EDITS
        for layout, edits in (("kn", kn_edits), ("nk", nk_edits)):
            base = default_blocks(k, n, layout)
            for edit in edits[:1] if args.no_sweep else edits:
                try:
                    blocks = edit_blocks(base, edit, k, n)
                except (TypeError, ValueError):
                    continue
                impls.append(("pallas", layout, blocks))
        seen = set()
        for impl, layout, blocks in impls:
            if (impl, layout, blocks) in seen:
                continue
            seen.add((impl, layout, blocks))
            label = impl if blocks is None else (f"pallas bn{blocks.block_n} bk{blocks.block_k} "
                                                 f"s{blocks.split_k} w{blocks.num_warps} st{blocks.num_stages}")

            def mm(xx, w, impl=impl, layout=layout, blocks=blocks):
                return gemv(xx, w, layout=layout, implementation=impl, blocks=blocks, interpret=interpret)

            try:
                row = measure(label, k, n, layout, mm, ws, x, args.reps, ref)
                if blocks is not None:
                    row["blocks"] = dataclasses.asdict(blocks)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
                row = {"name": label, "layout": layout, "error": repr(e)[:400]}
            row.update({"shape": sname, "k": k, "n": n, "matrices": count})
            if "bw" in row:
                row["pct_copy_bw"] = 100 * row["bw"] / copy_bw
                print(f"{sname:8s} {k:6d}x{n:<6d} {layout} {label:40s} {row['us_per_matrix']:9.2f} us "
                      f"{row['bw'] / 1e12:6.3f} TB/s {row['pct_copy_bw']:5.1f}%  err {row['rel_err']:.1e}",
                      flush=True)
            else:
                print(f"{sname:8s} {layout} {label:40s} ERROR {row['error'][:200]}", flush=True)
            record["rows"].append(row)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(record, f, indent=1)
        del ws
    best = {}
    for row in record["rows"]:
        if "bw" in row and row["bw"] > best.get((row["shape"], row["name"].split()[0], row["layout"]), {}).get(
                "bw", 0):
            best[(row["shape"], row["name"].split()[0], row["layout"])] = row
    print("\nbest per shape / implementation / layout:")
    for (s, impl, lay), row in best.items():
        print(f"{s:8s} {impl:6s} {lay} {row['us_per_matrix']:9.2f} us {row['pct_copy_bw']:5.1f}%  {row['name']}")
    return record


if __name__ == "__main__":
    main()
