"""A deployment's shapes from its config alone, without a weight: the target's and the drafter's model
configs, the cache length and the cost model's `Shape`. The memory fit check and `predict.py` work from
these, and a drafter that cannot read its target (hidden size, vocabulary, tapped layers) fails here in
one line before anything is built."""

from __future__ import annotations

import dataclasses
import glob
import json
import re
from pathlib import Path

import jax.numpy as jnp
from omegaconf import DictConfig, OmegaConf

from specpilot.costmodel import counts
from specpilot.data.registry_models import SMOLLM2_FILE
from specpilot.harness.config_errors import ConfigValueError
from specpilot.models import drafter as dr
from specpilot.models import gguf_import
from specpilot.models.checkpoint import HYBRID_ARCHITECTURES
from specpilot.models.config import ConfigError, ModelConfig, default_tap_layers, read_config_json
from specpilot.models.hybrid_config import HybridConfig

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
CACHE_ROUND = 128  # cache slots are allocated in multiples of this
ORACLE_SOURCES = ("oracle", "oracle_trace")  # drafters that wrap a random drafter of the target's shape


def target_tap_layers(tconf: DictConfig, dconf: DictConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs a drafter reads: `target.tap_layers`, else the drafter's evenly
    spaced DFlash choice (none without a drafter)."""
    if tconf.get("tap_layers"):
        return tuple(int(t) for t in tconf.tap_layers)
    if dconf.source == "none":
        return ()
    return default_tap_layers(num_layers, int(dconf.num_taps))


def model_config(hf: dict):
    """The ModelConfig (dense) or HybridConfig (Qwen3.5) of config.json fields."""
    if (hf.get("architectures") or [None])[0] in HYBRID_ARCHITECTURES or hf.get("model_type") == "qwen3_5_text":
        return HybridConfig.from_hf_dict(hf)
    return ModelConfig.from_hf_dict(hf)


def gguf_path(tconf: DictConfig, cache_dir: str) -> Path:
    """The GGUF file a gguf / smollm2 target is converted from (smollm2: where it is cached once fetched)."""
    if tconf.source == "smollm2":
        return Path(cache_dir).expanduser() / SMOLLM2_FILE
    return Path(str(tconf.path)).expanduser()


def _converted_config(path: Path, cache_dir: str):
    """The model a GGUF file describes, from its conversion under `cache_dir` (`gguf_import.import_cached`'s
    folder, named by the file's stem and hash), or None before the first conversion. Its header alone
    would take seconds to parse."""
    found = sorted((Path(cache_dir).expanduser() / "gguf").glob(f"{glob.escape(path.stem)}-*/config.json"))
    folders = [f for f in found if re.fullmatch(r"[0-9a-f]{12}", f.parent.name[len(path.stem) + 1:])]
    if len(folders) > 1:  # several files of this name were converted: the hash says which is this one
        digest = gguf_import.file_key(path)["sha256"][:12]
        folders = [f for f in folders if f.parent.name == f"{path.stem}-{digest}"]
    return model_config(read_config_json(folders[0])) if folders else None


def _base_target_config(cfg: DictConfig):
    t = cfg.target
    if t.source == "random":
        return model_config(OmegaConf.to_container(t.model, resolve=True))
    if t.source == "hf":
        return model_config(read_config_json(Path(str(t.path)).expanduser() / "config.json"))
    if t.source in ("gguf", "smollm2"):
        path = gguf_path(t, str(cfg.cache_dir))
        return _converted_config(path, str(cfg.cache_dir)) if path.is_file() else None
    return None  # embedded: the pair is trained here, its shapes known once it is


def target_config(cfg: DictConfig):
    """The target's model config with the taps its drafter reads, or None where the shape is not known
    before the target is built (the embedded pair; a GGUF file before its first conversion). A shape
    that cannot exist fails naming target.model."""
    try:
        base = _base_target_config(cfg)
    except (ConfigError, gguf_import.GGUFImportError, KeyError, OSError, TypeError, ValueError) as e:
        key = "target.model" if cfg.target.source == "random" else "target.path"
        raise ConfigValueError(f"{key}: {' '.join(str(e).split())}") from None
    if base is None:
        return None
    try:
        return base.with_taps(target_tap_layers(cfg.target, cfg.drafter, base.num_layers))
    except ConfigError as e:
        key = "target.tap_layers" if cfg.target.get("tap_layers") else "drafter.num_taps"
        raise ConfigValueError(f"{key}: {e} (the target has {base.num_layers} layers)") from None


def drafter_config(cfg: DictConfig, target) -> dr.DrafterConfig | None:
    """The drafter's config against `target` (a `target_config`), or None for no drafter or the embedded
    pair's (trained with its target)."""
    d = cfg.drafter
    if d.source in ("random",) + ORACLE_SOURCES:
        return dr.DrafterConfig.for_target(target, num_layers=int(d.num_layers), block_size=int(d.block_size),
                                           num_taps=int(d.num_taps))
    if d.source in ("dflash", "packaged"):
        path = dr.PACKAGED / str(d.path) if d.source == "packaged" else Path(str(d.path)).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigValueError(f"drafter.path: no drafter checkpoint (config.json) in {path}")
        dcfg = dr.DrafterConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        return dataclasses.replace(dcfg, block_size=int(d.block_size))
    return None


def check_drafter_fits(cfg: DictConfig):
    """Raise ConfigValueError (one line) when the drafter cannot read the target's states, embedding or
    head; -> (target config, drafter config), either None where not known before building."""
    target = target_config(cfg)
    if target is None or cfg.drafter.source in ("none", "embedded"):
        return target, None
    try:
        dcfg = drafter_config(cfg, target)
        if dcfg is not None:
            dr.check_compatible(dcfg, target.with_taps(dcfg.tap_layers))
    except (ConfigError, json.JSONDecodeError) as e:
        raise ConfigValueError(
            f"drafter: drafter={cfg.drafter.name} does not fit target={cfg.target.name}: "
            f"{' '.join(str(e).split())}; use a drafter trained for this target, or drafter=oracle / "
            f"drafter=random (made at the target's shape)") from None
    return target.with_taps(dcfg.tap_layers) if dcfg is not None else target, dcfg


def cache_len(longest_prompt: int, new_tokens: int, block: int, given: int | None = None) -> int:
    """Slots per attention state: `bench.cache_len`, else prompt + new tokens + one block, rounded up."""
    return int(given or -(-(longest_prompt + new_tokens + block) // CACHE_ROUND) * CACHE_ROUND)


def cost_shape(cfg: DictConfig, plans) -> counts.Shape:
    """The cost model's Shape of a deployment from its config alone: prompts at `bench.prompt_len` (a
    random prompt set's length; a text set's prompts are at most that long), the mean committed length
    over the decode as its context. Equals `counts.Shape.from_deployment` of the built deployment for
    random prompts."""
    target, dcfg = check_drafter_fits(cfg)
    if target is None:
        raise ConfigValueError(f"target: the shape of {cfg.target.name!r} ({cfg.target.source}) is known only "
                               "once it is built; give a target with a shape (random, hf, gguf)")
    b = cfg.bench
    block = max(p.block_size for p in plans)
    return counts.Shape(
        target=target, drafter=dcfg, batch=int(b.batch_size),
        context=int(b.prompt_len + b.new_tokens / 2),
        cache_len=cache_len(int(b.prompt_len), int(b.new_tokens), block, b.cache_len),
        dtype_bytes=jnp.dtype(DTYPES[cfg.target.dtype]).itemsize, oracle=cfg.drafter.source == "oracle",
        greedy=float(cfg.decoding.temperature) == 0.0,
        fused=cfg.target.layout == "fused" and isinstance(target, ModelConfig),
        draft_width=int(cfg.drafter.get("draft_width") or 0))
