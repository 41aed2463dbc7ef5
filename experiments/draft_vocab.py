"""Build the token ranking a reduced draft vocabulary takes its first K ids from (`drafter.draft_vocab=K`):
SmolLM2-135M-Instruct's own greedy replies to chat requests of the corpus's TRAIN split (the drafter's
training requests; the held-out bench requests are never read), counted token by token, every id ranked
most frequent first; ids the replies tie on (most never occur) by their count in all the train requests, then
by id. Writes draft_vocab.npy beside the packaged drafter unless --out says otherwise:

    python experiments/draft_vocab.py --num-prompts 256 --gen-len 128
"""

import argparse
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specpilot.data import prompt_sets
from specpilot.data.chat import chat_prompt_ids, stdlib_requests
from specpilot.data.corpus import load_corpus
from specpilot.data.registry_models import smollm2_gguf
from specpilot.models import draft_vocab
from specpilot.models.checkpoint import load_hf
from specpilot.models.drafter import PACKAGED
from specpilot.models.gguf_import import import_cached
from specpilot.training.drafter import regenerate
from specpilot.training.locate import DEFAULT_DRAFTER

DEFAULT_OUT = PACKAGED / DEFAULT_DRAFTER / draft_vocab.RANKING_FILE


def train_prompts(text, max_tokens: int) -> list[list[int]]:
    """The train split's chat prompts (one request of each kind per function) of at most max_tokens."""
    requests = stdlib_requests(load_corpus(None), "train", every_kind=True)
    prompts, _ = chat_prompt_ids(text.tokenizer, text.chat_template, requests, max_tokens,
                                 special_tokens=text.special_tokens)
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default="~/.cache/specpilot")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    folder = import_cached(smollm2_gguf(args.cache_dir), args.cache_dir)
    params, cfg = load_hf(folder, dtype=jnp.float32)
    text = prompt_sets.load_model_text(folder)
    every = train_prompts(text, args.max_prompt_tokens)
    prompts = prompt_sets.evenly_spaced(every, min(args.num_prompts, len(every)))
    t0 = time.perf_counter()
    seqs = regenerate(params, cfg, prompts, args.gen_len, args.batch, text.tokenizer.eos_id,
                      progress=lambda n: print(f"  {n}/{len(prompts)} replies", flush=True))
    counts, in_prompts = np.zeros(cfg.vocab_size, np.int64), np.zeros(cfg.vocab_size, np.int64)
    for row, start, end in zip(seqs.tokens, seqs.starts, seqs.ends):
        np.add.at(counts, row[start:end], 1)
    for p in every:  # the tie-break: every train request's tokens (code the replies quote)
        np.add.at(in_prompts, p, 1)
    ranking = draft_vocab.ranking_from_counts(counts, in_prompts)
    ranking = ranking.astype(np.uint16 if cfg.vocab_size <= 2**16 else np.int32)  # 96 KB for SmolLM2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, ranking)
    total, seen = int(counts.sum()), int((counts > 0).sum())
    order = np.sort(counts)[::-1]
    cover = ", ".join(f"top {k}: {order[:k].sum() / total:.4f}" for k in (1024, 4096, 8192, 16384))
    print(f"{len(prompts)} of {len(every)} train prompts answered, {total} reply tokens "
          f"({time.perf_counter() - t0:.0f} s), {seen} distinct; share covered: {cover} -> {args.out}")


if __name__ == "__main__":
    main()
