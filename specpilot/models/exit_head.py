"""A trained exit head: a two-level first level reading the target's final-normed hidden state after its
first `exit_layer` layers. A low-rank residual adapter (RMSNorm, down, SiLU, up; `up` starts at zero) and a
per-token bias, then the target's own head rows for a subset of token ids (`ids`, e.g. the drafter's
reduced vocabulary). A fresh head is the untrained early exit restricted to `ids`.

Checkpoint: a folder with config.json (`ExitHeadConfig`) and model.safetensors (norm, down, up, bias,
ids), written whole or not at all. Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specpilot import atomic_io
from specpilot.models import draft_vocab
from specpilot.models.drafter_checkpoint import PACKAGED
from specpilot.models.hf_files import non_finite
from specpilot.models.layers import rms_norm

KIND = "specpilot-exit-head"  # config.json's "kind": what tells a head's folder from a drafter's
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
PACKAGED_HEADS = PACKAGED / "exit_heads"  # heads shipped with the package, by folder name
# A node whose token the head does not score: far below any real log-probability, finite (path sums)
OUTSIDE_LOGPROB = -1e4


class ExitHeadError(ValueError):
    """An exit head that cannot be loaded, or does not fit the target it is asked to score for."""


@dataclasses.dataclass(frozen=True)
class ExitHeadConfig:
    exit_layer: int  # target layers whose output it reads
    hidden_size: int  # the target's
    rank: int  # the adapter's inner width
    num_ids: int  # token ids it scores
    vocab_size: int  # the target's
    num_layers: int  # the target's

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        h, r = self.hidden_size, self.rank
        return {"norm": (h,), "down": (h, r), "up": (r, h), "bias": (self.num_ids,)}

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for s in self.param_shapes().values())


def init(key: jax.Array, cfg: ExitHeadConfig, dtype=jnp.float32) -> dict:
    """Trainable params: `up` and `bias` zero, so the head starts as the untrained exit."""
    return {"norm": jnp.ones((cfg.hidden_size,), dtype),
            "down": (jax.random.normal(key, (cfg.hidden_size, cfg.rank)) / np.sqrt(cfg.hidden_size)).astype(dtype),
            "up": jnp.zeros((cfg.rank, cfg.hidden_size), dtype),
            "bias": jnp.zeros((cfg.num_ids,), dtype)}


def adapted(params: dict, hidden: jax.Array, eps: float) -> jax.Array:
    """Final-normed hidden [..., H] -> the adapted hidden [..., H] (float32)."""
    x = hidden.astype(jnp.float32)
    inner = jax.nn.silu(rms_norm(x, params["norm"].astype(jnp.float32), eps) @ params["down"].astype(jnp.float32))
    return x + inner @ params["up"].astype(jnp.float32)


def logits(params: dict, rows: jax.Array, hidden: jax.Array, eps: float) -> jax.Array:
    """Final-normed hidden [..., H] -> float32 logits [..., K] over the head's ids (rows [K, H]: the
    target's head rows for them)."""
    a = adapted(params, hidden, eps)
    return jnp.einsum("...h,kh->...k", a.astype(rows.dtype), rows,
                      preferred_element_type=jnp.float32) + params["bias"].astype(jnp.float32)


def for_target(params: dict, ids, target_params: dict, target_cfg) -> dict:
    """The head as a first level runs it: its params plus the target's head rows for its ids (`rows`,
    gathered once here) and the sorted ids (`ids`) that a node's token is looked up in."""
    ids = np.asarray(ids, np.int32)
    return {**params, "rows": draft_vocab.head_rows(target_params, target_cfg, ids), "ids": jnp.asarray(ids)}


def token_logprob(head: dict, hidden: jax.Array, parents: jax.Array, tokens: jax.Array, eps: float) -> jax.Array:
    """[B, N]: log p(node's token | its parent) under the head ([B, N, H] hidden of a tree's nodes;
    `OUTSIDE_LOGPROB` for a token outside its ids; the root's entry is meaningless)."""
    logp = jax.nn.log_softmax(logits(head, head["rows"], hidden, eps), axis=-1)  # [B, N, K]
    ids = head["ids"]
    pos = jnp.clip(jnp.searchsorted(ids, tokens), 0, ids.shape[0] - 1)  # ids are sorted
    inside = ids[pos] == tokens
    rows = jnp.arange(tokens.shape[0])[:, None]
    return jnp.where(inside, logp[rows, jnp.maximum(parents, 0), pos], OUTSIDE_LOGPROB)


def save(path: str | Path, params: dict, cfg: ExitHeadConfig, ids, meta: dict | None = None) -> None:
    """Write config.json + model.safetensors (float32), the folder built under a temporary name and
    replacing any older one whole."""
    tensors = {k: np.asarray(params[k], np.float32) for k in cfg.param_shapes()}
    tensors["ids"] = np.asarray(ids, np.int32)
    config = {"kind": KIND, **dataclasses.asdict(cfg), **({"meta": meta} if meta else {})}
    with atomic_io.temporary_directory(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))  # the marker, last
        atomic_io.readable_by_all(tmp)


