"""Generate text from a local checkpoint, speculatively when a drafter made for the target is beside it.

    python experiments/generate.py --checkpoint ~/.cache/specpilot --prompt "def fib(n):" --max-new-tokens 64
    python experiments/generate.py --checkpoint DIR --prompt-ids 1,2,3 --temperature 0.8 --top-p 0.95
    python experiments/generate.py --checkpoint DIR --prompt "def fib(n):" --drafter none   # AR only

DIR is a Hugging Face folder (config.json + *.safetensors), a target trained here (a model folder or a pair
folder such as experiments/train.py's out_dir), or a cache directory: `~/.cache/specpilot` after
`make run` holds the default deployment's SmolLM2-135M-Instruct, decoded with its packaged drafter
(`experiments/export.py` turns any of these into a Hugging Face folder). `--drafter auto` uses the drafter
made for the target (a pair's, or the packaged one of the default deployment) and AR where there is none;
the output is the AR output either way (lossless). The tokenizer is the target folder's `tokenizer.json`
unless --tokenizer names another; with --prompt-ids no tokenizer is needed and ids are printed.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from specpilot.data.tokenizer import load_tokenizer
from specpilot.decoding import ar, spec
from specpilot.decoding.sampling import SamplingConfig
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ConfigError
from specpilot.training.checkpointing import load_target
from specpilot.training.locate import locate


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="HF folder, a target trained here, a pair folder or the cache directory")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the target folder's)")
    ap.add_argument("--drafter", default="auto",
                    help="auto (the drafter made for the target, if any), none (AR), or a DFlash drafter folder")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per verification (default: the drafter's trained block size)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return ap.parse_args(argv)


def _drafter_folder(choice: str, found: Path | None) -> Path | None:
    if choice == "auto":
        return found
    return None if choice == "none" else Path(choice).expanduser()


def _prompt(args, folder: Path, vocab_size: int):
    """-> (prompt ids, tokenizer or None)."""
    if args.prompt is not None:
        try:
            tokenizer = load_tokenizer(args.tokenizer or folder)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}; pass --tokenizer or --prompt-ids")
        return tokenizer.encode(args.prompt), tokenizer
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise SystemExit(f"prompt ids {bad} are outside the vocabulary [0, {vocab_size})")
    return prompt, None


def main(argv=None) -> list[int]:
    args = parse_args(argv)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    dtype = jnp.dtype(args.dtype)
    try:
        found = locate(args.checkpoint)
        drafter_folder = _drafter_folder(args.drafter, found.drafter)
        drafter_params = dcfg = None
        if drafter_folder is not None:
            drafter_params, dcfg = dr.load_drafter(drafter_folder, dtype=dtype)
        params, cfg = load_target(found.target, dtype=dtype, tap_layers=dcfg.tap_layers if dcfg else ())
        if dcfg is not None:
            dr.check_compatible(dcfg, cfg)
    except (FileNotFoundError, ValueError) as e:  # checkpoint, drafter and config errors are ValueErrors
        hint = " (--drafter none decodes without it)" if isinstance(e, ConfigError) else ""
        raise SystemExit(f"error: {e}{hint}")
    if str(found.target) != str(args.checkpoint):
        print(f"[target: {found.target}{'; ' + found.note if found.note else ''}]", file=sys.stderr)
    prompt, tokenizer = _prompt(args, found.target, cfg.vocab_size)
    target = dense.target(cfg, params["embed"].dtype)
    key = jax.random.key(args.seed)
    if dcfg is None:
        res = ar.generate(target, params, [prompt], args.max_new_tokens, sampling, key=key)
        how = "AR"
    else:
        block = args.block_size or dcfg.block_size
        drafter = dr.BlockDrafter(dataclasses.replace(dcfg, block_size=block), cfg)
        res = spec.generate(target, params, drafter, drafter_params, [prompt], args.max_new_tokens,
                            sampling=sampling, key=key)
        how = f"drafter {drafter_folder.name} at block {block}, tau {res.stats.tau:.2f}"
    out = res.as_lists(cfg.eos_token_id)[0]
    print(tokenizer.decode(out) if tokenizer is not None else ",".join(map(str, out)))
    print(f"[{len(out)} tokens, {how}, prefill {1e3 * res.prefill_s:.1f} ms, "
          f"{1e3 * res.decode_time_per_token:.2f} ms/token]", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
