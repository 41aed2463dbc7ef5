"""Checkpoints with orbax: resumable training state (any pytree plus a JSON record), finished model
folders (config.json, orbax params, a dtype record), loading either kind of finished target, and
exporting one as a Hugging Face folder that `load_hf` and transformers read. Every folder is written
whole or not at all (`atomic_io`); docs/design/data-training.md.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specpilot import atomic_io
from specpilot.models import dense
from specpilot.models.checkpoint import (CONFIG_FILE, INDEX_FILE, SINGLE_FILE, CheckpointError, load_hf,
                                         non_finite, save_hf)
from specpilot.models.config import ModelConfig

MODEL_RECORD = "specpilot.json"  # marks a model folder written by `save_model`
TOKENIZER_FILE = "tokenizer.json"
# What an export copies beside the weights: the tokenizer (its chat template and special tokens are in
# tokenizer_config.json or chat_template.jinja) and the generation defaults.
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class Checkpointer:
    """Numbered training checkpoints under one folder, keeping the newest `max_to_keep`."""

    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_latest(self, abstract_state: Any, meta: dict) -> tuple[int, Any, dict] | None:
        """(step, state, saved meta) of the newest step that restores, or None when there is none.

        A step saved with other `meta` values (other data or seed) is an error: resuming it would continue
        a different experiment. A step whose state does not restore (a file damaged or cut short after
        orbax committed it) is removed with a warning and the next older one tried, so a run resumes from
        its last good step instead of failing on every start."""
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                saved = dict(self._manager.restore(step, args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore()))["meta"])
            except Exception as e:  # orbax wraps a damaged file in errors of many kinds
                self._discard(step, e)
                continue
            changed = {k: (saved.get(k), v) for k, v in meta.items() if saved.get(k) != v}
            if changed:
                raise ValueError(f"checkpoint in {self.directory} was made with different settings "
                                 f"(saved, now): {changed}; use a fresh out_dir")
            try:
                state, _ = self.restore(step, abstract_state)
            except Exception as e:  # a damaged array is a plain Exception
                self._discard(step, e)
                continue
            return step, state, saved
        return None

    def _discard(self, step: int, error: Exception) -> None:
        warnings.warn(f"training checkpoint step {step} in {self.directory} is unreadable "
                      f"({type(error).__name__}: {str(error).strip()[:300]}); removing it",
                      atomic_io.CacheRebuildWarning, stacklevel=3)
        self._manager.delete(step)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def abstract_of(tree: Any) -> Any:
    """ShapeDtypeStructs of a pytree of arrays (what `restore` needs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), tree)


def save_pytree(path: str | Path, tree: Any) -> Path:
    """Write one pytree of arrays to a fresh orbax folder (overwriting an older one; orbax writes it under
    a temporary name and renames it)."""
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree, force=True)
    return path


def load_pytree(path: str | Path, abstract: Any) -> Any:
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"no orbax checkpoint at {path}")
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract)


def save_model(directory: str | Path, params: dict, cfg: ModelConfig, extra: dict | None = None,
               tokenizer: Any = None) -> Path:
    """Finished dense-model weights: config.json + params/ (+ `tokenizer.save`'s tokenizer.json) +
    specpilot.json (dtype and `extra`), the record last, the folder replacing any older one whole."""
    directory = Path(directory)
    with atomic_io.temporary_directory(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        save_pytree(tmp / "params", params)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        dtype = str(jnp.asarray(params["embed"]).dtype)
        record = {"dtype": dtype, "tap_layers": list(cfg.tap_layers), **(extra or {})}
        (tmp / MODEL_RECORD).write_text(json.dumps(record, indent=2) + "\n")  # the marker, last
    return directory


def load_model(directory: str | Path, dtype=None) -> tuple[dict, ModelConfig]:
    """Inverse of `save_model`; `dtype` casts the weights after loading (e.g. jnp.bfloat16)."""
    directory = Path(directory)
    record = json.loads((directory / MODEL_RECORD).read_text())
    cfg = ModelConfig.from_json(directory / "config.json", tap_layers=tuple(record.get("tap_layers", ())))
    stored = jnp.dtype(record["dtype"])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, stored), dense.param_shapes(cfg),
                            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    params = load_pytree(directory / "params", abstract)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        problem = non_finite(x)  # a diverged training run saves NaN weights
        if problem:
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            raise CheckpointError(f"{directory}: param {name} holds {problem}; a model with it would "
                                  f"give NaN logits")
    return params, cfg


def is_model_folder(path: str | Path) -> bool:
    """Whether `path` is a model folder written by `save_model` (orbax weights)."""
    return (Path(path) / MODEL_RECORD).is_file()


def load_target(path: str | Path, dtype=None, tap_layers=()) -> tuple[dict, ModelConfig]:
    """A dense target from a model folder (`save_model`) or a Hugging Face directory (`load_hf`).

    dtype None keeps the stored dtype; tap_layers as for `ModelConfig.with_taps`.
    """
    if is_model_folder(path):
        params, cfg = load_model(path, dtype=dtype)
        return params, cfg.with_taps(tap_layers) if tap_layers else cfg
    return load_hf(path, dtype=dtype, tap_layers=tuple(sorted(set(tap_layers))))


def export_hf(source: str | Path, out_dir: str | Path, dtype=None,
              max_shard_bytes: int | None = None) -> Path:
    """Write the target at `source` (a model folder or a HF directory) as a Hugging Face directory:
    config.json, model.safetensors (sharded with an index when max_shard_bytes is set), the source's
    tokenizer files (`TOKENIZER_FILES`: the chat template and special tokens among them) and its
    config's special token ids. dtype None keeps the stored dtype. The folder is built under a
    temporary name and replaces `out_dir` whole: an earlier export there, or an empty folder."""
    source, out_dir = Path(source), Path(out_dir)
    if out_dir.exists() and out_dir.resolve() == source.resolve():
        raise ValueError(f"export target {out_dir} is the source folder; choose another")
    if is_model_folder(out_dir):
        raise ValueError(f"{out_dir} holds a model folder ({MODEL_RECORD}); export to a new folder")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export target {out_dir} is a file; export to a new or empty folder")
    foreign = sorted(p.name for p in out_dir.iterdir() if not _exported(p.name)) if out_dir.is_dir() else []
    if foreign:
        raise ValueError(f"{out_dir} holds files an export does not write ({', '.join(foreign[:5])}); "
                         f"export to a new or empty folder")
    params, cfg = load_target(source, dtype=dtype)
    with atomic_io.temporary_directory(out_dir) as tmp:
        save_hf(params, cfg, tmp, max_shard_bytes=max_shard_bytes)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                (tmp / name).write_bytes((source / name).read_bytes())
        _keep_token_ids(source / "config.json", tmp / "config.json")
    return out_dir


def _exported(name: str) -> bool:
    """Whether `export_hf` writes a file of this name (so replacing it loses nothing of the user's)."""
    return (name in TOKENIZER_FILES or name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)
            or (name.startswith("model-") and name.endswith(".safetensors")))


def _keep_token_ids(source_config: Path, out_config: Path) -> None:
    """Copy the source config's special token ids as written (an id list stays a list): `ModelConfig`
    keeps only the first eos id and no pad id, and transformers reads them from config.json."""
    if not source_config.is_file():
        return
    src, out = json.loads(source_config.read_text()), json.loads(out_config.read_text())
    kept = {k: src[k] for k in TOKEN_ID_KEYS if k in src}
    if kept:
        out_config.write_text(json.dumps({**out, **kept}, indent=2, sort_keys=True) + "\n")