def resolve(path: str | Path) -> Path:
    """A head's folder: `path` itself, or the packaged head of that name."""
    folder = Path(str(path)).expanduser()
    if folder.is_dir():
        return folder
    if "/" not in str(path) and (PACKAGED_HEADS / str(path)).is_dir():
        return PACKAGED_HEADS / str(path)
    shipped = sorted(p.name for p in PACKAGED_HEADS.iterdir()) if PACKAGED_HEADS.is_dir() else []
    raise ExitHeadError(f"no exit head at {folder} (a folder with {CONFIG_FILE} and {WEIGHTS_FILE}, or a "
                        f"packaged head: {', '.join(shipped) or 'none'}); train one with "
                        f"`python experiments/train.py --config-name train_exit_head_smollm2`")


def _read_config(folder: Path) -> ExitHeadConfig:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ExitHeadError(f"no {CONFIG_FILE} in exit head folder {folder}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExitHeadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("kind") != KIND:
        raise ExitHeadError(f"{path} is not an exit head's config (kind {KIND!r})")
    names = [f.name for f in dataclasses.fields(ExitHeadConfig)]
    bad = [n for n in names if isinstance(raw.get(n), bool) or not isinstance(raw.get(n), int) or raw[n] < 1]
    if bad:
        raise ExitHeadError(f"{path}: {bad[0]} must be a positive integer, got {raw.get(bad[0])!r}")
    return ExitHeadConfig(**{n: raw[n] for n in names})


def check_fits(cfg: ExitHeadConfig, target_cfg, exit_layer: int | None, where: str = "exit head") -> None:
    """A clear error when a head of `cfg` cannot score for `target_cfg` at `exit_layer` (None: any)."""
    for name, want in (("hidden_size", target_cfg.hidden_size), ("vocab_size", target_cfg.vocab_size),
                       ("num_layers", target_cfg.num_layers)):
        if getattr(cfg, name) != want:
            raise ExitHeadError(f"{where} was trained for a target of {name} {getattr(cfg, name)}; this "
                                f"target's is {want}")
    if cfg.exit_layer >= cfg.num_layers:
        raise ExitHeadError(f"{where}: exit_layer {cfg.exit_layer} must be below the target's "
                            f"{cfg.num_layers} layers")
    if exit_layer is not None and exit_layer != cfg.exit_layer:
        raise ExitHeadError(f"{where} reads layer {cfg.exit_layer}'s output; the plan's exit_layer is "
                            f"{exit_layer} (set two_level.exit_layer: {cfg.exit_layer})")


def load(path: str | Path, target_cfg=None, exit_layer: int | None = None) -> tuple[dict, np.ndarray, ExitHeadConfig]:
    """Read a head's folder -> (float32 params, ids [K] int32 sorted, config), every shape checked
    before a tensor is read and every value finite; with `target_cfg`, checked to fit that target
    (and `exit_layer`, if given)."""
    folder = resolve(path)
    cfg = _read_config(folder)
    if target_cfg is not None:
        check_fits(cfg, target_cfg, exit_layer, f"exit head {folder}")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise ExitHeadError(f"no {WEIGHTS_FILE} in exit head folder {folder}")
    want = {**cfg.param_shapes(), "ids": (cfg.num_ids,)}
    try:
        with safe_open(str(weights), framework="numpy") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            missing, extra = sorted(set(want) - set(found)), sorted(set(found) - set(want))
            if missing or extra:
                raise ExitHeadError(f"{weights}: tensors missing {missing}, unexpected {extra}")
            for k, shape in want.items():
                if found[k] != shape:
                    raise ExitHeadError(f"{weights}: tensor {k} has shape {found[k]}, {CONFIG_FILE} implies {shape}")
            raw = {k: f.get_tensor(k) for k in want}
    except (SafetensorError, OSError) as e:
        raise ExitHeadError(f"{weights} is not a readable safetensors file: {e}") from None
    params = {}
    for k in cfg.param_shapes():
        problem = non_finite(raw[k])
        if problem:
            raise ExitHeadError(f"{weights}: tensor {k} holds {problem}; the head would rank nodes by NaN")
        params[k] = jnp.asarray(raw[k], jnp.float32)
    try:
        ids = draft_vocab.check_ids(raw["ids"], cfg.vocab_size, f"{weights}: ids")
    except draft_vocab.DraftVocabError as e:
        raise ExitHeadError(str(e)) from None
    if np.any(np.diff(ids) <= 0):
        raise ExitHeadError(f"{weights}: ids must be sorted ascending (a node's token is looked up by bisection)")
    return params, ids, cfg
