"""Export a target to a Hugging Face folder that `load_hf` and transformers read.

    python experiments/export.py ~/.cache/specpilot runs/exported   # the default deployment's SmolLM2
    python experiments/export.py runs/pair OUT --dtype bfloat16      # experiments/train.py's out_dir

SOURCE is anything `experiments/generate.py --checkpoint` takes: a cache directory (after `make run`, the
default deployment's converted SmolLM2-135M-Instruct), a pair folder, a model folder (orbax weights) or a
Hugging Face folder. OUT receives config.json (with the source's bos/eos/pad token ids), model.safetensors
(sharded with an index under --max-shard-mb) and the source's tokenizer files (tokenizer.json,
tokenizer_config.json with the chat template and special tokens, generation_config.json, ...). A
drafter made for the target is already in the DFlash format (config.json + model.safetensors) and is
named, not copied.
"""

import argparse

import jax.numpy as jnp

from specpilot.training.checkpointing import export_hf
from specpilot.training.locate import locate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="cache directory, pair folder, model folder or HF folder")
    ap.add_argument("out", help="the Hugging Face folder to write")
    ap.add_argument("--dtype", choices=("stored", "bfloat16", "float32"), default="stored",
                    help="dtype of the written weights (default: as stored)")
    ap.add_argument("--max-shard-mb", type=float, default=None, help="shard files above this size")
    args = ap.parse_args(argv)
    try:
        found = locate(args.source)
        dtype = None if args.dtype == "stored" else jnp.dtype(args.dtype)
        shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
        out = export_hf(found.target, args.out, dtype=dtype, max_shard_bytes=shard)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    print(f"target {found.target} -> {out}{' (' + found.note + ')' if found.note else ''}")
    if found.drafter is not None:
        print(f"its drafter (DFlash format, loadable as it is): {found.drafter}")
    return out


if __name__ == "__main__":
    main()
