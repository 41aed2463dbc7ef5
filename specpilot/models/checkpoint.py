"""Hugging Face checkpoints: `load_hf` / `load_target` for every supported architecture (Qwen3.5
folders go to `hybrid_checkpoint`), and the dense decoder's (Qwen3, Llama) key map, loading and
`save_hf`. The file reading and checks both loaders share are `hf_files`'. Design notes:
docs/design/models.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from specpilot import atomic_io
from specpilot.models import dense, hybrid, hybrid_checkpoint
from specpilot.models.config import ModelConfig
# CONFIG_FILE, INDEX_FILE, SINGLE_FILE, CheckpointError, non_finite and HYBRID_ARCHITECTURES are also
# this module's API: callers name them through `checkpoint`.
from specpilot.models.hf_files import (ATTENTION_MLP_KEYS, CONFIG_FILE, INDEX_FILE,  # noqa: F401
                                       LM_HEAD_KEY, SINGLE_FILE, CheckpointError, assemble_params,
                                       check_tied_copy, declared_architecture, non_finite, plan,
                                       read_config)
from specpilot.models.hybrid_config import ARCHITECTURES as HYBRID_ARCHITECTURES

# Our top-level param name -> HF name.
TOP_KEYS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
             "lm_head": LM_HEAD_KEY}


def hf_key_map(cfg: ModelConfig) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF key -> (path into our params, our shape, transpose?) for every param of `cfg`."""
    shapes = dense.param_shapes(cfg)
    out: dict[str, tuple[tuple, tuple[int, ...], bool]] = {}
    for name, hf in TOP_KEYS.items():
        if name in shapes:
            out[hf] = ((name,), tuple(shapes[name]), name != "embed")
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            if name not in ATTENTION_MLP_KEYS:
                raise NotImplementedError(f"no Hugging Face name for layer param {name!r}")
            out[f"model.layers.{i}.{ATTENTION_MLP_KEYS[name]}"] = (("layers", i, name), tuple(shape),
                                                                  len(shape) == 2)
    return out


# --------------------------------------------------------------------------------------------------
# Loading


def load_hf(path: str | Path, dtype=jnp.bfloat16, tap_layers=(), mesh=None):
    """Load a HF directory into (params, cfg). dtype=None keeps the stored dtype. With a `mesh`, every
    tensor loads straight into its tensor-parallel sharding (`assemble_params`).

    Qwen3/Llama give a `ModelConfig`; Qwen3.5 (`HYBRID_ARCHITECTURES`) is loaded by
    `hybrid_checkpoint.load_hf` and gives a `HybridConfig`. `load_target` picks the target too."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint path {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    if declared_architecture(root) in HYBRID_ARCHITECTURES:
        return hybrid_checkpoint.load_hf(root, dtype, tap_layers, mesh)
    cfg = read_config(root, ModelConfig, tap_layers)
    expected = hf_key_map(cfg)
    found, extra_tied = plan(root, cfg, expected)
    if extra_tied:
        check_tied_copy(found, TOP_KEYS["embed"])
    return assemble_params(found, expected, cfg.num_layers, dtype,
                           lambda host, transpose: host.T if transpose else host, mesh), cfg


def load_target(path: str | Path, dtype=jnp.bfloat16, tap_layers=(), mesh=None):
    """(target, params) for any supported HF directory: `dense.target` or `hybrid.target` by the
    architecture config.json names, at the params' dtype; with a `mesh`, params and state sharded over it."""
    params, cfg = load_hf(path, dtype, tap_layers, mesh)
    if isinstance(cfg, ModelConfig):
        return dense.target(cfg, params["embed"].dtype, mesh), params
    return hybrid.target(cfg, params["embed"].dtype, mesh=mesh), params


# --------------------------------------------------------------------------------------------------
# Saving


def _to_hf_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Check params against `cfg` (same rules as loading) and lay them out as HF tensors."""
    tensors, problems = {}, []
    expected = hf_key_map(cfg)
    for key, (where, shape, transpose) in expected.items():
        try:
            node = params
            for step in where:
                node = node[step]
        except (KeyError, IndexError):
            problems.append(f"params lack {'/'.join(map(str, where))}")
            continue
        arr = np.asarray(node)
        if tuple(arr.shape) != shape:
            problems.append(f"{'/'.join(map(str, where))}: expected shape {shape}, got {arr.shape}")
            continue
        tensors[key] = np.ascontiguousarray(arr.T if transpose else arr)
    n_layers = len(params.get("layers", ()))
    if n_layers != cfg.num_layers:
        problems.append(f"params have {n_layers} layers, config says {cfg.num_layers}")
    if problems:
        raise CheckpointError("params do not match the config: " + "; ".join(problems))
    return tensors


def save_hf(params: dense.Params, cfg: ModelConfig, path: str | Path,
            max_shard_bytes: int | None = None) -> Path:
    """Write config.json + safetensors (sharded with an index when max_shard_bytes is set)."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    tensors = _to_hf_tensors(params, cfg)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [root / INDEX_FILE, root / SINGLE_FILE, *root.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = str(params["embed"].dtype)
    (root / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    meta = {"format": "pt"}  # transformers refuses safetensors files without a format tag
    if max_shard_bytes is None:
        save_file(tensors, str(root / SINGLE_FILE), metadata=meta)
        atomic_io.readable_by_all(root)
        return root
    # Greedy fill in key order; a tensor larger than the limit gets a shard of its own.
    groups: list[list[str]] = [[]]
    size = 0
    for key, arr in tensors.items():
        if groups[-1] and size + arr.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += arr.nbytes
    weight_map = {}
    for n, keys in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(root / name), metadata=meta)
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    atomic_io.readable_by_all(root)
    return root
