"""What the accept stage costs: greedy prefix matching against rejection sampling, jitted, on random logits.

    PYTHONPATH=. python experiments/bench/bench_accept.py [--vocab 49152,151936] [--blocks 4,8,16]
        [--batch 1,16] [--trials 30]

One chain verification's accept (`rejection.verify_chain`) over drafts [B, Bs-1], draft logits
[B, Bs-1, V] and target logits [B, Bs, V], the drafts' own sampling (`rejection.choose_drafts`), and the
serving engine's row-by-row accept (`slots.verify_rows`). Sampled at temperature 0.7, with top-p off
(1.0) and at 0.9. Prints the median ms of each and the sampled accept as a multiple of the greedy one.
The default deployment verifies block 4 of SmolLM2-135M (vocabulary 49152); Qwen3-8B's is 151936.
"""

import argparse

import jax
import jax.numpy as jnp

from specpilot.decoding.rejection import choose_drafts, verify_chain
from specpilot.decoding.sampling import SamplingConfig
from specpilot.harness.bench import median_ms
from specpilot.serving.slots import verify_rows


def inputs(batch: int, block: int, vocab: int, seed: int = 0):
    """Logits shaped like a trained pair's: a peaked target, a drafter close to it, drafts its argmax."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    target = 4.0 * jax.random.normal(k1, (batch, block, vocab), jnp.float32)
    draft = target[:, :-1] + jax.random.normal(k2, (batch, block - 1, vocab), jnp.float32)
    drafts = jnp.argmax(draft, axis=-1).astype(jnp.int32)
    return drafts, draft, target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="49152,151936", help="comma list of vocabulary sizes")
    ap.add_argument("--blocks", default="4,8,16", help="comma list of block sizes (drafts + 1)")
    ap.add_argument("--batch", default="1,16", help="comma list of batch sizes")
    ap.add_argument("--trials", type=int, default=30)
    args = ap.parse_args(argv)

    chain = jax.jit(verify_chain)
    drafting = jax.jit(choose_drafts)
    rows = jax.jit(verify_rows)
    settings = {"greedy": (0.0, 1.0), "t0.7": (0.7, 1.0), "t0.7 p0.9": (0.7, 0.9)}
    print(f"{'V':>7} {'Bs':>3} {'B':>3} {'sampling':>10} {'accept ms':>10} {'x greedy':>9} "
          f"{'rows ms':>8} {'drafts ms':>10}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for block in (int(b) for b in args.blocks.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                drafts, draft_logits, target_logits = inputs(batch, block, vocab)
                kept = jnp.full((batch,), block - 1, jnp.int32)
                key = jax.random.key(1)
                row_keys = jax.random.split(key, batch)
                greedy_ms = None
                for name, (temperature, top_p) in settings.items():
                    s = SamplingConfig(temperature=temperature, top_p=top_p).for_requests(batch)
                    accept = median_ms(chain, key, drafts, draft_logits, target_logits, s, kept,
                                       trials=args.trials)
                    by_row = median_ms(rows, row_keys, drafts, draft_logits, target_logits, s, kept,
                                       trials=args.trials)
                    draw = median_ms(drafting, key, draft_logits, s, trials=args.trials)
                    greedy_ms = accept if greedy_ms is None else greedy_ms
                    print(f"{vocab:>7} {block:>3} {batch:>3} {name:>10} {accept:>10.3f} "
                          f"{accept / greedy_ms:>9.2f} {by_row:>8.3f} {draw:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
