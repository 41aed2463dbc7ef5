"""Hugging Face checkpoint loading for hybrid targets (Qwen3.5): safetensors directory -> params.

Design choices:
- The dense loader's two phases and guarantees (`checkpoint.py`, whose file, header and finiteness
  helpers this reuses): every header is read and checked — key sets, shapes, dtypes — before any
  tensor; a missing, unexpected or misshapen tensor fails with one `CheckpointError` naming it, and
  a tensor with a NaN or Inf once in the requested dtype is named too.
- Both layouts: `Qwen3_5ForCausalLM` keeps the text model under `model.` (`model.layers.{i}...`);
  `Qwen3_5ForConditionalGeneration` under `model.language_model.`, with its fields in
  `text_config`. `lm_head.weight` sits at the top level in both.
- Ignored, as transformers ignores them for the text model: the vision tower (`model.visual.*`) of
  the multimodal layout, since a text target never runs it, and the multi-token-prediction head
  (`mtp.*`) some checkpoints carry. Every other unexpected key is an error.
- Expected keys and shapes come from `hybrid.param_shapes(cfg)`, never from the file. Linear
  weights are transposed (`[out, in]` -> `[in, out]`); the depthwise `conv1d.weight` [C, 1, W]
  becomes `[W, C]`; vectors (norms, `A_log`, `dt_bias`, biases) are kept.
- A tied checkpoint that stores `lm_head.weight` anyway is accepted only when it equals the
  embedding bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specpilot.models import hybrid
from specpilot.models.checkpoint import (CONFIG_FILE, IGNORED_SUFFIXES, CheckpointError,
                                         _read_headers, _read_tensors, _shard_files, assemble_params,
                                         key_problems)
from specpilot.models.config import ConfigError
from specpilot.models.hybrid_config import HybridConfig

IGNORED_PREFIXES = ("model.visual.", "mtp.")
_PREFIX = {"Qwen3_5ForCausalLM": "model.", "Qwen3_5ForConditionalGeneration": "model.language_model."}

# our per-layer name -> HF name under `{prefix}layers.{i}.`
_LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
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
        out["lm_head.weight"] = (("lm_head",), shapes["lm_head"], "transpose")
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


def read_config(root: Path, tap_layers=()) -> HybridConfig:
    path = root / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        return HybridConfig.from_hf_dict(hf, tap_layers=tap_layers)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def _plan(root: Path, cfg: HybridConfig):
    found = _read_headers(root, _shard_files(root))
    expected = hf_key_map(cfg)
    embed_key = f"{_PREFIX[cfg.architecture]}embed_tokens.weight"
    extra_tied = cfg.tie_word_embeddings and "lm_head.weight" in found
    present = {k for k in found if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(IGNORED_PREFIXES)}
    present.discard("lm_head.weight") if extra_tied else None
    problems = key_problems(found, expected, present, _hf_shape)
    if extra_tied and found["lm_head.weight"][1] != (cfg.vocab_size, cfg.hidden_size):
        problems.append(f"shape mismatch for lm_head.weight (tied): expected "
                        f"{(cfg.vocab_size, cfg.hidden_size)}, got {found['lm_head.weight'][1]}")
    if problems:
        raise CheckpointError(f"checkpoint {root} does not match its config ({cfg.architecture}, "
                              f"{cfg.num_layers} layers): " + "; ".join(problems))
    return expected, found, extra_tied, embed_key


def load_hf(path: str | Path, dtype=jnp.bfloat16, tap_layers=(), mesh=None) -> tuple[dict, HybridConfig]:
    """Load a HF Qwen3.5 directory (either layout) into (params, cfg). dtype=None keeps the stored
    dtype. Vision-tower and MTP tensors are skipped (see the module docstring). With a `mesh`, tensors
    load straight into their shardings (`checkpoint.assemble_params`)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    cfg = read_config(root, tap_layers)
    expected, found, extra_tied, embed_key = _plan(root, cfg)
    if extra_tied:
        pair = dict(_read_tensors(found, ["lm_head.weight", embed_key]))
        lm, emb = pair["lm_head.weight"], pair[embed_key]
        if lm.dtype != emb.dtype or not np.array_equal(lm.view(np.uint8), emb.view(np.uint8)):
            raise CheckpointError(f"config ties word embeddings but lm_head.weight differs from {embed_key}")
    return assemble_params(found, expected, cfg.num_layers, dtype, _to_ours, mesh), cfg
