"""The embedded default deployment: a tiny target and its block drafter trained here, cached, reused.

Nothing can be downloaded, so the default run trains its own pair on data every machine has (the
Python standard library of the running interpreter), keeps it under a cache directory and runs the
comparison on held-out prompts.

Design choices:
- The cache key is a hash of everything that determines the pair: corpus root and split, tokenizer size,
  and the target and drafter training configs. Changing any of them trains a new pair beside the old.
- Each stage keeps its own output (tokenizer.json, target/model, drafter/model, prompts.json) and is
  skipped when present; the training stages resume from their orbax checkpoints, so an interrupted
  first run continues where it stopped. A stage is marked done only by its final output, so nothing
  half-written is ever loaded.
- `find_target` maps what a user may name — the cache directory, a pair folder (this layout, which
  `experiments/train.py` also writes), or a target folder itself — to the folder holding the target's
  weights, so the generation and export commands read the cached pair without knowing its hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax.numpy as jnp

from specpilot.data.corpus import load_corpus
from specpilot.data.prompts import PromptSet, make_prompts
from specpilot.data.tokenizer import TextTokenizer, load_tokenizer, train_tokenizer
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import MODEL_RECORD, is_model_folder, load_model
from specpilot.training.drafter import DrafterTrainConfig, train_drafter
from specpilot.training.target import TargetTrainConfig, train_target


PAIR_PREFIX = "embedded-"  # a pair folder's name is this prefix and the EmbeddedConfig key
TARGET_MODEL = Path("target") / "model"
DRAFTER_MODEL = Path("drafter") / "model"


@dataclasses.dataclass(frozen=True)
class EmbeddedConfig:
    corpus_root: str | None = None  # None: the running interpreter's standard library
    heldout_fraction: float = 0.05
    vocab_size: int = 4096
    tokenizer_bytes: int = 8_000_000
    target: TargetTrainConfig = TargetTrainConfig()
    drafter: DrafterTrainConfig = DrafterTrainConfig()
    # benchmark prompts (held-out split)
    num_prompts: int = 16
    prompt_len: int = 96
    prompt_kind: str = "function"

    def key(self, corpus_root: str) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "corpus_root": corpus_root}, sort_keys=True,
                          default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclasses.dataclass
class EmbeddedPair:
    directory: Path
    tokenizer: TextTokenizer
    target_params: dict
    target_cfg: ModelConfig  # with the drafter's taps
    drafter_params: dict
    drafter_cfg: dr.DrafterConfig
    prompts: PromptSet
    elapsed_s: float  # seconds this call took (training included when a stage was missing)


def from_overrides(overrides: dict | None) -> EmbeddedConfig:
    """EmbeddedConfig with nested overrides, e.g. {"target": {"steps": 20}, "num_prompts": 4}."""
    overrides = dict(overrides or {})
    base = EmbeddedConfig()
    nested = {}
    for name, cls in (("target", TargetTrainConfig), ("drafter", DrafterTrainConfig)):
        sub = overrides.pop(name, None) or {}
        if "tap_layers" in sub and sub["tap_layers"] is not None:
            sub["tap_layers"] = tuple(sub["tap_layers"])
        try:
            nested[name] = dataclasses.replace(getattr(base, name), **sub)
        except TypeError as e:
            raise ValueError(f"embedded.{name}: {e}") from e
    try:
        return dataclasses.replace(base, **overrides, **nested)
    except TypeError as e:
        raise ValueError(f"embedded: {e}") from e


def _log(msg: str) -> None:
    print(f"[embedded] {msg}", flush=True)


def ensure_pair(cache_dir: str | Path, cfg: EmbeddedConfig = EmbeddedConfig(), dtype=jnp.float32,
                progress: bool = True) -> EmbeddedPair:
    """Load the cached pair for `cfg`, training whatever stage is missing first."""
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.corpus_root, heldout_fraction=cfg.heldout_fraction)
    directory = Path(cache_dir).expanduser() / f"{PAIR_PREFIX}{cfg.key(str(corpus.root))}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        {**dataclasses.asdict(cfg), "corpus_root": str(corpus.root)}, indent=2, default=str) + "\n")

    tok_path = directory / "tokenizer.json"
    if tok_path.exists():
        tokenizer = load_tokenizer(tok_path)
    else:
        _log(f"training a {cfg.vocab_size}-token BPE tokenizer on {corpus.root}")
        tokenizer = train_tokenizer(corpus.texts("train"), cfg.vocab_size, cfg.tokenizer_bytes)
        tmp = tokenizer.save(directory / "tokenizer.tmp.json")  # a .json name: saved as this file itself
        tmp.rename(tok_path)  # atomic: a half-written tokenizer is never picked up

    target_dir = directory / TARGET_MODEL.parent
    if not (directory / TARGET_MODEL / MODEL_RECORD).exists():
        _log(f"training the target ({cfg.target.steps} steps) into {target_dir}")
        train_target(cfg.target, corpus, tokenizer, target_dir, progress=progress)
    target_params, target_cfg = load_model(directory / TARGET_MODEL, dtype=dtype)

    drafter_dir = directory / DRAFTER_MODEL.parent
    if not (directory / DRAFTER_MODEL / "model.safetensors").exists():
        _log(f"training the drafter ({cfg.drafter.steps} steps) into {drafter_dir}")
        train_drafter(cfg.drafter, corpus, tokenizer, target_params, target_cfg, drafter_dir,
                      progress=progress)
    drafter_params, drafter_cfg = dr.load_drafter(directory / DRAFTER_MODEL, dtype=dtype)
    target_cfg = target_cfg.with_taps(drafter_cfg.tap_layers)

    prompts_path = directory / f"prompts-{cfg.prompt_kind}-{cfg.num_prompts}x{cfg.prompt_len}.json"
    if prompts_path.exists():
        prompts = PromptSet.load(prompts_path)
    else:
        prompts = make_prompts(corpus, tokenizer, cfg.num_prompts, cfg.prompt_len, kind=cfg.prompt_kind)
        prompts.save(prompts_path)
    return EmbeddedPair(directory, tokenizer, target_params, target_cfg, drafter_params, drafter_cfg,
                        prompts, elapsed_s=time.perf_counter() - t0)


def _holds_target(path: Path) -> bool:
    """A model folder written here, or a Hugging Face directory (config.json + safetensors)."""
    return is_model_folder(path) or ((path / "config.json").is_file() and any(path.glob("*.safetensors")))


def find_target(path: str | Path) -> Path:
    """The folder holding a target's weights, given that folder itself (a Hugging Face directory or a
    model folder), a pair folder (its target/model), or a cache directory holding one pair."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if _holds_target(path):
        return path
    if _holds_target(path / TARGET_MODEL):
        return path / TARGET_MODEL
    pairs = sorted(p for p in path.glob(f"{PAIR_PREFIX}*") if _holds_target(p / TARGET_MODEL))
    if len(pairs) == 1:
        return pairs[0] / TARGET_MODEL
    if pairs:
        raise ValueError(f"{path} holds {len(pairs)} trained pairs ({', '.join(p.name for p in pairs)}); "
                         f"name one of them")
    raise FileNotFoundError(
        f"no target in {path}: expected a Hugging Face directory (config.json + *.safetensors), a "
        f"model folder ({MODEL_RECORD}), a pair folder with {TARGET_MODEL}/, or a cache directory "
        f"holding a {PAIR_PREFIX}* pair")
