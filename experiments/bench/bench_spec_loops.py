"""Host loop vs `lax.while_loop` for stock speculative decoding (and AR's fori loop as the baseline).

    PYTHONPATH=. python experiments/bench/bench_spec_loops.py [--new-tokens 128] [--trials 7]

Tiny random target (2 layers) on whatever device jax picks; drafters: oracle replay (tau = B), a
mixed replay (every third drafted position wrong) and a random DFlash-shaped block drafter.
Prints median decode ms/token per (batch, block, drafter, loop).
"""

import json
import statistics

import jax
import jax.numpy as jnp

from specpilot.harness import bench
from specpilot.decoding import ar, spec
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
TARGET = dense.target(CFG, jnp.float32)


def median_tpot(fn, repeats):
    fn()  # warm-up (compiles are ahead of time; this also fills caches)
    return statistics.median(fn().decode_time_per_token for _ in range(repeats))


def main(argv=None):
    ap = bench.common_parser(__doc__.split("\n")[0], shape_default="tiny", shape_help="the target: 'tiny' only",
                             m_default="1,1,4", m_help="comma list of batch sizes, paired with --blocks",
                             trials_default=7, kernel_default="xla")
    ap.add_argument("--blocks", default="4,16,16", help="comma list of block sizes, paired with --m")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = bench.parse_common(ap, argv)
    blocks = bench.comma_list(args.blocks, int)
    if args.shape != "tiny" or len(blocks) != len(args.m):
        ap.error("--shape takes 'tiny'; --m and --blocks pair up one to one")
    n, rows = args.new_tokens, []
    params = dense.init(jax.random.key(0), CFG, dtype=jnp.float32, std=0.5)
    print(f"device {jax.devices()[0]}, jax {jax.__version__}, {n} new tokens, median of {args.trials}")
    print(f"{'batch':>5} {'block':>5} {'drafter':>8} {'tau':>6} {'ar':>8} {'while':>8} {'host':>8}")
    for batch, block in zip(args.m, blocks):
        prompts = [[1 + i, 2, 3, 4 + i] for i in range(batch)]
        ar_tokens = ar.generate(TARGET, params, prompts, n + block).tokens.tolist()
        reference = dr.replay_reference(prompts, ar_tokens)
        dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=block)
        drafters = {
            "oracle": (dr.ReplayDrafter(CFG.vocab_size, block), reference),
            "mixed": (dr.ReplayDrafter(CFG.vocab_size, block, shift=1, wrong_every=3), reference),
            "random": (dr.BlockDrafter(dcfg, CFG), dr.init(jax.random.key(1), dcfg, jnp.float32)),
        }
        t_ar = median_tpot(lambda: ar.generate(TARGET, params, prompts, n), args.trials)
        for name, (drafter, dparams) in drafters.items():
            row = {}
            for loop in spec.LOOPS:
                def run(loop=loop):
                    return spec.generate(TARGET, params, drafter, dparams, prompts, n, loop=loop)
                row[loop] = median_tpot(run, args.trials)
            tau = run().stats.tau
            print(f"{batch:>5} {block:>5} {name:>8} {tau:>6.2f} {1e3 * t_ar:>8.3f} "
                  f"{1e3 * row['while']:>8.3f} {1e3 * row['host']:>8.3f}")
            rows.append({"batch": batch, "block": block, "drafter": name, "tau": tau, "ar_s_per_token": t_ar,
                         **{f"{loop}_s_per_token": t for loop, t in row.items()}})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"new_tokens": n, "trials": args.trials, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
