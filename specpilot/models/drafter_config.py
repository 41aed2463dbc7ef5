"""The DFlash block drafter's configuration: `DrafterConfig` (its layers, block size, the target layers it
reads, the mask token), read from and written to DFlash's config.json, shaped for a target
(`for_target`), checked against one (`check_compatible`), and its params' shapes.
Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specpilot.models import dense
from specpilot.models.config import ConfigError, ModelConfig, RopeScaling, default_tap_layers

ARCHITECTURE = "DFlashDraftModel"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    num_layers: int
    block_size: int
    tap_layers: tuple[int, ...]  # target layers whose outputs form the context (DFlash target_layer_ids)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's; the drafter has no embedding or head of its own
    mask_token_id: int
    num_target_layers: int | None = None  # None: unknown (older configs); taps still checked on use
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    # what multiplies the draft layers' weights (a plan's kernels.matmul; None: by each weight's layout),
    # as ModelConfig.matmul; not a checkpoint field
    matmul: Any = None

    def __post_init__(self):
        for name in ("num_layers", "block_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"DrafterConfig.{name} must be a positive integer, got {value!r}")
        if not self.tap_layers:
            raise ConfigError("DrafterConfig.tap_layers is empty: the drafter needs target states")
        if self.num_target_layers is not None and self.num_target_layers <= 0:
            raise ConfigError(f"num_target_layers must be positive, got {self.num_target_layers!r}")
        limit = self.num_target_layers or float("inf")
        bad = [t for t in self.tap_layers if not 0 <= t < limit]
        if bad:
            raise ConfigError(f"tap layers {bad} outside the target's [0, {self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} outside the vocabulary "
                              f"[0, {self.vocab_size})")
        self.layer_config  # validates heads / head_dim / rope through ModelConfig

    @property
    def num_taps(self) -> int:
        """Listed tap ids, repeats counted: fc reads num_taps * H features."""
        return len(self.tap_layers)

    @property
    def target_tap_layers(self) -> tuple[int, ...]:
        """The layers the target must tap: each listed layer once, in layer order."""
        return tuple(sorted(set(self.tap_layers)))

    @property
    def layer_config(self) -> ModelConfig:
        """The draft layers as a Qwen3 layer stack: gives layer shapes and RoPE frequencies."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
            qk_norm=True, attention_bias=self.attention_bias,
            max_position_embeddings=self.max_position_embeddings)

    @classmethod
    def for_target(cls, target: ModelConfig, num_layers: int = 1, block_size: int = 16,
                   num_taps: int | None = None, tap_layers=None, mask_token_id: int | None = None,
                   **overrides) -> "DrafterConfig":
        """Drafter shaped like the target (DFlash's choice); taps default to DFlash's spacing."""
        if tap_layers is None:
            tap_layers = target.tap_layers or default_tap_layers(
                target.num_layers, num_taps or min(5, target.num_layers))
        fields = dict(
            num_layers=num_layers, block_size=block_size, tap_layers=tuple(int(t) for t in tap_layers),
            hidden_size=target.hidden_size, num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            intermediate_size=target.intermediate_size, vocab_size=target.vocab_size,
            # Real DFlash drafters use a token added to the tokenizer as <|MASK|>; tiny test targets
            # take the last id.
            mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            num_target_layers=target.num_layers, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings)
        fields.update(overrides)
        return cls(**fields)

    # ----------------------------------------------------------------------------------------------
    # DFlash config.json

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "DrafterConfig":
        archs = hf.get("architectures") or [ARCHITECTURE]
        if archs[0] != ARCHITECTURE:
            raise ConfigError(f"unsupported drafter architecture {archs[0]!r}; only {ARCHITECTURE} "
                              f"(DFlash v1) is supported")
        extra = hf.get("dflash_config") or {}

        def value(name, default=None):  # DFlash reads dflash_config first, then the top level
            return extra.get(name, hf.get(name, default))

        for name in ("target_layer_ids", "mask_token_id"):
            if value(name) is None:
                raise ConfigError(f"drafter config.json lacks dflash_config.{name}")
        for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                              ("final_logit_softcapping", None)):
            if value(name, neutral) not in (neutral, 0, 0.0):
                raise ConfigError(f"drafter config sets {name}={value(name)!r}, which this drafter "
                                  f"does not implement")
        if value("is_causal", False):
            raise ConfigError("drafter config sets is_causal=true; the block drafter is bidirectional")
        if any(t != "full_attention" for t in hf.get("layer_types") or ()):
            raise ConfigError("drafter layers with sliding-window attention are not supported")
        layer_cfg = ModelConfig.from_hf_dict(dict(hf, architectures=["Qwen3ForCausalLM"]))
        taps = tuple(int(t) for t in value("target_layer_ids"))
        return cls(
            num_layers=layer_cfg.num_layers, block_size=int(value("block_size", 16)), tap_layers=taps,
            hidden_size=layer_cfg.hidden_size, num_heads=layer_cfg.num_heads,
            num_kv_heads=layer_cfg.num_kv_heads, head_dim=layer_cfg.head_dim,
            intermediate_size=layer_cfg.intermediate_size, vocab_size=layer_cfg.vocab_size,
            mask_token_id=int(value("mask_token_id")),
            num_target_layers=(None if value("num_target_layers") is None
                               else int(value("num_target_layers"))),
            rms_norm_eps=layer_cfg.rms_norm_eps, rope_theta=layer_cfg.rope_theta,
            rope_scaling=layer_cfg.rope_scaling, attention_bias=layer_cfg.attention_bias,
            max_position_embeddings=layer_cfg.max_position_embeddings)

    def to_hf_dict(self) -> dict[str, Any]:
        hf = self.layer_config.to_hf_dict()
        hf.update({
            "architectures": [ARCHITECTURE],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "layer_types": ["full_attention"] * self.num_layers,
            "attention_dropout": 0.0,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.tap_layers)},
        })
        if self.num_target_layers is not None:
            hf["num_target_layers"] = self.num_target_layers
        return hf


def check_compatible(cfg: DrafterConfig, target: ModelConfig) -> None:
    """Raise a clear error when a drafter cannot read this target's states, embedding or head."""
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit the "
                          f"target (hidden {target.hidden_size}, vocab {target.vocab_size})")
    wrong_depth = cfg.num_target_layers not in (None, target.num_layers)
    if wrong_depth or max(cfg.tap_layers) >= target.num_layers:
        raise ConfigError(f"drafter was built for a {cfg.num_target_layers}-layer target tapping "
                          f"{cfg.tap_layers}; this target has {target.num_layers} layers")
    if tuple(target.tap_layers) != cfg.target_tap_layers:
        raise ConfigError(f"target taps {target.tap_layers}, the drafter reads layers "
                          f"{cfg.target_tap_layers} (target_layer_ids {cfg.tap_layers}); "
                          f"use target_cfg.with_taps({cfg.tap_layers})")


def param_shapes(cfg: DrafterConfig) -> dict:
    h = cfg.hidden_size
    layer = dense.layer_shapes(cfg.layer_config)
    return {"fc": (cfg.num_taps * h, h), "hidden_norm": (h,), "norm": (h,),
            "layers": tuple(dict(layer) for _ in range(cfg.num_layers))}
