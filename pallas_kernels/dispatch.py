"""The one place that chooses how an op is computed: `matmul` (with `prepare_params`), `gated_delta_rule`,
`tree_gated_delta_rule`, `tree_attention`, `attention` and `residual_norm`. A choice (`OpChoice`) names
implementations in order of preference with the first one's settings; one that cannot take a call raises
NotImplementedError and the next runs. Each op's implementations and the design notes:
docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention_block as ab
from pallas_kernels import cpu_rows
from pallas_kernels import gated_delta_rule as gdr
from pallas_kernels import ragged_attention as ra
from pallas_kernels import residual_norm as rn
from pallas_kernels import tree_attention as ta
from pallas_kernels import tree_gated_delta_rule as tgdr
from pallas_kernels import w12_matmul, w12_mosaic
from pallas_kernels.w12_mosaic import TwinNK, W12MosaicConfig, W12NK
from specpilot.formats import w12 as w12_format
from specpilot.formats.w12 import W12


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """Implementations of an op in order of preference, and the first one's settings (None: defaults)."""

    implementation: tuple[str, ...] = ("xla",)
    config: Any = None


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """XLA (its dot, the jnp reference of an op) has no settings of ours."""


@dataclasses.dataclass(frozen=True)
class CpuRowsConfig:
    """The CPU rows kernel (`pallas_kernels.cpu_rows`) has no settings: its tiles suit every shape it takes."""


CONFIGS: dict[str, dict[str, type]] = {
    # cpu_rows: float32 weights on the CPU, laid out in column panels (`cpu_rows.RowPanels`)
    "matmul": {"mosaic": W12MosaicConfig, "triton": w12_matmul.W12TritonConfig, "cpu_rows": CpuRowsConfig,
               "xla": XlaConfig},
    "gated_delta_rule": {"triton": gdr.GatedDeltaRuleTritonConfig, "xla": XlaConfig},
    "tree_gated_delta_rule": {"triton": gdr.GatedDeltaRuleTritonConfig, "xla": XlaConfig},
    "tree_attention": {"triton": ta.TreeAttentionTritonConfig, "xla": XlaConfig},
    # triton_block: the fused attention block of a dense layer (`attention_block`); chain forwards only
    "attention": {"triton": ra.RaggedAttentionConfig, "triton_block": ab.AttentionBlockConfig, "xla": XlaConfig},
    # a residual add and the RMSNorm that reads it (a dense layer's)
    "residual_norm": {"triton": rn.ResidualNormConfig, "xla": XlaConfig},
}
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {op: tuple(impls) for op, impls in CONFIGS.items()}
VARIANT = re.compile(r"variant:[0-9a-f]{8,64}")


@dataclasses.dataclass(frozen=True)
class VariantConfig:
    """A kernel variant carries its settings in its source; none of ours."""


_VARIANTS: dict[str, dict[str, Callable]] = {op: {} for op in CONFIGS}


def is_variant(name: str) -> bool:
    return isinstance(name, str) and VARIANT.fullmatch(name) is not None


def register_variant(op: str, name: str, fn: Callable) -> None:
    """Make variant `name` (`variant:<hex>`) of `op` callable through this dispatch, in this process."""
    if op not in CONFIGS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(CONFIGS)}")
    if not is_variant(name):
        raise ValueError(f"a variant's name is 'variant:<8-64 hex digits>', got {name!r}")
    if not callable(fn):
        raise TypeError(f"variant {name} of {op} is not callable: {type(fn).__name__}")
    _VARIANTS[op][name] = fn


def variant(op: str, name: str) -> Callable:
    try:
        return _VARIANTS[op][name]
    except KeyError:
        raise LookupError(f"{op} implementation {name!r} is a kernel variant this process has not loaded "
                          f"(dispatch.register_variant)") from None


def _impl_config_cls(op: str, impl: str) -> type:
    return VariantConfig if is_variant(impl) else CONFIGS[op][impl]


def _unknown(op: str, impls) -> list[str]:
    return [i for i in impls if i not in CONFIGS[op] and not is_variant(i)]


