"""The DFlash drafter checkpoint format: config.json (`DrafterConfig.to_hf_dict`) and model.safetensors with
DFlash's key names and torch [out, in] layout; `save_drafter`, `load_drafter` (every key and shape checked
before a tensor is read, a NaN or Inf named) and the drafters shipped with the package.
Design notes: docs/design/models.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from specpilot import atomic_io
from specpilot.models.drafter_config import DrafterConfig, param_shapes
from specpilot.models.hf_files import non_finite

Params = dict
PACKAGED = Path(__file__).resolve().parent.parent / "assets"  # drafters shipped with the package


class DrafterCheckpointError(ValueError):
    """A drafter checkpoint that cannot be loaded as the DFlash block drafter."""


_LAYER_KEYS = {  # our name -> (DFlash name, stored transposed as torch [out, in])
    "attn_norm": ("input_layernorm.weight", False), "mlp_norm": ("post_attention_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True), "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True), "o": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "q_bias": ("self_attn.q_proj.bias", False), "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False), "o_bias": ("self_attn.o_proj.bias", False),
    "gate": ("mlp.gate_proj.weight", True), "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
}
_TOP_KEYS = {"fc": ("fc.weight", True), "hidden_norm": ("hidden_norm.weight", False),
             "norm": ("norm.weight", False)}


def _flat_names(cfg: DrafterConfig) -> dict[str, tuple[tuple, bool, tuple[int, ...]]]:
    """DFlash key -> (path into our params, transposed, our shape)."""
    shapes = param_shapes(cfg)
    out = {hf: ((name,), tr, shapes[name]) for name, (hf, tr) in _TOP_KEYS.items()}
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            hf, tr = _LAYER_KEYS[name]
            out[f"layers.{i}.{hf}"] = (("layers", i, name), tr, shape)
    return out


def packaged_drafters() -> tuple[str, ...]:
    """Names of the drafter checkpoints shipped in the package (`PACKAGED/<name>/`)."""
    if not PACKAGED.is_dir():
        return ()
    return tuple(sorted(p.name for p in PACKAGED.iterdir() if (p / "config.json").is_file()
                        and (p / "model.safetensors").is_file()))


def save_drafter(path: str | Path, params: Params, cfg: DrafterConfig) -> None:
    """Write config.json + model.safetensors in the DFlash layout (dtype kept as in params), the folder
    built under a temporary name and replacing any older one whole."""
    tensors = {}
    for hf, (where, transposed, _) in _flat_names(cfg).items():
        x = params
        for k in where:
            x = x[k]
        tensors[hf] = jnp.asarray(x.T if transposed else x)
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = jnp.dtype(params["fc"].dtype).name
    with atomic_io.temporary_directory(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # the marker, last
        atomic_io.readable_by_all(tmp)


def load_drafter(path: str | Path, dtype=None) -> tuple[Params, DrafterConfig]:
    """Read a DFlash drafter directory -> (params, config). Errors name the file and the tensor."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DrafterCheckpointError(f"no config.json in drafter checkpoint {path}")
    try:
        cfg = DrafterConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as e:
        raise DrafterCheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterCheckpointError(f"no *.safetensors file in drafter checkpoint {path}")
    expected = _flat_names(cfg)
    found: dict[str, tuple[Path, Any]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as handle:
                for k in handle.keys():
                    found[k] = (f, handle.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise DrafterCheckpointError(f"{f} is not a readable safetensors file: {e}") from e
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise DrafterCheckpointError(
            f"drafter checkpoint {path} does not match its config.json: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}")
    for hf, (where, transposed, shape) in expected.items():
        f, stored = found[hf]
        want = tuple(reversed(shape)) if transposed else tuple(shape)
        if tuple(stored) != want:
            raise DrafterCheckpointError(f"{f.name}: tensor {hf} has shape {tuple(stored)}, "
                                         f"config.json implies {want}")
    flat = {}
    for f in files:  # shapes are all checked before any tensor is read
        with safe_open(str(f), framework="flax") as handle:
            for hf in handle.keys():
                where, transposed, _ = expected[hf]
                raw = handle.get_tensor(hf)
                raw = raw.T if transposed else raw
                x = raw.astype(dtype) if dtype is not None else raw
                problem = non_finite(x, raw if x.dtype != raw.dtype else None)
                if problem:
                    raise DrafterCheckpointError(f"{f.name}: tensor {hf} holds {problem}; a drafter "
                                                 f"with it would draft from NaN logits")
                flat[where] = x
    params: Params = {name: flat[(name,)] for name in _TOP_KEYS}
    params["layers"] = tuple({name: flat[("layers", i, name)] for name in layer}
                             for i, layer in enumerate(param_shapes(cfg)["layers"]))
    return params, cfg
