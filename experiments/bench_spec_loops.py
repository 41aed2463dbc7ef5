"""Host loop vs `lax.while_loop` for stock speculative decoding (and AR's fori loop as the baseline).

    python experiments/bench_spec_loops.py [--new-tokens 128] [--repeats 7]

Tiny random target (2 layers) on whatever device jax picks; drafters: oracle replay (tau = B), a
mixed replay (every third drafted position wrong) and a random DFlash-shaped block drafter.
Prints median decode ms/token per (batch, block, drafter, loop).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from specpilot.decoding import ar, spec  # noqa: E402
from specpilot.models import dense  # noqa: E402
from specpilot.models import drafter as dr  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
TARGET = dense.target(CFG, jnp.float32)


def median_tpot(fn, repeats):
    fn()  # warm-up (compiles are ahead of time; this also fills caches)
    return statistics.median(fn().decode_time_per_token for _ in range(repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    n = args.new_tokens
    params = dense.init(jax.random.key(0), CFG, dtype=jnp.float32, std=0.5)
    print(f"device {jax.devices()[0]}, jax {jax.__version__}, {n} new tokens, median of {args.repeats}")
    print(f"{'batch':>5} {'block':>5} {'drafter':>8} {'tau':>6} {'ar':>8} {'while':>8} {'host':>8}")
    for batch, block in ((1, 4), (1, 16), (4, 16)):
        prompts = [[1 + i, 2, 3, 4 + i] for i in range(batch)]
        ar_tokens = ar.generate(TARGET, params, prompts, n + block).tokens.tolist()
        reference = dr.replay_reference(prompts, ar_tokens)
        dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=block)
        drafters = {
            "oracle": (dr.ReplayDrafter(CFG.vocab_size, block), reference),
            "mixed": (dr.ReplayDrafter(CFG.vocab_size, block, shift=1, wrong_every=3), reference),
            "random": (dr.BlockDrafter(dcfg, CFG), dr.init(jax.random.key(1), dcfg, jnp.float32)),
        }
        t_ar = median_tpot(lambda: ar.generate(TARGET, params, prompts, n), args.repeats)
        for name, (drafter, dparams) in drafters.items():
            row = {}
            for loop in spec.LOOPS:
                def run(loop=loop):
                    return spec.generate(TARGET, params, drafter, dparams, prompts, n, loop=loop)
                row[loop] = median_tpot(run, args.repeats)
            tau = run().stats.tau
            print(f"{batch:>5} {block:>5} {name:>8} {tau:>6.2f} {1e3 * t_ar:>8.3f} "
                  f"{1e3 * row['while']:>8.3f} {1e3 * row['host']:>8.3f}")


if __name__ == "__main__":
    main()
