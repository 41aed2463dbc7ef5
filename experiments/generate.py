"""Generate text with AR decoding from a local checkpoint.

    python experiments/generate.py --checkpoint DIR --prompt "def fib(n):" --max-new-tokens 64
    python experiments/generate.py --checkpoint DIR --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.95
    python experiments/generate.py --checkpoint ~/.cache/specpilot --prompt "def fib(n):"

DIR is a Hugging Face folder (config.json + *.safetensors), a target trained here (a model folder, a
pair folder such as experiments/train.py's out_dir, or the cache directory holding the embedded
pair; `experiments/export.py` turns any of these into a Hugging Face folder). The tokenizer is the
target folder's `tokenizer.json` unless --tokenizer names another; with --prompt-ids no tokenizer is
needed and ids are printed.
"""

import argparse
import sys

import jax
import jax.numpy as jnp

from specpilot.decoding.ar import generate
from specpilot.decoding.sampling import SamplingConfig
from specpilot.embedded import find_target
from specpilot.models import dense
from specpilot.training.checkpointing import load_target


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="HF folder, a target trained here, a pair folder or the cache directory")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the target folder's)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return ap.parse_args(argv)


def main(argv=None) -> list[int]:
    args = parse_args(argv)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    try:
        folder = find_target(args.checkpoint)
        params, cfg = load_target(folder, dtype=jnp.dtype(args.dtype))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    if str(folder) != str(args.checkpoint):
        print(f"[target: {folder}]", file=sys.stderr)
    tokenizer = None
    if args.prompt is not None:
        from specpilot.data.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer or folder)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}; pass --tokenizer or --prompt-ids")
        prompt = tokenizer.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise SystemExit(f"prompt ids {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    res = generate(dense.target(cfg, params["embed"].dtype), params, [prompt], args.max_new_tokens, sampling,
                   key=jax.random.key(args.seed))
    out = res.as_lists(cfg.eos_token_id)[0]
    if tokenizer is not None:
        print(tokenizer.decode(out))
    else:
        print(",".join(map(str, out)))
    print(f"[{len(out)} tokens, prefill {1e3 * res.prefill_s:.1f} ms, "
          f"{1e3 * res.decode_time_per_token:.2f} ms/token]", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
