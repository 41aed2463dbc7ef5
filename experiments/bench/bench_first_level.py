"""What a two-level step's stages cost against the trees it is compared with, on the default pair: the
drafter's call and tree build, each first level over the drafted tree (scores and subtree selection), and the
target's verify forward over 16, 32 and 64 nodes.

    PYTHONPATH=. python experiments/bench/bench_first_level.py --checkpoint DIR --exit-head HEAD [--nodes 64]

DIR is the converted SmolLM2 folder (cache_dir/gguf/...), HEAD a trained exit head's folder (or a packaged
head's name); the untrained exit runs at the head's layer. The state holds `--context` committed positions.
Stages are timed in turn, round after round, so a load that shifts during the run weighs on each alike.
Prints each stage's median ms, then per plan the step without its accept phase: draft + first level +
verify of the nodes it keeps.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from specpilot.decoding import tree as tree_loop
from specpilot.decoding import two_level
from specpilot.decoding.token_tree import build_tree
from specpilot.models import dense, draft_vocab, exit_head
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.training.locate import DEFAULT_DRAFTER

DRAFTER = dr.PACKAGED / DEFAULT_DRAFTER
DEPTH, BRANCHING = 7, 4


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--exit-head", required=True)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--keep", default="16,32", help="comma list of kept node counts")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=3, help="timed calls per stage per round")
    args = ap.parse_args(argv)
    keeps = [int(k) for k in args.keep.split(",")]
    tparams, tcfg = load_hf(args.checkpoint, dtype=jnp.float32)
    dparams, dcfg = dr.load_drafter(DRAFTER, dtype=jnp.float32)
    tcfg = tcfg.with_taps(dcfg.tap_layers)
    ranking = draft_vocab.load_ranking(DRAFTER / draft_vocab.RANKING_FILE, tcfg.vocab_size)
    dparams = draft_vocab.with_draft_vocab(dparams, tparams, tcfg, draft_vocab.select(ranking, 8192, tcfg.vocab_size))
    hparams, ids, hcfg = exit_head.load(args.exit_head, tcfg)
    layer = hcfg.exit_layer
    head = exit_head.for_target(hparams, ids, tparams, tcfg)
    tparams = dense.fuse_projections(tparams)  # the layout the run harness multiplies with
    head_params = two_level.with_exit_head(tparams, head)
    target, drafter = dense.target(tcfg, jnp.float32), dr.BlockDrafter(dcfg, tcfg, draft_width=dcfg.block_size)
    context = jnp.array([args.context], jnp.int32)
    tstate = target.init_state(1, args.context + 2 * args.nodes).commit(context)
    dstate = drafter.init_state(dparams, 1, args.context + 2 * args.nodes).commit(context)
    last = jnp.array([42], jnp.int32)

    def draft(dp, tp, ds, n):
        logits, _ = drafter.propose(dp, tp, ds, last, DEPTH + 1)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return build_tree(logp, last, n, DEPTH, BRANCHING), logp

    def first_level(tp, ts, tree, logp, first, keep, head):
        scores = two_level.first_level_scores(first, None if first == "drafter_confidence" else layer, DEPTH,
                                              target, tp, ts, tree, logp, head)
        return two_level.select_subtree(tree, scores, keep)[1]

    sizes = sorted({*keeps, 16, 32, args.nodes})
    drafted = jax.jit(draft, static_argnums=3)
    trees = {n: drafted(dparams, tparams, dstate, n) for n in sizes}
    big, logp = trees[args.nodes]
    stages = {f"draft {n}": (drafted, (dparams, tparams, dstate, n)) for n in sorted({16, 32, args.nodes})}
    fl = jax.jit(first_level, static_argnums=(4, 5, 6))
    for name, first, head, tp in (("confidence", "drafter_confidence", False, tparams),
                                  (f"untrained exit L{layer}", "early_exit", False, tparams),
                                  (f"trained head L{layer}", "early_exit", True, head_params)):
        stages[f"first: {name}"] = (fl, (tp, tstate, big, logp, first, keeps[0], head))
    verify = jax.jit(lambda tp, ts, t: tree_loop.tree_forward(target, tp, ts, t)[0])
    for n in sizes:
        stages[f"verify {n}"] = (verify, (tparams, tstate, trees[n][0]))
    times = {k: [] for k in stages}
    for fn, a in stages.values():
        jax.block_until_ready(fn(*a))  # compile
    for _ in range(args.rounds):
        for k, (fn, a) in stages.items():
            for _ in range(args.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a))
                times[k].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"SmolLM2 pair, {args.nodes}-node tree (depth {DEPTH}, branching {BRANCHING}), context {args.context}, "
          f"{jax.devices()[0].platform}, median of {args.rounds} x {args.calls} interleaved")
    for k, v in ms.items():
        print(f"  {k:<28} {v:8.2f} ms")
    print("step without accept (draft + first level + verify):")
    for n in sorted({16, 32, args.nodes}):
        print(f"  tree {n:<23} {ms[f'draft {n}'] + ms[f'verify {n}']:8.2f} ms")
    full = ms[f"draft {args.nodes}"]
    for k in keeps:
        for name in ("confidence", f"untrained exit L{layer}", f"trained head L{layer}"):
            print(f"  {name + f' {args.nodes}->{k}':<28} {full + ms[f'first: {name}'] + ms[f'verify {k}']:8.2f} ms")


if __name__ == "__main__":
    main()