def _config_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _coerce(cls: type, name: str, value):
    """A plain value (from YAML) for field `name` of `cls`: lists become tuples, mappings become the
    field's own config dataclass (`W12TritonConfig.blocks`)."""
    if name == "blocks" and cls is w12_matmul.W12TritonConfig and isinstance(value, Mapping):
        return _build(w12_matmul.W12Blocks, value, "triton.blocks")
    if isinstance(value, list):
        return tuple(value)
    return value


def _build(cls: type, values: Mapping, where: str):
    known = _config_fields(cls)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in the {where} config; known: "
                         f"{', '.join(known) or 'none'}")
    return cls(**{k: _coerce(cls, k, v) for k, v in values.items()})


def choice(op: str, implementation: str | tuple[str, ...] | list[str],
           config: Mapping | None = None) -> OpChoice:
    """An OpChoice for `op` from plain values: one implementation name or several in order, and the first
    one's settings as a mapping (None or {}: its defaults)."""
    if op not in CONFIGS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(CONFIGS)}")
    impls = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if not impls:
        raise ValueError(f"{op}: name at least one implementation ({', '.join(IMPLEMENTATIONS[op])})")
    bad = _unknown(op, impls)
    if bad:
        raise ValueError(f"unknown {op} implementation(s) {', '.join(map(repr, bad))}; known: "
                         f"{', '.join(IMPLEMENTATIONS[op])}, variant:<hash>")
    if isinstance(config, Mapping) and config:
        cfg = _build(_impl_config_cls(op, impls[0]), config, f"{op} {impls[0]!r}")
    elif config is None or isinstance(config, Mapping):
        cfg = None
    else:
        raise TypeError(f"config must be a mapping of {impls[0]!r} settings or None, got {type(config).__name__}")
    return OpChoice(implementation=impls, config=cfg)


def _config(c: OpChoice, op: str, impl: str):
    """The settings `impl` runs with under choice `c`: the choice's config for its first implementation."""
    cls = _impl_config_cls(op, impl)
    if impl == c.implementation[0] and c.config is not None:
        if not isinstance(c.config, cls):
            raise TypeError(f"{op} {impl!r} takes a {cls.__name__} config, got {type(c.config).__name__}")
        return c.config
    return cls()


def _check_choice(c: OpChoice, op: str) -> None:
    if not isinstance(c, OpChoice):
        raise TypeError(f"choice must be an OpChoice (dispatch.choice builds one), got {type(c).__name__}")
    if not c.implementation:
        raise ValueError(f"{op}: the choice names no implementation")
    bad = _unknown(op, c.implementation)
    if bad:
        raise ValueError(f"unknown {op} implementation(s) {', '.join(map(repr, bad))}; known: "
                         f"{', '.join(IMPLEMENTATIONS[op])}, variant:<hash>")


# ---- matmul ----------------------------------------------------------------------------------------

def _dense(w) -> jax.Array:
    """The bf16 [K, N] matrix any weight layout holds (exact), or the array itself."""
    if isinstance(w, W12):
        return w12_format.decode_jnp(w)
    if isinstance(w, W12NK):
        return w12_mosaic.decode_nk(w)
    if isinstance(w, TwinNK):
        return w12_mosaic.untile_twin(w)
    if isinstance(w, cpu_rows.RowPanels):
        return cpu_rows.from_panels(w)
    return w


def _xla(x, w, config: XlaConfig):
    del config
    return jnp.einsum("...k,kn->...n", x, _dense(w), preferred_element_type=jnp.float32)


def _triton(x, w, config):
    return w12_matmul.w12_matmul(x, w, config)  # W12 only: other weights raise NotImplementedError


def _mosaic(x, w, config: W12MosaicConfig):
    return w12_mosaic.mosaic_matmul(x, w, config)


def _cpu_rows(x, w, config: CpuRowsConfig):
    del config
    return cpu_rows.rows_matmul(x, w)


_MATMULS = {"xla": _xla, "triton": _triton, "mosaic": _mosaic, "cpu_rows": _cpu_rows}


def _matmul_impl(impl: str) -> Callable:
    if is_variant(impl):
        fn = variant("matmul", impl)
        return lambda x, w, config: fn(x, w)
    return _MATMULS[impl]


