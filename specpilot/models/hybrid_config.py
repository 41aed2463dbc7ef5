"""Configuration of hybrid recurrent targets (Qwen3.5 text model: Gated DeltaNet layers and gated
attention layers): `HybridConfig`, a frozen dataclass with `ModelConfig`'s names for what both have, so
code that reads only those takes either config. Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specpilot.models.config import (ConfigError, DecoderConfigBase, first_token_id, hf_architecture,
                                     hf_sizes)

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class HybridConfig(DecoderConfigBase):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # full-attention query heads
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    architecture: str = "Qwen3_5ForCausalLM"
    # Layers whose outputs are returned as taps (as ModelConfig.tap_layers: layer order, each once).
    tap_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # What multiplies the linear weights, as ModelConfig.matmul (a plan's kernels.matmul, or None:
    # each weight by its layout's implementation). Static; not a checkpoint field.
    matmul: Any = None
    # What computes the linear layers' gated delta rule token by token (decode, verification): a plan's
    # kernels.gated_delta_rule (`pallas_kernels.dispatch.OpChoice`), or None: the jnp reference. Static.
    gated_delta_rule: Any = None
    # What computes the linear layers' gated delta rule over a tree (verification, node from parent): a
    # plan's kernels.tree_gated_delta_rule, or None: the jnp reference. Static.
    tree_gated_delta_rule: Any = None
    # What computes the full-attention layers in a tree verification forward, as ModelConfig.tree_attention.
    tree_attention: Any = None
    # What computes the full-attention layers in every other forward, as ModelConfig.attention.
    attention: Any = None

    rope_scaling = None  # no rope scaling type is supported; read by drafter configs built from this

    def __post_init__(self):
        self._check_positive(("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                              "num_kv_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                              "max_position_embeddings"))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "tap_layers", tuple(int(t) for t in self.tap_layers))
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types lists {len(self.layer_types)} layers, num_layers is "
                              f"{self.num_layers}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"unsupported layer type(s) {bad}; supported: {', '.join(LAYER_TYPES)}")
        if "full_attention" not in self.layer_types:
            raise ConfigError("a hybrid target needs at least one full_attention layer (its K/V slots "
                              "bound the sequence length the decoding loops check against)")
        self._check_heads()
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                              f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim = int(head_dim {self.head_dim} * partial_rotary_factor "
                              f"{self.partial_rotary_factor}) = {self.rotary_dim} must be even and >= 2")
        self._check_architecture(ARCHITECTURES, "hybrid ")
        self._check_taps_and_rope()

    # ----------------------------------------------------------------------------------------------
    # Derived sizes

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        """Gated DeltaNet q (and k) channels: key heads x key head dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v together."""
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [rotary_dim // 2] (float64 numpy, static)."""
        d = self.rotary_dim
        return 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))

    # ----------------------------------------------------------------------------------------------
    # Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], tap_layers=()) -> "HybridConfig":
        arch = hf_architecture(hf, {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                                    "qwen3_5_text": "Qwen3_5ForCausalLM"}, ARCHITECTURES, "hybrid ")
        text = hf
        if arch == "Qwen3_5ForConditionalGeneration":
            text = hf.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("a Qwen3_5ForConditionalGeneration config.json needs a text_config "
                                  "object holding the language model's fields")
        sizes = hf_sizes(text, "text-model ")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"unsupported rope type {rope_type!r} for a hybrid target; supported: default")
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        n_layers = sizes["num_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                           for i in range(n_layers)]
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported; only silu")
        eos = first_token_id(text.get("eos_token_id", hf.get("eos_token_id")))
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            **sizes, layer_types=tuple(layer_types),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            partial_rotary_factor=float(partial), rope_theta=float(rope_theta),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(tie),
            attention_bias=bool(text.get("attention_bias", False)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            architecture=arch, tap_layers=tuple(tap_layers),
            bos_token_id=text.get("bos_token_id", hf.get("bos_token_id")), eos_token_id=eos)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `Qwen3_5ForCausalLM` config.json (the text model's layout)."""
        hf: dict[str, Any] = {
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            **self._hf_sizes(), "layer_types": list(self.layer_types),
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
        }
        hf.update(self._hf_token_ids())
        return hf
