"""What one draft call of the default pair costs with the full head and with reduced draft vocabularies.

    PYTHONPATH=. python experiments/bench/bench_draft_vocab.py --checkpoint DIR [--vocab 0,4096,8192,16384]

One `BlockDrafter.propose` (the packaged SmolLM2 drafter at --block, over --context committed positions)
per vocabulary size, 0 meaning the full head; sizes are timed in turn, round after round, so a load that
shifts during the run weighs on each alike. Prints each size's median ms and its ratio to the full head's.
DIR is the converted SmolLM2 folder (cache_dir/gguf/...); the ranking is the one shipped beside the drafter.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from specpilot.models import draft_vocab
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.training.locate import DEFAULT_DRAFTER

DRAFTER = dr.PACKAGED / DEFAULT_DRAFTER


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--vocab", default="0,4096,8192,16384", help="comma list of K (0: the full head)")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per size per round")
    args = ap.parse_args(argv)
    tparams, tcfg = load_hf(args.checkpoint, dtype=jnp.float32)
    dparams, dcfg = dr.load_drafter(DRAFTER, dtype=jnp.float32)
    tcfg = tcfg.with_taps(dcfg.tap_layers)
    drafter = dr.BlockDrafter(dcfg, tcfg, draft_width=dcfg.block_size)
    ranking = draft_vocab.load_ranking(DRAFTER / draft_vocab.RANKING_FILE, tcfg.vocab_size)
    state = drafter.init_state(dparams, 1, args.context + 64).commit(jnp.array([args.context], jnp.int32))
    propose = jax.jit(lambda p, tp, s, last: drafter.propose(p, tp, s, last, args.block)[0])
    last = jnp.array([42], jnp.int32)
    sizes = [int(k) for k in args.vocab.split(",")]
    variants = {k: dparams if k == 0 else draft_vocab.with_draft_vocab(
        dparams, tparams, tcfg, draft_vocab.select(ranking, k, tcfg.vocab_size)) for k in sizes}
    times = {k: [] for k in sizes}
    for k in sizes:
        jax.block_until_ready(propose(variants[k], tparams, state, last))  # compile
    for _ in range(args.rounds):
        for k in sizes:
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(propose(variants[k], tparams, state, last))
                times[k].append(time.perf_counter() - t0)
    print(f"draft call at block {args.block}, context {args.context}, {jax.devices()[0].platform}, median of "
          f"{args.rounds} x {args.calls} interleaved")
    full = statistics.median(times[sizes[0]])
    for k in sizes:
        ms = statistics.median(times[k])
        q1, _, q3 = statistics.quantiles(times[k], n=4)
        print(f"{'full' if k == 0 else k:>6}: {1e3 * ms:6.2f} ms (IQR {1e3 * q1:.2f}-{1e3 * q3:.2f})  "
              f"{ms / full:.2f}x of {'full' if sizes[0] == 0 else sizes[0]}")


if __name__ == "__main__":
    main()
