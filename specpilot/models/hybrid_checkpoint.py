"""Hugging Face checkpoint loading for hybrid targets (Qwen3.5, either layout): the key map (text model
under `model.` or `model.language_model.`; vision tower and MTP head skipped) and the conv layout, over
`hf_files`' reading and checks. `checkpoint.load_hf` hands Qwen3.5 folders here. Design notes:
docs/design/models.md.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specpilot.models import hybrid
from specpilot.models.hf_files import (ATTENTION_MLP_KEYS, LM_HEAD_KEY, CheckpointError, assemble_params,
                                       check_tied_copy, plan, read_config)
from specpilot.models.hybrid_config import HybridConfig

IGNORED_PREFIXES = ("model.visual.", "mtp.")
_PREFIX = {"Qwen3_5ForCausalLM": "model.", "Qwen3_5ForConditionalGeneration": "model.language_model."}

# our per-layer name -> HF name under `{prefix}layers.{i}.`
_LAYER_KEYS = {
    **ATTENTION_MLP_KEYS,
    "qkv": "linear_attn.in_proj_qkv.weight", "z": "linear_attn.in_proj_z.weight",
    "b": "linear_attn.in_proj_b.weight", "a": "linear_attn.in_proj_a.weight",
    "conv": "linear_attn.conv1d.weight", "A_log": "linear_attn.A_log", "dt_bias": "linear_attn.dt_bias",
    "out_norm": "linear_attn.norm.weight", "out": "linear_attn.out_proj.weight",
}


def hf_key_map(cfg: HybridConfig) -> dict[str, tuple[tuple, tuple[int, ...], str]]:
    """HF key -> (path into our params, our shape, layout: "keep" | "transpose" | "conv")."""
    prefix = _PREFIX[cfg.architecture]
    shapes = hybrid.param_shapes(cfg)
    out = {f"{prefix}embed_tokens.weight": (("embed",), shapes["embed"], "keep"),
           f"{prefix}norm.weight": (("final_norm",), shapes["final_norm"], "keep")}
    if "lm_head" in shapes:
        out[LM_HEAD_KEY] = (("lm_head",), shapes["lm_head"], "transpose")
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            layout = "conv" if name == "conv" else "transpose" if len(shape) == 2 else "keep"
            out[f"{prefix}layers.{i}.{_LAYER_KEYS[name]}"] = (("layers", i, name), tuple(shape), layout)
    return out


def _hf_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    if layout == "conv":  # ours [W, C], HF [C, 1, W]
        return (shape[1], 1, shape[0])
    return tuple(reversed(shape)) if layout == "transpose" else shape


def _to_ours(host: np.ndarray, layout: str) -> np.ndarray:
    if layout == "conv":
        return host[:, 0, :].T
    return host.T if layout == "transpose" else host


def load_hf(path: str | Path, dtype=jnp.bfloat16, tap_layers=(), mesh=None) -> tuple[dict, HybridConfig]:
    """Load a HF Qwen3.5 directory (either layout) into (params, cfg). dtype=None keeps the stored
    dtype. Vision-tower and MTP tensors are skipped (see the module docstring). With a `mesh`, tensors
    load straight into their shardings (`hf_files.assemble_params`)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    cfg = read_config(root, HybridConfig, tap_layers)
    expected = hf_key_map(cfg)
    found, extra_tied = plan(root, cfg, expected, _hf_shape, IGNORED_PREFIXES)
    if extra_tied:
        check_tied_copy(found, f"{_PREFIX[cfg.architecture]}embed_tokens.weight")
    return assemble_params(found, expected, cfg.num_layers, dtype, _to_ours, mesh), cfg
