"""Model configuration for dense decoder targets (Qwen3, Llama).

Design choices:
- `ModelConfig` is a frozen, hashable dataclass: it is passed to jitted functions as a static argument,
  so changing it recompiles and nothing inside it may be an array.
- It is built from a Hugging Face `config.json` (`from_hf_dict`) and written back (`to_hf_dict`), so a
  checkpoint round-trips without transformers.
- Every impossible value fails in `__post_init__` with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")


class ConfigError(ValueError):
    """A model configuration that cannot describe a working model."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling (`rope_type: llama3`). Other types raise at parse time."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 32768
    architecture: str = "Qwen3ForCausalLM"
    # Layers whose output hidden states are returned as `taps` (a drafter reads them). 0-based layer
    # index l means the output of decoder layer l (= HF `hidden_states[l + 1]` for l < L-1; HF's
    # last entry hidden_states[L] has the final norm applied, our tap L-1 does not). Each layer at
    # most once, in layer order: a drafter that lists layers otherwise (DFlash allows repeats) picks
    # its context from these (`DrafterConfig.target_tap_layers`).
    tap_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # What multiplies the linear weights: a `pallas_kernels.dispatch.OpChoice` (a plan's kernels.matmul,
    # set by the harness), or None: each weight by the implementation its layout belongs to (XLA's dot
    # for plain arrays). Static, so it is part of every jit cache key; not a checkpoint field.
    matmul: Any = None
    # What computes attention in a tree verification forward (`forward(..., parents=)`): a plan's
    # kernels.tree_attention (`pallas_kernels.dispatch.OpChoice`), or None: the attention over the full
    # mask (`layers.attention`). Static; not a checkpoint field.
    tree_attention: Any = None
    # What computes attention in every other forward (decode, chain verification, prefill chunks, the
    # serving engine's steps): a plan's kernels.attention (`pallas_kernels.dispatch.OpChoice`), or None:
    # the attention over the full mask. Static; not a checkpoint field.
    attention: Any = None

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.architecture!r}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for layer in self.tap_layers:
            if not 0 <= layer < self.num_layers:
                raise ConfigError(f"tap layer {layer} outside [0, {self.num_layers})")
        if list(self.tap_layers) != sorted(set(self.tap_layers)):
            # taps are concatenated in layer order, so the configured order must be that order
            raise ConfigError(f"tap_layers must be strictly increasing (each layer once, in layer "
                              f"order), got {self.tap_layers}; with_taps({self.tap_layers}) taps "
                              f"{tuple(sorted(set(self.tap_layers)))}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError("rope_theta and rms_norm_eps must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size + h
        if self.mlp_bias:
            per_layer += 2 * i + h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] (float64 numpy, static)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        s = self.rope_scaling
        if s is None:
            return inv
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by `factor`, short ones
        # are kept, and the band between is interpolated smoothly.
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    def with_taps(self, tap_layers) -> "ModelConfig":
        """This config tapping each listed layer once, in layer order, whatever the listed order or
        repeats: a drafter's `target_layer_ids` in any form can be passed as they are."""
        return dataclasses.replace(self, tap_layers=tuple(sorted({int(t) for t in tap_layers})))

    # ----------------------------------------------------------------------------------------------
    # Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], tap_layers=()) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}.get(
            hf.get("model_type", ""), None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {arch!r} (model_type={hf.get('model_type')!r}); "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks required keys: {', '.join(missing)}")
        if hf.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window=true) is not supported")
        num_heads = hf["num_attention_heads"]
        rope_scaling = _parse_rope_scaling(hf.get("rope_scaling") or hf.get("rope_parameters"))
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        is_qwen3 = arch == "Qwen3ForCausalLM"
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=is_qwen3,
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            architecture=arch,
            tap_layers=tuple(tap_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_json(cls, path: str | Path, tap_layers=()) -> "ModelConfig":
        return cls.from_hf_dict(read_config_json(path), tap_layers)

    def to_hf_dict(self) -> dict[str, Any]:
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3" if self.architecture == "Qwen3ForCausalLM" else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        if self.architecture == "LlamaForCausalLM":
            hf["mlp_bias"] = self.mlp_bias
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            hf["eos_token_id"] = self.eos_token_id
        return hf


def _parse_rope_scaling(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r}; supported: llama3, default")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope_scaling lacks key {e}") from e


def default_tap_layers(num_layers: int, num_taps: int) -> tuple[int, ...]:
    """Distinct layers evenly spaced from 1 to L-3 (the DFlash choice; Qwen3-8B with 5 taps: 1, 9, 17,
    25, 33). A target too shallow for that range is spread over all its layers instead, where DFlash's
    own rule would repeat a layer (4 layers, 2 taps: DFlash 1, 1; here 0, 3); never more taps than
    layers. Drafters that do list a layer twice still pair (see `ModelConfig.with_taps`)."""
    num_taps = min(num_taps, num_layers)
    if num_taps <= 0:
        return ()
    lo, hi = (1, num_layers - 3) if num_layers - 3 >= num_taps else (0, num_layers - 1)
    if num_taps == 1:
        return (lo,)
    return tuple(int(round(lo + i * (hi - lo) / (num_taps - 1))) for i in range(num_taps))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict, with clear errors for a missing file or invalid JSON."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
