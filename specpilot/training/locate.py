"""Which target, and which drafter beside it, a user means by a path: a target folder itself, a pair folder,
or a cache directory (`cache_dir`) holding the default deployment's converted SmolLM2, trained pairs or
other GGUF conversions. The generation and export commands resolve their paths here, so they read what
`experiments/run.py` cached without knowing its layout or hashes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specpilot.data.registry_models import SMOLLM2_FILE
from specpilot.models.drafter import PACKAGED
from specpilot.models.gguf_import import SOURCE_FILE
from specpilot.training.checkpointing import MODEL_RECORD, is_model_folder

PAIR_PREFIX = "embedded-"  # a trained pair's folder: this prefix and its config's hash
TARGET_MODEL = Path("target") / "model"  # a pair folder's target, drafter
DRAFTER_MODEL = Path("drafter") / "model"
GGUF_DIR = "gguf"  # `gguf_import.import_cached` converts into cache_dir/gguf/<stem>-<sha256 prefix>
DEFAULT_DRAFTER = "smollm2-135m-instruct-dflash-b16"  # conf/drafter/smollm2.yaml's packaged drafter


@dataclasses.dataclass(frozen=True)
class Located:
    """A target folder, the DFlash drafter folder made for it (None: none known) and, when a cache
    directory held several targets, a note naming the others."""

    target: Path
    drafter: Path | None = None
    note: str = ""


def holds_target(path: Path) -> bool:
    """A model folder written here, or a Hugging Face directory (config.json + safetensors)."""
    return is_model_folder(path) or ((path / "config.json").is_file() and any(path.glob("*.safetensors")))


def _holds_drafter(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def gguf_source(folder: Path) -> str | None:
    """The GGUF file name a converted folder was made from (its import record), or None."""
    try:
        return json.loads((folder / SOURCE_FILE).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def is_default_target(folder: Path) -> bool:
    """Whether `folder` is the default deployment's target: the SmolLM2 GGUF converted."""
    return gguf_source(folder) == SMOLLM2_FILE


def _drafter_for(target: Path) -> Path | None:
    """The drafter made for this target: its pair's, or the packaged one of the default deployment."""
    if target.parts[-2:] == TARGET_MODEL.parts:
        pair_drafter = target.parent.parent / DRAFTER_MODEL
        if _holds_drafter(pair_drafter):
            return pair_drafter
    if is_default_target(target) and _holds_drafter(PACKAGED / DEFAULT_DRAFTER):
        return PACKAGED / DEFAULT_DRAFTER
    return None


def cache_targets(cache: Path) -> list[Path]:
    """Every target a cache directory holds: its pairs' targets, then its GGUF conversions, each sorted."""
    pairs = sorted(p / TARGET_MODEL for p in cache.glob(f"{PAIR_PREFIX}*") if holds_target(p / TARGET_MODEL))
    converted = sorted(p for p in (cache / GGUF_DIR).glob("*") if p.is_dir() and holds_target(p)
                       and gguf_source(p) is not None)
    return pairs + converted


def locate(path: str | Path) -> Located:
    """The target at `path`: the folder itself, a pair folder's target, or the one target of a cache
    directory (the default deployment's when it holds several). Raises FileNotFoundError or ValueError
    with one line naming what was found and what to pass instead."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    for target in (path, path / TARGET_MODEL):
        if holds_target(target):
            return Located(target, _drafter_for(target))
    found = cache_targets(path)
    if len(found) == 1:
        return Located(found[0], _drafter_for(found[0]))
    names = [str(t.relative_to(path)) for t in found]
    default = [t for t in found if is_default_target(t)]
    if len(default) == 1:
        others = ", ".join(n for t, n in zip(found, names) if t != default[0])
        return Located(default[0], _drafter_for(default[0]),
                       note=f"the default deployment's target; {path} also holds {others} (name one to use it)")
    if found:
        raise ValueError(f"{path} holds {len(found)} targets ({', '.join(names)}); name one of them, e.g. "
                         f"{path / names[0]}")
    raise FileNotFoundError(
        f"no target in {path}: expected a Hugging Face directory (config.json + *.safetensors), a model "
        f"folder ({MODEL_RECORD}), a pair folder with {TARGET_MODEL}/, or a cache directory holding a "
        f"{PAIR_PREFIX}* pair or a {GGUF_DIR}/ conversion (experiments/run.py makes one)")


def find_target(path: str | Path) -> Path:
    """The folder holding the target's weights that `path` names (see `locate`)."""
    return locate(path).target
