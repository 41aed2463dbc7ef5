"""Export a target trained here to a Hugging Face folder that `load_hf` and transformers read.

    python experiments/export.py ~/.cache/specpilot OUT          # the cached embedded pair's target
    python experiments/export.py runs/pair OUT --dtype bfloat16  # experiments/train.py's out_dir

SOURCE is anything `experiments/generate.py --checkpoint` takes: the cache directory holding one
embedded pair, a pair folder, a model folder (orbax weights) or a Hugging Face folder. OUT receives
config.json, model.safetensors (sharded with an index under --max-shard-mb) and tokenizer.json. A
pair's drafter is already in the DFlash format (config.json + model.safetensors) and is not copied.
"""

import argparse

import jax.numpy as jnp

from specpilot.embedded import DRAFTER_MODEL, TARGET_MODEL, find_target
from specpilot.training.checkpointing import export_hf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="cache directory, pair folder, model folder or HF folder")
    ap.add_argument("out", help="the Hugging Face folder to write")
    ap.add_argument("--dtype", choices=("stored", "bfloat16", "float32"), default="stored",
                    help="dtype of the written weights (default: as stored)")
    ap.add_argument("--max-shard-mb", type=float, default=None, help="shard files above this size")
    args = ap.parse_args(argv)
    try:
        folder = find_target(args.source)
        dtype = None if args.dtype == "stored" else jnp.dtype(args.dtype)
        shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
        out = export_hf(folder, args.out, dtype=dtype, max_shard_bytes=shard)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    print(f"target {folder} -> {out}")
    if folder.parts[-2:] == TARGET_MODEL.parts:
        drafter = folder.parent.parent / DRAFTER_MODEL
        if (drafter / "model.safetensors").is_file():
            print(f"its drafter (DFlash format, loadable as it is): {drafter}")
    return out


if __name__ == "__main__":
    main()
