"""What XLA's products cost on this machine at a few rows: the decoder stack's MLP at SmolLM2-135M's shape.

    PYTHONPATH=. python experiments/bench/bench_cpu_products.py [--rows 1,4,8] [--layout kn,nk,rows] [--trials 15] [--dtype bfloat16]
    XLA_FLAGS=--xla_cpu_use_onednn=true PYTHONPATH=. python experiments/bench/bench_cpu_products.py

Each layer multiplies its rows by a gate/up weight (576 x 3072) and the product's SwiGLU by a down weight
(1536 x 576), 30 layers chained as in the model, float32 (or bfloat16); the weights (319 MB) are far larger than the
caches. `kn` stores the gate/up weight [K, N], `nk` its transpose (XLA's dot either way); `rows` multiplies
both weights with the CPU rows kernel (`pallas_kernels.cpu_rows`, float32 only). Prints the median ms per layout and row
count, each as a multiple of one row, and the effective weight-read rate: a step that stays memory-bound
as rows grow costs what one row does (docs/performance.md, default deployment, "What limits it").
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_rows
from specpilot.harness.bench import median_ms

LAYERS, HIDDEN, INTER = 30, 576, 1536


def chained_mlp(layout: str):
    def dot(spec):
        return lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    first, second = {"kn": (dot("tk,kn->tn"), dot("tk,kn->tn")), "nk": (dot("tk,nk->tn"), dot("tk,kn->tn")),
                     "rows": (cpu_rows.rows_matmul, cpu_rows.rows_matmul)}[layout]

    @jax.jit
    def run(x, gate_up, down):
        for gu, d in zip(gate_up, down):
            g, u = jnp.split(first(x, gu), 2, axis=-1)
            x = x + second(jax.nn.silu(g) * u, d)
        return x

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8", help="comma list of rows per product")
    ap.add_argument("--layout", default="kn,nk", help="comma list of gate/up layouts: kn, nk")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    gate_up = [rng.standard_normal((HIDDEN, 2 * INTER), np.float32) * 0.02 for _ in range(LAYERS)]
    down = [jnp.asarray(rng.standard_normal((INTER, HIDDEN), np.float32) * 0.02, dtype) for _ in range(LAYERS)]
    weights = {"kn": ([jnp.asarray(w, dtype) for w in gate_up], down),
               "nk": ([jnp.asarray(w.T.copy(), dtype) for w in gate_up], down)}
    if "rows" in args.layout.split(","):
        if args.dtype != "float32" or not cpu_rows.available():
            ap.error(f"--layout rows takes float32 and the CPU rows kernel ({cpu_rows.unavailable_reason()})")
        weights["rows"] = ([cpu_rows.to_panels(jnp.asarray(w)) for w in gate_up], [cpu_rows.to_panels(w) for w in down])
    mb = LAYERS * (HIDDEN * 2 * INTER + INTER * HIDDEN) * dtype.itemsize / 1e6
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, {jax.devices()[0].platform}, {args.dtype}, {LAYERS} layers, "
          f"{mb:.0f} MB of weights, median of {args.trials}")
    print(f"{'layout':>7}{'rows':>6}{'ms':>9}{'x 1 row':>9}{'GB/s':>7}")
    for layout in args.layout.split(","):
        if layout not in ("kn", "nk", "rows"):
            ap.error(f"--layout takes kn, nk and rows, got {layout!r}")
        fn, base = chained_mlp(layout), None
        for rows in (int(r) for r in args.rows.split(",")):
            ms = median_ms(fn, jnp.ones((rows, HIDDEN), dtype), *weights[layout], trials=args.trials)
            base = base or ms
            print(f"{layout:>7}{rows:>6}{ms:>9.2f}{ms / base:>9.2f}{mb / ms:>7.1f}")


if __name__ == "__main__":
    main()
