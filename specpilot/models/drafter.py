"""DFlash-style parallel block drafter: one forward drafts a whole block from the target's tapped states.

Design choices (semantics follow the public DFlash reference):
- Context = the target's tapped hidden states `[B, T, n_taps*H]` -> `fc` (n*H -> H) -> RMSNorm
  (`hidden_norm`). `tap_layers` are DFlash's `target_layer_ids` as written: any order, a layer may
  repeat (DFlash's own spacing gives [1, 1] for a 4-layer target with 2 draft layers), and `fc` reads
  one H-slice per listed id, in list order. The target taps each of those layers once, in layer order
  (`target_tap_layers`); `context_features` lays its taps out in the drafter's order. Context rows
  are NOT passed through the draft layers: every draft layer projects the same normalized context
  with its own k/v projections (+ k_norm, RoPE at the tokens' absolute positions) and prepends those
  K/V to the block's own K/V.
- The block is `[last accepted token, MASK x (B-1)]`, embedded with the TARGET's embedding (the params
  are passed in, never copied). Queries come only from the block; attention is bidirectional inside
  the block and sees all committed context. Block positions continue after the context. The output
  goes through the drafter's final norm and the TARGET's lm_head; positions 1..B-1 are the drafts.
- Draft context cache = a `state.TargetState` over the draft layers (attention layers only): the
  per-layer context K/V (post k_norm and RoPE) of ACCEPTED tokens only. Storing K/V rather than the
  projected features costs 2*KVH*D per token per layer instead of H, but saves re-projecting the
  whole context every step.
  `extend_context` writes new rows at `lengths` and commits `n_new[b]` of them; `draft_block` writes
  the block's K/V after the committed context without committing it, so the next `extend_context`
  overwrites it (rollback by not advancing a length, as for the target cache).
- Params: `{"fc" [n*H, H], "hidden_norm" [H], "layers": (dense-layer dict, ...), "norm" [H]}` with the
  dense model's per-layer names and `[in, out]` layout, so `dense.layer_shapes` describes a layer.
- Checkpoints are the public DFlash format: `config.json` (a Qwen3 config with
  `architectures: ["DFlashDraftModel"]` and `dflash_config: {mask_token_id, target_layer_ids,
  block_size}`) and `model.safetensors` with DFlash's key names and torch `[out, in]` layout.
  DFlash2 extras (candidate selector, convolutions, logit soft-capping) are refused with a clear error,
  and so is any tensor with a NaN or Inf (`checkpoint.non_finite`), naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import sharding
from specpilot.state import TargetState
from specpilot.models import dense
from specpilot.models.checkpoint import non_finite
from specpilot.models.config import ConfigError, ModelConfig, RopeScaling, default_tap_layers
from specpilot.models.layers import apply_rope, attention, linear, rms_norm, rope_tables, swiglu

Params = dict
ARCHITECTURE = "DFlashDraftModel"
PACKAGED = Path(__file__).resolve().parent.parent / "assets"  # drafters shipped with the package


class DrafterCheckpointError(ValueError):
    """A drafter checkpoint that cannot be loaded as the DFlash block drafter."""


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


def init(key: jax.Array, cfg: DrafterConfig, dtype=jnp.bfloat16, std: float = 0.02) -> Params:
    """Random weights: N(0, std) for matrices, ones for norms, zeros for biases."""
    shapes = param_shapes(cfg)
    keys = iter(jax.random.split(key, 1 + cfg.num_layers * len(shapes["layers"][0])))

    def make(name, shape):
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        if name.endswith("bias"):
            return jnp.zeros(shape, dtype)
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    return {"fc": make("fc", shapes["fc"]), "hidden_norm": make("hidden_norm", (cfg.hidden_size,)),
            "norm": make("norm", (cfg.hidden_size,)),
            "layers": tuple({n: make(n, s) for n, s in layer.items()} for layer in shapes["layers"])}


def init_context_cache(cfg: DrafterConfig, batch_size: int, max_len: int, dtype=None) -> TargetState:
    """Empty draft context cache; max_len must match the target's state (lengths stay equal). dtype is
    required (the drafter params' dtype): there is no bf16 default."""
    return dense.init_state(cfg.layer_config, batch_size, max_len, dtype)


# --------------------------------------------------------------------------------------------------
# Forward


def _keys_values(lp: dict, cfg: DrafterConfig, x: jax.Array, cos, sin):
    """A draft layer's K/V for rows x [B, T, H] (context features or normed block states)."""
    b, t, _ = x.shape
    k = linear(x, lp["k"], lp.get("k_bias"), choice=cfg.matmul, role="k")
    v = linear(x, lp["v"], lp.get("v_bias"), choice=cfg.matmul, role="v")
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, cos, sin), v  # [B, T, KVH, D] each


