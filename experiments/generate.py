"""Generate text with AR decoding from a local Hugging Face checkpoint.

    python experiments/generate.py --checkpoint DIR --prompt "def fib(n):" --max-new-tokens 64
    python experiments/generate.py --checkpoint DIR --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.95

The tokenizer is `tokenizer.json` in the checkpoint folder unless --tokenizer names another; with
--prompt-ids no tokenizer is needed and ids are printed.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from specpilot.decoding.ar import generate  # noqa: E402
from specpilot.decoding.sampling import SamplingConfig  # noqa: E402
from specpilot.models.checkpoint import load_hf  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="HF folder: config.json + *.safetensors")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's)")
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
    params, cfg = load_hf(args.checkpoint, dtype=jnp.dtype(args.dtype))
    tokenizer = None
    if args.prompt is not None:
        from specpilot.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer or args.checkpoint)
        prompt = tokenizer.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise SystemExit(f"prompt ids {bad} are outside the vocabulary [0, {cfg.vocab_size})")
    res = generate(params, cfg, [prompt], args.max_new_tokens, sampling, key=jax.random.key(args.seed))
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
