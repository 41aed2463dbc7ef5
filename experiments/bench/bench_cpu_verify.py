"""What one target forward over T tokens costs, split into the decoder stack and the LM head.

    PYTHONPATH=. python experiments/bench/bench_cpu_verify.py --checkpoint DIR [--tokens 1,4,8,16] [--trials 20]

A verification of a block of T tokens is one such forward; AR is T = 1. The state holds `--context`
committed positions (the mean context of the default chat prompts). Prints the median ms of the whole
forward, of the stack alone (final-normed hidden states, no head) and of the head alone on T rows, and
each as a multiple of the T = 1 forward. Any Hugging Face folder the loader reads works, e.g. the
converted SmolLM2 under cache_dir/gguf/.
"""

import argparse

import jax
import jax.numpy as jnp

from specpilot.harness.bench import median_ms
from specpilot.models import dense
from specpilot.models.checkpoint import load_hf
from specpilot.state import causal_mask, chain_positions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", default="1,4,8,16", help="comma list of T")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    params, cfg = load_hf(args.checkpoint, dtype=dtype)
    params = dense.fuse_projections(params)
    state = dense.init_state(cfg, 1, args.context + 64, dtype).commit(jnp.array([args.context], jnp.int32))

    @jax.jit
    def full(params, tokens, state):
        positions = chain_positions(state, tokens.shape[1])
        return dense.forward(params, cfg, tokens, positions, state, causal_mask(state, positions))[0]

    @jax.jit
    def stack(params, tokens, state):
        positions = chain_positions(state, tokens.shape[1])
        return dense.hidden_forward(params, cfg, dense.embed(params, tokens), positions, state,
                                    causal_mask(state, positions))[0]

    @jax.jit
    def head(params, hidden):
        return dense.lm_head(params, cfg, hidden)

    print(f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {args.dtype}, "
          f"context {args.context}, {jax.devices()[0].platform}, median of {args.trials}")
    print(f"{'T':>4}{'forward ms':>12}{'stack ms':>10}{'head ms':>9}{'forward/AR':>12}{'stack/AR':>10}{'head/AR':>9}")
    base = None
    for t in (int(x) for x in args.tokens.split(",")):
        tokens = jnp.zeros((1, t), jnp.int32)
        f = median_ms(full, params, tokens, state, trials=args.trials)
        s = median_ms(stack, params, tokens, state, trials=args.trials)
        h = median_ms(head, params, jnp.ones((1, t, cfg.hidden_size), dtype), trials=args.trials)
        base = base or f
        print(f"{t:>4}{f:>12.2f}{s:>10.2f}{h:>9.2f}{f / base:>12.2f}{s / base:>10.2f}{h / base:>9.2f}")


if __name__ == "__main__":
    main()
