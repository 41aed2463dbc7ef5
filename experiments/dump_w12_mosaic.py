"""Compile the Mosaic W12 kernel (and its twin) for a few variants and keep what the compiler made of them:
MLIR after each pass, PTX, ptxas's register report and SASS, one folder per variant (Mosaic GPU's
MOSAIC_GPU_DUMP_TO), plus a per-variant count of the SASS instructions by opcode.

    PYTHONPATH=. python3 experiments/dump_w12_mosaic.py --out $OUT/sass        # H200 (needs nvdisasm)

Each variant runs once on a [4096, 4096] matrix at M = 1 and M = 16 so the module is compiled for real.
The counts tell how many instructions a weight costs in the K loop: read the loop body in the .sass file
(written only where Mosaic GPU finds nvdisasm in its CUDA root; the PTX and ptxas's register report always).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_RUNS_NK = {"tiled": True, "xor_chunks": True, "mma": True}  # how runs pack (w12.encode_params, kernel="mosaic")
VARIANTS = {  # name -> (w12?, to_nk's options (the twin: {"tiled": True} tiles its weight), kernel options)
    "twin": (False, {}, {}),
    "w12": (True, {"pack": True}, {}),  # the function's defaults: packed planes, PTX decode, x folded
    "w12_ws": (True, {"pack": True}, {"warp_specialized": True}),
    "w12_upcast_jnp": (True, {"pack": False}, {"planes": "upcast", "decode": "jnp", "fold_x": False}),  # third pass
    # as runs call them (w12_mosaic's switches at their defaults: `run_w12_options`, `run_options`)
    "w12_runs": (True, _RUNS_NK, {"plain_planes": True, "early_base": True, "auto_barriers": False}),
    "twin_runs": (False, {"tiled": True}, {"tiled": True, "auto_barriers": False}),
}


def opcode_counts(sass: str) -> dict:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return dict(ops.most_common())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma list of variant names")
    p.add_argument("--m", default="1,16")
    p.add_argument("--keep-mlir", action="store_true", help="keep the MLIR after each pass (large)")
    args = p.parse_args(argv)
    names = [v for v in args.only.split(",") if v] or list(VARIANTS)
    report = {}
    for name in names:
        w12_kernel, nk_opts, opts = VARIANTS[name]
        for m in [int(v) for v in args.m.split(",")]:
            folder = os.path.join(args.out, f"{name}_m{m}")
            os.makedirs(folder, exist_ok=True)
            os.environ["MOSAIC_GPU_DUMP_TO"] = folder  # read by Mosaic GPU when it compiles a module
            code = (f"import jax, jax.numpy as jnp\n"
                    f"from pallas_kernels import w12_mosaic as mk\n"
                    f"from specpilot.formats import w12\n"
                    f"w = (jax.random.normal(jax.random.key(0), (4096, 4096)) * 0.02).astype(jnp.bfloat16)\n"
                    f"x = jax.random.normal(jax.random.key(1), ({m}, 4096)).astype(jnp.bfloat16)\n"
                    f"if {w12_kernel}:\n"
                    f"    nk = mk.to_nk(w12.encode(w), 64, **{nk_opts!r})\n"
                    f"    y = mk.w12_mosaic_partials(x, nk, **{opts!r})\n"
                    f"else:\n"
                    f"    w_t = mk.tile_twin(w.T, 64) if {nk_opts.get('tiled', False)} else w.T.copy()\n"
                    f"    y = mk.bf16_mosaic_partials(x, w_t, **{opts!r})\n"
                    f"print(float(y.sum()))\n")
            with open(f"{folder}/run.log", "w") as log:
                rc = subprocess.run([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT).returncode
            if not args.keep_mlir:  # tens of MB per variant: more than a device call brings back
                for f in glob.glob(f"{folder}/*mlir-passes*"):
                    os.remove(f)
            sass = "".join(open(f).read() for f in glob.glob(f"{folder}/*.sass"))
            report[f"{name}_m{m}"] = {"rc": rc, "ops": opcode_counts(sass), "files": sorted(os.listdir(folder))}
            print(name, m, "rc", rc, "sass lines", len(sass.splitlines()), flush=True)
            ptxas = "".join(open(f).read() for f in glob.glob(f"{folder}/*ptxas*"))
            print(ptxas[-1500:], flush=True)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
