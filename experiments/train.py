"""Train a tokenizer, a target or a block drafter: `python experiments/train.py stage=... out_dir=...`.

A drafter can be trained for any loadable target (a target trained here, or a local Hugging Face
checkpoint) on any folder of text files (`corpus.root=/path`). Each stage resumes from its orbax
checkpoints when run again with the same out_dir. See conf/train.yaml for the options.
"""

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import jax.numpy as jnp  # noqa: E402

from specpilot.data.corpus import load_corpus  # noqa: E402
from specpilot.data.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from specpilot.embedded import from_overrides  # noqa: E402

for noisy in ("jax._src.xla_bridge", "absl", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

STAGES = ("tokenizer", "target", "drafter", "all")


def load_target(path: Path):
    """(params float32, cfg, tokenizer) of a target trained here (model/) or a HF checkpoint."""
    if (path / "specpilot.json").exists():
        from specpilot.training.checkpointing import load_model

        params, cfg = load_model(path, dtype=jnp.float32)
    else:
        from specpilot.models.checkpoint import load_hf

        params, cfg = load_hf(path, dtype=jnp.float32)
    return params, cfg, load_tokenizer(path)


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    if cfg.stage not in STAGES:
        raise SystemExit(f"stage must be one of {STAGES}, got {cfg.stage!r}")
    out = Path(cfg.out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    sizes = from_overrides({"target": OmegaConf.to_container(cfg.target, resolve=True),
                            "drafter": OmegaConf.to_container(cfg.drafter, resolve=True)})
    corpus = load_corpus(cfg.corpus.root, heldout_fraction=float(cfg.corpus.heldout_fraction))
    print(f"corpus {corpus.root}: {len(corpus.train_files)} train / {len(corpus.heldout_files)} "
          f"held-out files")
    stages = STAGES[:3] if cfg.stage == "all" else (cfg.stage,)

    tok_path = out / "tokenizer.json"
    if "tokenizer" in stages or ("target" in stages and not tok_path.exists()):
        tok = train_tokenizer(corpus.texts("train"), int(cfg.tokenizer.vocab_size),
                              int(cfg.tokenizer.max_bytes))
        tok.save(tok_path)
        print(f"tokenizer: {tok.vocab_size} tokens -> {tok_path}")
    if "target" in stages:
        from specpilot.training.target import train_target

        train_target(sizes.target, corpus, load_tokenizer(tok_path), out / "target",
                     progress=bool(cfg.progress))
        print(f"target -> {out / 'target' / 'model'}")
    if "drafter" in stages:
        from specpilot.training.drafter import train_drafter

        target_path = Path(cfg.target_path or out / "target" / "model").expanduser()
        if not target_path.is_dir():
            raise SystemExit(f"no target at {target_path}; train one (stage=target) or set target_path")
        params, tcfg, tok = load_target(target_path)
        _, dcfg = train_drafter(sizes.drafter, corpus, tok, params, tcfg, out / "drafter",
                                progress=bool(cfg.progress))
        print(f"drafter (block {dcfg.block_size}, taps {dcfg.tap_layers}) -> {out / 'drafter' / 'model'}")


if __name__ == "__main__":
    main()
