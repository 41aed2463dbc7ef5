"""The embedded pair: a tiny target and its block drafter trained here on data every machine has (the
running interpreter's standard library), cached under `cache_dir` by a hash of everything that determines
them, and reused; held-out prompts for the comparison come with it. Each stage resumes or is skipped when
its output is present; an output that cannot be read is rebuilt with a warning (docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax.numpy as jnp

from specpilot import atomic_io
from specpilot.data.corpus import load_corpus
from specpilot.data.prompts import PromptSet, make_prompts
from specpilot.data.tokenizer import TextTokenizer, load_tokenizer, train_tokenizer
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import load_model
from specpilot.training.drafter import DrafterTrainConfig, train_drafter
from specpilot.training.locate import DRAFTER_MODEL, PAIR_PREFIX, TARGET_MODEL
from specpilot.training.target import TargetTrainConfig, train_target


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
    record = {**dataclasses.asdict(cfg), "corpus_root": str(corpus.root)}
    atomic_io.write_json(directory / "config.json", record, indent=2, default=str)

    tok_path = directory / "tokenizer.json"
    tokenizer = atomic_io.read_cache(tok_path, load_tokenizer, "the embedded tokenizer")
    if tokenizer is None:
        _log(f"training a {cfg.vocab_size}-token BPE tokenizer on {corpus.root}")
        tokenizer = train_tokenizer(corpus.texts("train"), cfg.vocab_size, cfg.tokenizer_bytes)
        tokenizer.save(tok_path)

    target_dir = directory / TARGET_MODEL.parent
    target = atomic_io.read_cache(directory / TARGET_MODEL, lambda p: load_model(p, dtype=dtype),
                                  "the embedded target")
    if target is None:
        _log(f"training the target ({cfg.target.steps} steps) into {target_dir}")
        train_target(cfg.target, corpus, tokenizer, target_dir, progress=progress)
        target = load_model(directory / TARGET_MODEL, dtype=dtype)
    target_params, target_cfg = target

    drafter_dir = directory / DRAFTER_MODEL.parent
    drafter = atomic_io.read_cache(directory / DRAFTER_MODEL, lambda p: dr.load_drafter(p, dtype=dtype),
                                   "the embedded drafter")
    if drafter is None:
        _log(f"training the drafter ({cfg.drafter.steps} steps) into {drafter_dir}")
        train_drafter(cfg.drafter, corpus, tokenizer, target_params, target_cfg, drafter_dir,
                      progress=progress)
        drafter = dr.load_drafter(directory / DRAFTER_MODEL, dtype=dtype)
    drafter_params, drafter_cfg = drafter
    target_cfg = target_cfg.with_taps(drafter_cfg.tap_layers)

    prompts_path = directory / f"prompts-{cfg.prompt_kind}-{cfg.num_prompts}x{cfg.prompt_len}.json"
    prompts = atomic_io.read_cache(prompts_path, PromptSet.load, "the embedded prompt set")
    if prompts is None:
        prompts = make_prompts(corpus, tokenizer, cfg.num_prompts, cfg.prompt_len, kind=cfg.prompt_kind)
        prompts.save(prompts_path)
    return EmbeddedPair(directory, tokenizer, target_params, target_cfg, drafter_params, drafter_cfg,
                        prompts, elapsed_s=time.perf_counter() - t0)