def default_choice(w) -> OpChoice:
    """What multiplies `w` when no choice is given (the behaviour before choices): bf16 arrays by XLA,
    the Mosaic layouts by that kernel (they exist only for it), a W12 by decoding it for XLA's dot (a plan's
    choice names a kernel for it: `ModelConfig.matmul`)."""
    if isinstance(w, (W12NK, TwinNK)):
        return OpChoice(("mosaic",))
    if isinstance(w, cpu_rows.RowPanels):
        return OpChoice(("cpu_rows", "xla"))
    return OpChoice(("xla",))


def matmul(x: jax.Array, w, b: jax.Array | None = None, *, choice: OpChoice | None = None, role: str = "",
           out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, N] (+ b) with float32 accumulation, the result in `out_dtype` (default x's dtype).
    `w`: a bf16 array or a layout `prepare_params` made. Tries `choice.implementation` in order, falling
    through on NotImplementedError. `role` names the product in its model ("qkv": the fused q/k/v
    projection, materialized after the Mosaic kernel when its config's `qkv_barrier` says so)."""
    c = default_choice(w) if choice is None else choice
    _check_choice(c, "matmul")
    refused = []
    for impl in c.implementation:
        config = _config(c, "matmul", impl)
        try:
            y = _matmul_impl(impl)(x, w, config)
        except NotImplementedError as e:
            refused.append(f"{impl}: {e}")
            continue
        if b is not None:
            y = y + b.astype(jnp.float32)
        y = y.astype(out_dtype or x.dtype)
        if impl == "mosaic" and role == "qkv" and config.qkv_barrier:
            # the K-split sum materialized once: XLA would otherwise fuse it into the k-norm's reduce and
            # recompute it there (5.8 us per layer on the H200)
            y = jax.lax.optimization_barrier(y)
        return y
    raise NotImplementedError(f"no matmul implementation of {c.implementation} takes x {x.shape} {x.dtype} @ "
                              f"{type(w).__name__} {tuple(w.shape)}: " + "; ".join(refused))


def _first_taking(op: str, table: dict, args: tuple, choice: OpChoice | None, describe: Callable[[], str]):
    """`op` through the first implementation of `choice` (None: the reference, "xla") that takes `args`,
    falling through on NotImplementedError; a kernel variant is called with the op's arguments alone."""
    c = OpChoice(("xla",)) if choice is None else choice
    _check_choice(c, op)
    refused = []
    for impl in c.implementation:
        try:
            if is_variant(impl):
                return variant(op, impl)(*args)
            return table[impl](*args, _config(c, op, impl))
        except NotImplementedError as e:
            refused.append(f"{impl}: {e}")
    raise NotImplementedError(f"no {op} implementation of {c.implementation} takes {describe()}: "
                              + "; ".join(refused))


# ---- gated_delta_rule --------------------------------------------------------------------------------

def _gdr_xla(q, k, v, g, beta, s0, config: XlaConfig):
    del config
    return gdr.gated_delta_rule_reference(q, k, v, g, beta, s0)


_GATED_DELTA_RULES = {"xla": _gdr_xla, "triton": gdr.gated_delta_rule}


def gated_delta_rule(q, k, v, g, beta, s0, *, choice: OpChoice | None = None):
    """The gated delta rule token by token: q, k [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H], s0
    [B, H, DK, DV] -> (o [B, T, H, DV], states [B, T, H, DK, DV]: after each token). Tries
    `choice.implementation` in order (None: the reference), falling through on NotImplementedError."""
    return _first_taking("gated_delta_rule", _GATED_DELTA_RULES, (q, k, v, g, beta, s0),
                         choice, lambda: f"k {k.shape} v {v.shape} {v.dtype}")


# ---- tree_gated_delta_rule ---------------------------------------------------------------------------

def _tgdr_xla(q, k, v, g, beta, s0, parents, config: XlaConfig):
    del config
    return tgdr.tree_gated_delta_rule_reference(q, k, v, g, beta, s0, parents)


_TREE_GATED_DELTA_RULES = {"xla": _tgdr_xla, "triton": tgdr.tree_gated_delta_rule}


def tree_gated_delta_rule(q, k, v, g, beta, s0, parents, *, choice: OpChoice | None = None):
    """The gated delta rule over a token tree: `gated_delta_rule`'s arguments plus parents [B, T] int32
    (-1: from s0) -> (o [B, T, H, DV], every node's state [B, T, H, DK, DV]). Tries
    `choice.implementation` in order (None: the reference), falling through on NotImplementedError."""
    return _first_taking("tree_gated_delta_rule", _TREE_GATED_DELTA_RULES, (q, k, v, g, beta, s0, parents),
                         choice, lambda: f"k {k.shape} v {v.shape} {v.dtype}")


# ---- tree_attention ----------------------------------------------------------------------------------

def _ta_xla(q, k_cache, v_cache, lengths, ancestors, config: XlaConfig):
    del config
    return ta.tree_attention_reference(q, k_cache, v_cache, lengths, ancestors)


_TREE_ATTENTIONS = {"xla": _ta_xla, "triton": ta.tree_attention}


def tree_attention(q, k_cache, v_cache, lengths, ancestors, *, choice: OpChoice | None = None):
    """A tree verification's attention: q [B, N, H, D] of the N nodes, k_cache, v_cache [B, KVH, S, D]
    with the nodes' K/V at slots lengths[b] + j, lengths [B] committed slots, ancestors [B, N, N] bool
    -> [B, N, H, D]. Tries `choice.implementation` in order (None: the reference), falling through on
    NotImplementedError."""
    return _first_taking("tree_attention", _TREE_ATTENTIONS, (q, k_cache, v_cache, lengths, ancestors),
                         choice, lambda: f"q {q.shape} over a cache {k_cache.shape} {k_cache.dtype}")


# ---- attention ---------------------------------------------------------------------------------------

def _attention_xla(q, k_cache, v_cache, lengths, counts, config: XlaConfig):
    del config
    ra.check_shapes(q, k_cache, v_cache, lengths, counts)
    mask = ra.visible_mask(lengths, counts, q.shape[1], k_cache.shape[2])
    return ta.cache_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)


def _attention_block_only(q, k_cache, v_cache, lengths, counts, config):
    del q, k_cache, v_cache, lengths, counts, config
    raise NotImplementedError("triton_block computes a layer's whole attention block (dispatch.attention_block), "
                              "not attention alone")


_ATTENTIONS = {"xla": _attention_xla, "triton": ra.ragged_attention, "triton_block": _attention_block_only}


def attention(q, k_cache, v_cache, lengths, counts, *, choice: OpChoice | None = None):
    """Chain attention by length: q [B, T, H, D], k_cache, v_cache [B, KVH, S, D] with the T tokens' K/V
    at slots lengths[b] + t, lengths [B] committed slots, counts [B] (0..T) the row's valid new tokens
    (query t sees slots < lengths[b] + min(t + 1, counts[b])) -> [B, T, H, D]. Tries
    `choice.implementation` in order (None: the reference), falling through on NotImplementedError."""
    return _first_taking("attention", _ATTENTIONS, (q, k_cache, v_cache, lengths, counts),
                         choice, lambda: f"q {q.shape} over a cache {k_cache.shape} {k_cache.dtype}")


def attention_block(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, *, num_heads: int,
                    num_kv_heads: int, head_dim: int, eps: float, choice: OpChoice | None):
    """A dense layer's attention block in one kernel when `choice` (the plan's `attention`) names
    "triton_block" first: the fused q/k/v product's output -> q/k norm, RoPE, the new K/V written to the
    caches, chain attention (`attention_block.attention_block_reference` gives the arguments). Returns
    (attn [B, T, H*D], k_cache, v_cache). Raises NotImplementedError otherwise, or where the kernel does
    not take the call: the caller then runs the unfused path, whose attention takes the choice's next
    implementation."""
    if choice is None or not choice.implementation or choice.implementation[0] != "triton_block":
        raise NotImplementedError("the plan's attention does not name triton_block first")
    _check_choice(choice, "attention")
    return ab.attention_block(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts,
                              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps,
                              config=_config(choice, "attention", "triton_block"))


# ---- residual_norm -----------------------------------------------------------------------------------

def _residual_norm_xla(x, r, weight, eps, config: XlaConfig):
    del config
    return rn.residual_norm_reference(x, r, weight, eps)


_RESIDUAL_NORMS = {"xla": _residual_norm_xla, "triton": rn.residual_norm}


def residual_norm(x, r, weight, eps: float, *, choice: OpChoice | None = None):
    """The residual add and the RMSNorm that reads it: x, r [..., D], weight [D] -> (h = x + r,
    weight * rmsnorm(h)), each in x's dtype (`residual_norm.residual_norm_reference`). Tries
    `choice.implementation` in order (None: the reference), falling through on NotImplementedError."""
    return _first_taking("residual_norm", _RESIDUAL_NORMS, (x, r, weight, eps), choice,
                         lambda: f"x {x.shape} {x.dtype} with a {weight.dtype} weight")


# ---- weight layouts ----------------------------------------------------------------------------------

def _prepare_xla(w, rows: int, config: XlaConfig):
    del rows, config
    return w


def _prepare_triton(w, rows: int, config):
    del rows, config
    if not isinstance(w, W12):
        raise NotImplementedError("the Triton W12 kernel multiplies W12 weights; bf16 ones go to XLA")
    return w


def _prepare_mosaic(w, rows: int, config: W12MosaicConfig):
    if isinstance(w, W12):
        return w12_mosaic.prepare_w12(w, rows, config)
    if isinstance(w, (W12NK, TwinNK)):
        return w
    return w12_mosaic.prepare_twin(w, rows, config)


def _prepare_cpu_rows(w, rows: int, config: CpuRowsConfig):
    del rows, config
    if isinstance(w, cpu_rows.RowPanels):
        return w
    if not isinstance(w, (jax.Array, np.ndarray)) or jax.default_backend() != "cpu" or not cpu_rows.available():
        raise NotImplementedError(cpu_rows.unavailable_reason() or "the CPU rows kernel takes float32 arrays "
                                  "on the CPU backend")
    return cpu_rows.to_panels(w)


_PREPARE = {"xla": _prepare_xla, "triton": _prepare_triton, "mosaic": _prepare_mosaic, "cpu_rows": _prepare_cpu_rows}


def prepare_weight(w, c: OpChoice, rows: int = 1):
    """One [K, N] weight in the layout of the first implementation of `c` that takes it (offline work).
    `rows`: the most rows a decoding step multiplies per call (batch x verification block)."""
    _check_choice(c, "matmul")
    refused = []
    for impl in c.implementation:
        try:
            if is_variant(impl):  # a variant multiplies the weight as the plan's format holds it
                return w
            return _PREPARE[impl](w, rows, _config(c, "matmul", impl))
        except NotImplementedError as e:
            refused.append(f"{impl}: {e}")
    raise NotImplementedError(f"no matmul implementation of {c.implementation} takes a {type(w).__name__} "
                              f"{tuple(w.shape)}: " + "; ".join(refused))


def prepare_params(params: dict, choice: OpChoice, rows: int = 1, extra: tuple[str, ...] = (),
                   names: tuple[str, ...] = w12_format.LINEAR_NAMES, lm_head: bool = True,
                   layout_bf16: bool = True) -> dict:
    """A dense model's params with each linear weight (the named per-layer matrices, `lm_head`, and the
    top-level matrices in `extra`, e.g. a drafter's `fc`) in the layout `choice` multiplies
    (`prepare_weight`): W12 -> W12NK and bf16 -> TwinNK tiles for "mosaic", unchanged for "xla" and
    "triton" (whose bf16 weights go to XLA). Encode a format first (`specpilot.formats.encode_params`).
    `layout_bf16=False` leaves bf16 arrays as they are (in a W12 plan, the matrices the encoder kept bf16
    then go to XLA's dot, as before choices existed)."""
    def prepare(w):
        return prepare_weight(w, choice, rows) if layout_bf16 or not isinstance(w, jax.Array) else w

    out = w12_format.map_matrices(prepare, params, names, lm_head, extra)
    if lm_head and layout_bf16 and "embed" in out and "lm_head" not in out and rows_before_xla(choice):
        # a tied head on the CPU rows kernel: the embedding's transpose in panels, `tied_head` (a copy of
        # the embedding's size; XLA's einsum against the embedding costs 2-3x one row's at 4-8 rows)
        try:
            out = {**out, "tied_head": _prepare_cpu_rows(jnp.transpose(jnp.asarray(out["embed"])), rows,
                                                         CpuRowsConfig())}
        except NotImplementedError:
            pass
    return out


def rows_before_xla(choice: OpChoice) -> bool:
    """Whether `choice` tries the CPU rows kernel before XLA (where a tied head gets `tied_head`)."""
    for impl in choice.implementation:
        if impl in ("cpu_rows", "xla"):
            return impl == "cpu_rows"
    return False