def arrange_taps(cfg: DrafterConfig, taps: jax.Array) -> jax.Array:
    """The target's taps [..., m*H] (layers `cfg.target_tap_layers`) -> [..., n*H] in the drafter's
    `tap_layers` order, a repeated layer's state repeated: DFlash's concatenation."""
    h, distinct = cfg.hidden_size, cfg.target_tap_layers
    if taps.shape[-1] != len(distinct) * h:
        raise ValueError(f"taps have {taps.shape[-1]} features; the drafter reads target layers "
                         f"{distinct}, {len(distinct)} x hidden {h} = {len(distinct) * h}")
    if distinct == cfg.tap_layers:
        return taps
    slot = {layer: j for j, layer in enumerate(distinct)}
    return jnp.concatenate([taps[..., slot[t] * h:(slot[t] + 1) * h] for t in cfg.tap_layers], axis=-1)


def context_features(params: Params, cfg: DrafterConfig, taps: jax.Array) -> jax.Array:
    """Target taps [B, T, m*H] (one slice per layer of `cfg.target_tap_layers`) -> normalized context
    features [B, T, H]."""
    taps = arrange_taps(cfg, taps)
    ctx = linear(taps.astype(params["fc"].dtype), params["fc"], choice=cfg.matmul, role="fc")
    return rms_norm(ctx, params["hidden_norm"], cfg.rms_norm_eps)


def extend_context(params: Params, cfg: DrafterConfig, cache: TargetState, taps: jax.Array,
                   n_new: jax.Array) -> TargetState:
    """Append context rows and commit the first n_new[b] of them.

    taps [B, T, n*H] are the target's tapped states of the tokens at positions lengths[b] + i (a prompt
    or a verified block); rows at i >= n_new[b] are written but not committed.
    """
    t = taps.shape[1]
    ctx = context_features(params, cfg, taps)  # [B, T, H]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    cos, sin = rope_tables(positions, cfg.layer_config.inv_freq())
    layers = tuple(cache.layers[i].write(*_keys_values(lp, cfg, ctx, cos, sin), cache.lengths)
                   for i, lp in enumerate(params["layers"]))
    return TargetState(layers=layers, lengths=cache.lengths).commit(n_new)


def draft_block(params: Params, cfg: DrafterConfig, target_params: Params, target_cfg: ModelConfig,
                cache: TargetState, block_tokens: jax.Array):
    """block_tokens [B, Bs] -> (final-normed hidden [B, Bs, H], cache with block K/V written, uncommitted).

    The block sits at positions lengths[b] .. lengths[b]+Bs-1 and sees every committed context row and
    every block row (bidirectional inside the block).
    """
    b, t = block_tokens.shape
    x = dense.embed(target_params, block_tokens).astype(params["norm"].dtype)  # [B, Bs, H]
    start = cache.lengths  # [B]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, Bs]
    cos, sin = rope_tables(positions, cfg.layer_config.inv_freq())
    key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
    visible = key_pos[None, :] < (start + t)[:, None]  # [B, S]: context + the whole block
    mask = jnp.broadcast_to(visible[:, None, :], (b, t, cache.max_len))  # [B, Bs, S]
    layers = []
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q = linear(h, lp["q"], lp.get("q_bias"), choice=cfg.matmul, role="q")
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), cos, sin)
        kv = cache.layers[i].write(*_keys_values(lp, cfg, h, cos, sin), start)
        layers.append(kv)
        attn = attention(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), mask)
        x = x + linear(attn.reshape(b, t, cfg.num_heads * cfg.head_dim), lp["o"], lp.get("o_bias"),
                       choice=cfg.matmul, role="o")
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + swiglu(h, lp["gate"], lp["up"], lp["down"], choice=cfg.matmul)
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return x, TargetState(layers=tuple(layers), lengths=cache.lengths)


