"""Model configuration for dense decoder targets (Qwen3, Llama), and what every target config shares:
`ModelConfig` is a frozen dataclass read from and written back to a Hugging Face `config.json`;
`DecoderConfigBase` holds the attention sizes, tap and JSON handling and the checks that the dense and
hybrid (`hybrid_config.HybridConfig`) configs have in common. Design notes: docs/design/models.md.
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


# The Hugging Face keys every decoder config needs (a hybrid's under `text_config` in its multimodal layout).
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class DecoderConfigBase:
    """What the dense and hybrid target configs share, over fields both define with the same names
    (`num_heads`, `num_kv_heads`, `head_dim`, `tap_layers`, ...): derived sizes, taps, config.json
    loading and the checks of those fields. Holds no fields itself, so each config's dataclass fields,
    equality and hash are its own."""

    @property
    def q_size(self) -> int:
        """Query channels of an attention layer: query heads x head dim (a hybrid's gated attention
        projects twice that, the query and its output gate)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Key (and value) channels of an attention layer: KV heads x head dim."""
        return self.num_kv_heads * self.head_dim

    def with_taps(self, tap_layers):
        """This config tapping each listed layer once, in layer order, whatever the listed order or
        repeats: a drafter's `target_layer_ids` in any form can be passed as they are."""
        return dataclasses.replace(self, tap_layers=tuple(sorted({int(t) for t in tap_layers})))

    @classmethod
    def from_json(cls, path: str | Path, tap_layers=()):
        return cls.from_hf_dict(read_config_json(path), tap_layers)

    # ---- checks, called by each config's __post_init__ in its own order ----

    def _check_positive(self, names) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"{type(self).__name__}.{name} must be a positive integer, got {value!r}")

    def _check_heads(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def _check_architecture(self, supported, kind: str = "") -> None:
        if self.architecture not in supported:
            raise ConfigError(f"unsupported {kind}architecture {self.architecture!r}; "
                              f"supported: {', '.join(supported)}")

    def _check_taps_and_rope(self) -> None:
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

    # ---- config.json ----

    def _hf_sizes(self) -> dict[str, Any]:
        """The attention and model sizes under their Hugging Face keys."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim}

    def _hf_token_ids(self) -> dict[str, int]:
        return {name: value for name, value in (("bos_token_id", self.bos_token_id),
                                                ("eos_token_id", self.eos_token_id)) if value is not None}


def hf_architecture(hf: dict[str, Any], by_model_type: dict[str, str], supported, kind: str = "") -> str:
    """config.json's architecture (its first `architectures` entry, else the one its `model_type`
    names), refused unless `supported`."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else by_model_type.get(hf.get("model_type", ""))
    if arch not in supported:
        raise ConfigError(f"unsupported {kind}architecture {arch!r} (model_type={hf.get('model_type')!r}); "
                          f"supported: {', '.join(supported)}")
    return arch


def hf_sizes(hf: dict[str, Any], which: str = "") -> dict[str, int]:
    """The seven size fields both configs take, from a config.json dict (`which` names the part of the
    file they sit in, for the error): num_key_value_heads defaults to the query heads and head_dim to
    hidden_size / heads, as in transformers."""
    missing = [k for k in REQUIRED_HF_KEYS if k not in hf]
    if missing:
        raise ConfigError(f"config.json lacks required {which}keys: {', '.join(missing)}")
    num_heads = hf["num_attention_heads"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads)


def first_token_id(token_id):
    """An `eos_token_id` as one id: a list gives its first entry (None when empty)."""
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id


@dataclasses.dataclass(frozen=True)
class ModelConfig(DecoderConfigBase):
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
    # What computes each residual add with the RMSNorm that reads it: a plan's kernels.residual_norm
    # (`pallas_kernels.dispatch.OpChoice`); the fused kernel runs only where it names "triton" first, else
    # (None too) XLA's add and norm. Static; not a checkpoint field.
    residual_norm: Any = None

    def __post_init__(self):
        self._check_positive(("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                              "num_kv_heads", "head_dim", "max_position_embeddings"))
        self._check_heads()
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self._check_architecture(SUPPORTED_ARCHITECTURES)
        self._check_taps_and_rope()

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

    # ----------------------------------------------------------------------------------------------
    # Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], tap_layers=()) -> "ModelConfig":
        arch = hf_architecture(hf, {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"},
                               SUPPORTED_ARCHITECTURES)
        sizes = hf_sizes(hf)
        if hf.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window=true) is not supported")
        rope_scaling = _parse_rope_scaling(hf.get("rope_scaling") or hf.get("rope_parameters"))
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")
        return cls(
            **sizes,
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            architecture=arch,
            tap_layers=tuple(tap_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=first_token_id(hf.get("eos_token_id")),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3" if self.architecture == "Qwen3ForCausalLM" else "llama",
            **self._hf_sizes(),
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
        hf.update(self._hf_token_ids())
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
