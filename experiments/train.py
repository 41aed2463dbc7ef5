"""Train a tokenizer, a target or a block drafter: `python experiments/train.py stage=... out_dir=...`.

A drafter can be trained for any loadable target (a target trained here, or a local Hugging Face
checkpoint) on any folder of text files (`corpus.root=/path`). Each stage resumes from its orbax
checkpoints when run again with the same out_dir. See conf/train.yaml for the options.
"""

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import hydra
import jax.numpy as jnp
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specpilot.data.corpus import load_corpus
from specpilot.data.tokenizer import load_tokenizer, train_tokenizer
from specpilot.embedded import from_overrides
from specpilot.training.checkpointing import load_target
from specpilot.training.drafter import DrafterTrainConfig
from specpilot.training.target import TargetTrainConfig

for noisy in ("jax._src.xla_bridge", "absl", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

STAGES = ("tokenizer", "target", "drafter", "all")


def _mutable(cls):
    """A non-frozen copy of a frozen config dataclass: OmegaConf makes frozen ones read-only, which
    would refuse command-line overrides."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Conf", fields)


TargetSizes, DrafterSizes = _mutable(TargetTrainConfig), _mutable(DrafterTrainConfig)


@dataclasses.dataclass
class CorpusConf:
    root: Optional[str] = None  # None: the running interpreter's standard library
    heldout_fraction: float = 0.05


@dataclasses.dataclass
class TokenizerConf:
    vocab_size: int = 4096
    max_bytes: int = 8_000_000


@dataclasses.dataclass
class TrainConf:
    """Schema of conf/train.yaml: the training sizes are the library's own config dataclasses, so a
    misspelled or mistyped field fails at composition."""

    stage: str = "all"
    out_dir: str = MISSING
    corpus: CorpusConf = dataclasses.field(default_factory=CorpusConf)
    tokenizer: TokenizerConf = dataclasses.field(default_factory=TokenizerConf)
    target_path: Optional[str] = None
    target: TargetSizes = dataclasses.field(default_factory=TargetSizes)
    drafter: DrafterSizes = dataclasses.field(default_factory=DrafterSizes)
    progress: bool = True


ConfigStore.instance().store(name="train_schema", node=TrainConf)


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
        params, tcfg = load_target(target_path, dtype=jnp.float32)  # trained here or a HF checkpoint
        tok = load_tokenizer(target_path)
        _, dcfg = train_drafter(sizes.drafter, corpus, tok, params, tcfg, out / "drafter",
                                progress=bool(cfg.progress))
        print(f"drafter (block {dcfg.block_size}, taps {dcfg.tap_layers}) -> {out / 'drafter' / 'model'}")


if __name__ == "__main__":
    main()