@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    """The drafter interface the speculative loop uses (static and hashable; params travel apart).

    Any object with these three methods can draft: `init_state`, `extend` (feed accepted context) and
    `propose` (logits for block positions 1..Bs-1 given the last accepted token).
    """

    cfg: DrafterConfig
    target_cfg: ModelConfig
    mesh: Any = None  # a jax.sharding.Mesh: the context cache is sharded over it (specpilot.sharding)

    def __post_init__(self):
        check_compatible(self.cfg, self.target_cfg)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def with_matmul(self, choice) -> "BlockDrafter":
        """This drafter with its layers and the target's head multiplied by `choice` (a plan's kernels)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, matmul=choice),
                                   target_cfg=dataclasses.replace(self.target_cfg, matmul=choice))

    def with_mesh(self, mesh) -> "BlockDrafter":
        """This drafter with its context cache sharded over `mesh` (None: one device)."""
        return dataclasses.replace(self, mesh=mesh)

    def init_state(self, params: Params, batch_size: int, max_len: int, dtype=None) -> TargetState:
        """The context cache, in dtype or else the drafter's own dtype (that of a norm: never encoded)."""
        cache = init_context_cache(self.cfg, batch_size, max_len, dtype or params["hidden_norm"].dtype)
        return sharding.constrain_state(cache, self.mesh)

    def extend(self, params: Params, target_params: Params, state: TargetState, taps: jax.Array,
               n_new: jax.Array) -> TargetState:
        return sharding.constrain_state(extend_context(params, self.cfg, state, taps, n_new), self.mesh)

    def propose(self, params: Params, target_params: Params, state: TargetState, last_tokens: jax.Array,
                block_size: int):
        """last_tokens [B] -> (draft logits [B, Bs-1, V] float32, state)."""
        b = last_tokens.shape[0]
        masks = jnp.full((b, block_size - 1), self.cfg.mask_token_id, jnp.int32)
        block = jnp.concatenate([last_tokens[:, None].astype(jnp.int32), masks], axis=1)  # [B, Bs]
        hidden, state = draft_block(params, self.cfg, target_params, self.target_cfg, state, block)
        return dense.lm_head(target_params, self.target_cfg, hidden[:, 1:]), sharding.constrain_state(state, self.mesh)


# --------------------------------------------------------------------------------------------------
# DFlash checkpoint format

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
    """Write config.json + model.safetensors in the DFlash layout (dtype kept as in params)."""
    from safetensors.flax import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for hf, (where, transposed, _) in _flat_names(cfg).items():
        x = params
        for k in where:
            x = x[k]
        tensors[hf] = jnp.asarray(x.T if transposed else x)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = jnp.dtype(params["fc"].dtype).name
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))


def load_drafter(path: str | Path, dtype=None) -> tuple[Params, DrafterConfig]:
    """Read a DFlash drafter directory -> (params, config). Errors name the file and the tensor."""
    from safetensors import SafetensorError, safe_open

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


@dataclasses.dataclass(frozen=True)
class ReplayDrafter:
    """Proposes a known reference continuation: oracle acceptance, or (shift != 0) always-wrong drafts.

    Its params are the reference `[B, R]` int32: each row's prompt followed by its continuation, indexed
    by absolute position. Its state is the committed context length `[B]`. A block starting at position
    L proposes reference[L+1 .. L+Bs-1] as one-hot logits of height `confidence`; the token at absolute
    position p is shifted by `shift` (mod V), i.e. made wrong, when `wrong_every` is 0 or divides p;
    with `runner_up` the right token stays second there (a tree's second sibling finds it).
    Useful wherever a drafter's acceptance must be controlled, e.g. targets with random weights; such
    results are labelled oracle-acceptance results.
    """

    vocab_size: int
    block_size: int
    shift: int = 0  # 0: the exact reference
    wrong_every: int = 0  # with shift != 0: 0 = every draft wrong, k = positions divisible by k wrong
    confidence: float = 30.0
    runner_up: float = 0.0  # > 0: a wrong draft keeps the right token second, this far below (trees)

    def with_mesh(self, mesh) -> "ReplayDrafter":
        """The replayed reference is one small array: nothing to shard."""
        del mesh
        return self

    def with_matmul(self, choice) -> "ReplayDrafter":
        del choice  # no weights: nothing to multiply
        return self

    def init_state(self, params, batch_size: int, max_len: int, dtype=None) -> jax.Array:
        return jnp.zeros((batch_size,), jnp.int32)

    def extend(self, params, target_params, state, taps, n_new):
        return state + n_new

    def propose(self, params, target_params, state, last_tokens, block_size: int):
        positions = state[:, None] + 1 + jnp.arange(block_size - 1, dtype=jnp.int32)[None, :]
        positions = jnp.minimum(positions, params.shape[1] - 1)  # past the reference: repeat its end
        wrong = (positions % self.wrong_every == 0) if self.wrong_every else True
        shift = jnp.where(wrong, self.shift, 0)
        right = jnp.take_along_axis(params, positions, axis=1)
        tokens = (right + shift) % self.vocab_size
        logits = self.confidence * jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        if self.runner_up:
            second = jnp.where(tokens != right, self.confidence - self.runner_up, 0.0)
            logits = logits + second[..., None] * jax.nn.one_hot(right, self.vocab_size, dtype=jnp.float32)
        return logits, state


def replay_reference(prompts, continuations, length: int | None = None) -> np.ndarray:
    """[B, R] int32 reference rows (prompt + continuation, zero-padded) for `ReplayDrafter`."""
    rows = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    length = length or max(len(r) for r in rows)
    out = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
