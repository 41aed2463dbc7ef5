"""Every template expansion of the kernel variants' templates checked against its op's reference on this
device: `python experiments/bench/check_templates.py [--op matmul|gated_delta_rule] [--limit N]`.

At the Qwen3-8B MLP shapes (matmul, M = batch x block rows, bf16 and W12 weights) and a Qwen3.5-style
linear layer (gated delta rule). A template whose knobs the kernel cannot compile shows up here as
rejected, with the compiler's message, before any loop spends device time on it.
"""

import argparse
import json
import time

import jax

from specpilot.agent import templates
from specpilot.harness import kernel_variants as va

SHAPES = {"matmul": [[16, 4096, 12288], [16, 12288, 4096]], "gated_delta_rule": [[1, 16, 48, 128, 128]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=va.OPS, action="append")
    p.add_argument("--limit", type=int, default=0, help="expansions per op (0: all)")
    args = p.parse_args()
    print(f"backend {jax.default_backend()}, devices {jax.devices()}")
    for op in args.op or va.OPS:
        for i, (knobs, v) in enumerate(templates.expansions(op)):
            if args.limit and i >= args.limit:
                break
            path = v.write("/tmp/specpilot_templates")
            row = {"op": op, "knobs": knobs, "name": v.name}
            t0 = time.perf_counter()
            try:
                fn = va.load(op, v.name, path)
                for weights in (("bf16", "w12") if op == "matmul" else ("bf16",)):
                    va.check(op, fn, {**SHAPES, "weights": weights}, seed=i)
                row["status"] = "ok"
            except va.VariantRejected as e:
                row["status"], row["reason"] = "rejected", str(e)[:300]
            row["check_s"] = round(time.perf_counter() - t0, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
