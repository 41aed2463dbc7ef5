"""Typed schemas of the Hydra configuration, registered in Hydra's ConfigStore.

Design choices:
- One small dataclass per config group (target, drafter, gpu, decoding, bench); YAML files under
  `conf/<group>/` extend the group's schema (`defaults: [<group>_schema, _self_]`), so a typo in a key or
  a wrongly typed value fails when Hydra composes the config. The top level is checked by `typed`
  (merged onto `Config`), which keeps `_self_` first in the main defaults list.
- `validate` checks what types cannot: impossible values and combinations (block size 0, a batch larger
  than the prompt set, new tokens that cannot fit the cache, an unknown method) with messages that name
  the offending key.
- Every mechanism is a named choice (method list, weight format, kernel backend), so a later agent loop
  can rewrite a deployment's plan as a config override.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

TARGET_SOURCES = ("random", "hf", "embedded")
DRAFTER_SOURCES = ("none", "random", "dflash", "embedded", "oracle")
PROMPT_SETS = ("random", "heldout")


@dataclasses.dataclass
class TargetConf:
    name: str = MISSING
    source: str = "random"  # random weights at `model`'s shape | hf checkpoint at `path` | embedded
    path: Optional[str] = None
    dtype: str = "bfloat16"
    # fused: q/k/v and gate/up as one matrix each (7.2 -> 5.1 ms/token for Qwen3-8B on an H200);
    # every method of a run uses the same layout, so outputs stay comparable token for token
    layout: str = "fused"
    init_std: float = 0.02  # random targets only
    # random targets only: wide_margin keeps greedy choices far from ties, so outputs do not depend on
    # which kernels compute a step (dense.init_wide_margin); normal is N(0, init_std) everywhere
    init: str = "wide_margin"
    tap_layers: Optional[List[int]] = None  # default: the drafter's evenly spaced DFlash choice
    model: Dict[str, Any] = dataclasses.field(default_factory=dict)  # HF config.json fields


@dataclasses.dataclass
class DrafterConf:
    name: str = "none"
    source: str = "none"
    path: Optional[str] = None
    block_size: int = 16
    num_layers: int = 1
    num_taps: int = 5
    # oracle acceptance: per-position conditional acceptance probabilities, a target tau, or a trace
    # recorded by an earlier run (its results.jsonl or run folder; e.g. the trained embedded pair's)
    acceptance: Optional[List[float]] = None
    tau: Optional[float] = None
    acceptance_trace: Optional[str] = None


@dataclasses.dataclass
class GpuConf:
    name: str = "cpu"
    memory_bandwidth_gbs: float = 50.0  # peak, feeds the cost model
    matmul_tflops_bf16: float = 1.0
    # what multiplies weights stored in a non-bf16 format (decoding=w12): triton = the fused Pallas
    # kernels (Pallas' Triton backend; GPUs), mosaic = the Mosaic GPU W12 kernel (Hopper; its layout,
    # `w12.W12NK`), xla = decode to bf16 then XLA's dot (any backend)
    kernel_backend: str = "xla"


@dataclasses.dataclass
class DecodingConf:
    name: str = "ar"
    methods: List[str] = dataclasses.field(default_factory=lambda: ["ar"])
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    forcing_margin: float = 1e-3  # top-1/top-2 logit gap below which a mismatch is a near-tie
    # one extra profiled (phase-synced) pass per speculative method for the draft/verify/bookkeeping split
    profile_split: bool = True


@dataclasses.dataclass
class BenchConf:
    name: str = "default"
    prompts: str = "random"  # random token ids | heldout (embedded corpus)
    num_prompts: int = 4
    prompt_len: int = 32  # random prompts: tokens per prompt; heldout: max prompt tokens
    new_tokens: int = 32
    batch_size: int = 1
    cache_len: Optional[int] = None  # default: enough for prompt + new tokens + one block
    repeats: int = 1  # timed repetitions per method (median reported)


@dataclasses.dataclass
class Config:
    target: TargetConf = MISSING
    drafter: DrafterConf = MISSING
    gpu: GpuConf = MISSING
    decoding: DecodingConf = MISSING
    bench: BenchConf = MISSING
    seed: int = 0
    cache_dir: str = "~/.cache/specpilot"  # trained embedded pair, tokenizer
    # overrides of specpilot.embedded.EmbeddedConfig (training sizes, prompts), e.g. embedded.target.steps
    embedded: Dict[str, Any] = dataclasses.field(default_factory=dict)
    output_dir: Optional[str] = None  # default: Hydra's run directory


def register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, node in (("target", TargetConf), ("drafter", DrafterConf), ("gpu", GpuConf),
                        ("decoding", DecodingConf), ("bench", BenchConf)):
        cs.store(group=group, name=f"{group}_schema", node=node)


class ConfigValueError(ValueError):
    """A composed configuration with an impossible value."""


def _fail(key: str, msg: str):
    raise ConfigValueError(f"{key}: {msg}")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigValueError naming the key for impossible values (types are checked by Hydra)."""
    from specpilot.methods import METHODS  # late import: methods import the heavy model code

    t, d, b, dec = cfg.target, cfg.drafter, cfg.bench, cfg.decoding
    if t.source not in TARGET_SOURCES:
        _fail("target.source", f"{t.source!r} is not one of {TARGET_SOURCES}")
    if t.source == "hf" and not t.path:
        _fail("target.path", "an hf target needs the path of a local checkpoint directory")
    if t.source == "random" and not t.model:
        _fail("target.model", "a random target needs its shape (config.json fields)")
    if t.layout not in ("fused", "separate"):
        _fail("target.layout", f"{t.layout!r} is not fused or separate")
    if cfg.gpu.kernel_backend not in ("xla", "triton", "mosaic"):
        _fail("gpu.kernel_backend", f"{cfg.gpu.kernel_backend!r} is not xla, triton or mosaic")
    if t.init not in ("normal", "wide_margin"):
        _fail("target.init", f"{t.init!r} is not normal or wide_margin")
    if t.dtype not in ("bfloat16", "float32"):
        _fail("target.dtype", f"{t.dtype!r} is not bfloat16 or float32")
    if d.source not in DRAFTER_SOURCES:
        _fail("drafter.source", f"{d.source!r} is not one of {DRAFTER_SOURCES}")
    if d.block_size < 1:
        _fail("drafter.block_size", f"must be >= 1, got {d.block_size}")
    if d.num_layers < 1:
        _fail("drafter.num_layers", f"must be >= 1, got {d.num_layers}")
    if d.source == "embedded" and t.source != "embedded":
        _fail("drafter.source", "the embedded drafter belongs to the embedded target (target=embedded)")
    if b.prompts == "heldout" and t.source != "embedded":
        _fail("bench.prompts", "held-out prompts come from the embedded corpus and tokenizer; use "
              "target=embedded or bench.prompts=random")
    if d.source == "dflash" and not d.path:
        _fail("drafter.path", "a dflash drafter needs the path of a local checkpoint directory")
    if d.source == "oracle" and d.acceptance is None and d.tau is None and not d.acceptance_trace:
        _fail("drafter.acceptance", "an oracle drafter needs an acceptance profile, a tau or a trace")
    if d.acceptance_trace and d.acceptance is not None:
        _fail("drafter.acceptance_trace", "give an acceptance profile or a trace, not both")
    if d.acceptance_trace:
        from pathlib import Path

        trace = Path(d.acceptance_trace).expanduser()
        if not (trace / "results.jsonl" if trace.is_dir() else trace).is_file():
            _fail("drafter.acceptance_trace", f"no results.jsonl at {trace}")
    if d.source == "oracle" and d.tau is not None and not d.acceptance_trace and not 1 <= d.tau <= d.block_size:
        _fail("drafter.tau", f"{d.tau} is impossible with block size {d.block_size}")
    if d.source == "oracle" and dec.temperature != 0:
        _fail("drafter.source", "oracle acceptance replays greedy continuations; use temperature 0")
    for m in dec.methods:
        if m not in METHODS:
            _fail("decoding.methods", f"unknown method {m!r}; known: {sorted(METHODS)}")
        if METHODS[m].needs_drafter and d.source == "none":
            _fail("drafter", f"method {m!r} needs a drafter; choose one, e.g. drafter=embedded")
    if any(m.endswith("_w12") for m in dec.methods) and t.dtype != "bfloat16":
        _fail("target.dtype", "the 12-bit weight format encodes bfloat16 weights; set target.dtype=bfloat16")
    if "ar_twin" in dec.methods:
        if cfg.gpu.kernel_backend != "mosaic":
            _fail("gpu.kernel_backend", "ar_twin runs the Mosaic GPU kernel's bf16 twin; set gpu.kernel_backend=mosaic")
        if t.dtype != "bfloat16":
            _fail("target.dtype", "ar_twin multiplies bfloat16 weights; set target.dtype=bfloat16")
    if dec.temperature < 0 or not 0 < dec.top_p <= 1 or dec.top_k < 0:
        _fail("decoding", "temperature >= 0, top_k >= 0 and 0 < top_p <= 1 are required")
    for key in ("num_prompts", "prompt_len", "new_tokens", "batch_size", "repeats"):
        if b[key] < 1:
            _fail(f"bench.{key}", f"must be >= 1, got {b[key]}")
    if b.batch_size > b.num_prompts:
        _fail("bench.batch_size", f"{b.batch_size} is larger than the prompt set ({b.num_prompts})")
    if b.prompts not in PROMPT_SETS:
        _fail("bench.prompts", f"{b.prompts!r} is not one of {PROMPT_SETS}")
    needed = b.prompt_len + b.new_tokens + d.block_size
    if b.cache_len is not None and b.cache_len < needed:
        _fail("bench.cache_len", f"{b.cache_len} cannot hold prompt_len + new_tokens + block_size "
              f"= {needed}")


def typed(cfg: DictConfig) -> DictConfig:
    """Merge the composed config onto the top-level schema: a misspelled or mistyped key fails here."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    OmegaConf.set_struct(merged, True)
    return merged


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
