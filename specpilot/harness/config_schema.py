"""Typed schemas of the Hydra configuration (one dataclass per config group, registered in Hydra's
ConfigStore so a misspelled or mistyped key fails at composition), `validate` for the impossible values
and combinations types cannot catch, and `build_plans`, which turns `decoding.plans` into frozen
`specpilot.plan.Plan`s beside the device's AR baselines."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pallas_kernels import dispatch
from specpilot import plan as plan_mod
from specpilot.harness import config_errors, config_files, shapes
from specpilot.harness.config_errors import ConfigValueError, fail as _fail  # noqa: F401  (raised by every check)
from specpilot.models.drafter import PACKAGED, packaged_drafters
from specpilot.models.oracle_trace import trace_path
from specpilot.plan import Plan

TARGET_SOURCES = ("random", "hf", "embedded", "gguf", "smollm2")
DRAFTER_SOURCES = ("none", "random", "dflash", "packaged", "embedded", "oracle", "oracle_trace")
MATMUL_PRECISIONS = (None, "default", "high", "highest")  # jax.default_matmul_precision's names
# random token ids | heldout (embedded corpus) | text sets tokenized with the target's own tokenizer:
# chat (held-out stdlib requests) | humaneval (plain completion) | humaneval_chat (specpilot.data.prompt_sets)
PROMPT_SETS = ("random", "heldout", "chat", "humaneval", "humaneval_chat")
# the kernel ops whose default is one implementation list of the gpu group (`gpu.<op>`); matmul's is per
# weight format and gated_delta_rule's is kept apart (the AR baseline's own)
DEFAULTED_OPS = ("tree_gated_delta_rule", "tree_attention", "attention", "residual_norm")


@dataclasses.dataclass
class TargetConf:
    name: str = MISSING
    # random weights at `model`'s shape | hf checkpoint at `path` | embedded | a gguf file at `path` |
    # smollm2 (SmolLM2-135M-Instruct's GGUF from the package registry)
    source: str = "random"
    path: Optional[str] = None
    dtype: str = "bfloat16"
    # jax's default_matmul_precision for the whole process (null: jax's default, under which float32
    # products may run in TF32 on NVIDIA GPUs); highest keeps float32 products float32, so a float32
    # target's choices do not depend on how many tokens a forward holds
    matmul_precision: Optional[str] = None
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
    draft_vocab: Optional[int] = None  # score only the first K ids of a token ranking (null: all ids)
    draft_vocab_ids: Optional[str] = None  # that ranking (.npy); null: the drafter folder's draft_vocab.npy
    # draft every block this many rows wide (a trained drafter's training block: it saw that many mask
    # rows, bidirectionally), keeping the plan's first block_size rows; null: as wide as the plan's block
    draft_width: Optional[int] = None
    # oracle acceptance: per-position conditional acceptance probabilities, a target tau, or a trace
    # recorded by an earlier run (its results.jsonl or run folder; e.g. the trained embedded pair's)
    acceptance: Optional[List[float]] = None
    tau: Optional[float] = None
    acceptance_trace: Optional[str] = None
    # oracle_trace: a per-step accepted-drafts file (experiments/bench/record_trace.py), one trace per plan name
    step_trace: Optional[str] = None
    # oracle: draft confidence drawn from a trained pair's recorded top-1 probabilities by outcome (a
    # record_trace.py file; relative: the working directory's, else the repository's), that method's
    confidence_trace: Optional[str] = None
    confidence_method: str = "stock"


@dataclasses.dataclass
class GpuConf:
    name: str = "cpu"  # the device it describes: cpu, or a word of jax's device_kind (h200: "NVIDIA H200")
    # true: build and run on a device other than the one `name` describes (its rates and kernel defaults
    # then describe another device; records say so); false: such a run is refused before anything is built
    allow_mismatch: bool = False
    memory_bandwidth_gbs: float = 50.0  # peak, feeds the cost model
    matmul_tflops_bf16: float = 1.0
    # sharded plans (cost model): bandwidth per direction between two devices, and a latency per collective
    interconnect_gbs: float = 0.0
    collective_latency_us: float = 0.0
    # defaults only: the matmul implementations (tried in order) of a plan that names none, per weight
    # format. xla = XLA's dot (12-bit weights decoded first); triton = the fused Pallas kernels (Pallas'
    # Triton backend); mosaic = the Mosaic GPU W12 kernel (Hopper), and for bf16 weights its bf16 twin
    matmul: Dict[str, List[str]] = dataclasses.field(
        default_factory=lambda: {"bf16": ["xla"], "w12": ["xla"]})
    # defaults only: the gated delta rule's implementations (a hybrid target's linear attention in decode
    # and verification) of a plan that names none. xla = the jnp recurrence; triton = the Pallas kernel
    gated_delta_rule: List[str] = dataclasses.field(default_factory=lambda: ["xla"])
    # defaults only: the gated delta rule over a tree (a hybrid's tree verification) of a plan that names
    # none. xla = the jnp per-node recurrence; triton = the Pallas kernel
    tree_gated_delta_rule: List[str] = dataclasses.field(default_factory=lambda: ["xla"])
    # defaults only: tree verification's attention (`pallas_kernels.tree_attention`) of a plan that names
    # none. xla = the attention over the full tree mask; triton = the Pallas kernel
    tree_attention: List[str] = dataclasses.field(default_factory=lambda: ["xla"])
    # defaults only: chain attention (decode, chain verification, prefill chunks, the serving engine's
    # steps) of a plan that names none. xla = the masked attention over the whole cache; triton = the
    # Pallas ragged kernel (`pallas_kernels.ragged_attention`: each row reads only its own slots)
    attention: List[str] = dataclasses.field(default_factory=lambda: ["xla"])
    # defaults only: a dense layer's residual adds with the RMSNorm that reads each, of a plan that names
    # none. xla = XLA's add and norm; triton = the fused Pallas kernel (`pallas_kernels.residual_norm`)
    residual_norm: List[str] = dataclasses.field(default_factory=lambda: ["xla"])
    # the bf16 AR implementations the runner measures on this device; the fastest is the AR baseline
    ar_baselines: List[List[str]] = dataclasses.field(default_factory=lambda: [["xla"]])


@dataclasses.dataclass
class OpConf:
    """One op's kernels in a plan (`dispatch.OpChoice`)."""

    implementation: Optional[List[str]] = None  # null: the gpu group's default (gpu.<op>)
    config: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the first implementation's options


@dataclasses.dataclass
class KernelsConf:
    matmul: OpConf = dataclasses.field(default_factory=OpConf)  # default: gpu.matmul.<plan's weights>
    gated_delta_rule: OpConf = dataclasses.field(default_factory=OpConf)  # default: gpu.gated_delta_rule
    tree_gated_delta_rule: OpConf = dataclasses.field(default_factory=OpConf)  # default: gpu.tree_gated_delta_rule
    tree_attention: OpConf = dataclasses.field(default_factory=OpConf)  # default: gpu.tree_attention
    attention: OpConf = dataclasses.field(default_factory=OpConf)  # default: gpu.attention
    residual_norm: OpConf = dataclasses.field(default_factory=OpConf)  # default: gpu.residual_norm


@dataclasses.dataclass
class TreeConf:
    nodes: int = 0
    depth: int = 0
    branching: int = 0


@dataclasses.dataclass
class TwoLevelConf:
    first: str = "drafter_confidence"  # drafter_confidence | early_exit
    keep: int = 0  # nodes the target verifies (root included)
    exit_layer: Optional[int] = None  # early_exit: target layers that score the drafted tree
    exit_head: Optional[str] = None  # early_exit: a trained exit head's folder (null: the target's own head)


@dataclasses.dataclass
class MeshConf:
    """A plan's devices (`specpilot.sharding.MeshShape`): batch rows over data, heads over tensor."""

    data: int = 1
    tensor: int = 1


@dataclasses.dataclass
class BatchingConf:
    """The serving engine's batching of a plan (`specpilot.plan.Batching`)."""

    policy: str = "continuous"  # continuous | static (a new wave only into an empty batch)
    draft_budget: str = "fixed"  # fixed | confidence (per-row draft counts under token_budget)
    verify: str = "padded"  # padded | packed (only kept candidates enter the verify forward)
    token_budget: Optional[int] = None  # verification tokens per step over the batch; null: no limit
    streams: int = 1  # packed: stream sizes compiled up to token_budget; each step runs the smallest that fits
    pricing: str = "flat"  # flat | measured (packed + confidence: each stream size's step timed at build)
    overlap: str = "none"  # none | halves (verify one half of the slots while drafting the other)
    dispatch: str = "pipelined"  # sync | pipelined (enqueue the next step before reading this one's tokens)
    kv: str = "contiguous"  # contiguous | paged (K/V in pages of a pool, allocated as rows grow)
    page_size: int = 16  # slots per page (paged)
    pages: Optional[int] = None  # pages in the pool (paged); null: every slot's whole context


@dataclasses.dataclass
class PlanConf:
    """One decoding plan (`specpilot.plan.Plan`); unset fields take the deployment's defaults."""

    verify: str = "chain"  # ar | chain | tree | two_level
    weights: str = "bf16"  # bf16 | w12
    block_size: Optional[int] = None  # chain: the drafter's block size when null; tree: its width
    kernels: KernelsConf = dataclasses.field(default_factory=KernelsConf)
    tree: Optional[TreeConf] = None  # tree and two_level plans: nodes (root included), depth, branching
    two_level: Optional[TwoLevelConf] = None  # two_level plans: the first level
    batching: BatchingConf = dataclasses.field(default_factory=BatchingConf)
    mesh: Optional[MeshConf] = None  # null: one device
    # a w12 plan's encoded matrix classes (qkv, o, gate_up, down, lm_head, fc); null: all of them
    w12_matrices: Optional[List[str]] = None
    # rows a block drafter drafts each block over (the first block_size kept); null: drafter.draft_width
    draft_width: Optional[int] = None


@dataclasses.dataclass
class VariantConf:
    """A kernel variant a plan names (`variant:<digest of op and source>`), its module's source inline."""

    op: str = MISSING
    source: str = MISSING


@dataclasses.dataclass
class DecodingConf:
    name: str = "ar"
    # the run's plans by name (every field overridable: `decoding.plans.stock.weights=w12`; a new plan from
    # the command line: `+decoding.plans.NAME={...}`, merged by `entry.app`); AR baselines: `gpu.ar_baselines`
    plans: Dict[str, PlanConf] = dataclasses.field(default_factory=dict)
    # sampling of every plan: temperature 0 is greedy (argmax); above 0, tokens are drawn from the
    # softmax at that temperature, restricted to the top_k most likely (0: all) and to the smallest set
    # holding top_p of the probability; speculative plans then verify by rejection sampling (lossless)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    forcing_margin: float = 1e-3  # top-1/top-2 logit gap below which a mismatch is a near-tie
    # false: timing only (calibration sweeps); records then say the plans were not checked, and the
    # speedups of such a run are not lossless results
    forcing: bool = True
    # one extra profiled (phase-synced) pass per speculative plan for the draft/verify/bookkeeping split
    profile_split: bool = True
    # kernel variants the plans name (the optimization loop's found plans carry them; harness.plan_variants)
    variants: List[VariantConf] = dataclasses.field(default_factory=list)
    # where they are checked before the run: bwrap (a sandbox: specpilot.agent.sandbox) or none (no sandbox)
    variants_sandbox: str = "bwrap"


@dataclasses.dataclass
class BenchConf:
    name: str = "default"
    prompts: str = "random"  # one of PROMPT_SETS
    num_prompts: int = 4
    prompt_len: int = 32  # random prompts: tokens per prompt; the others: max prompt tokens
    new_tokens: int = 32
    batch_size: int = 1
    cache_len: Optional[int] = None  # default: enough for prompt + new tokens + one block
    repeats: int = 1  # timed repetitions per method (median reported)
    show_responses: int = 2  # replies printed as text after the table (targets with a tokenizer)
    # each row stops right after the target's end-of-sequence token (its tokenizer's; SmolLM2: <|im_end|>)
    stop_at_eos: bool = False


@dataclasses.dataclass
class DistributedConf:
    """Multi-host runs: `jax.distributed.initialize` before anything touches a device
    (`specpilot.harness.devices`). auto: let jax read the cluster's environment (SLURM, Open MPI, ...)."""

    enabled: bool = False
    auto: bool = False
    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[List[int]] = None


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
    compile_cache: bool = True  # jax's persistent compilation cache under cache_dir/xla
    # CPU only: run on this many simulated host devices (sharded plans on a machine without accelerators)
    simulated_cpu_devices: Optional[int] = None
    distributed: DistributedConf = dataclasses.field(default_factory=lambda: DistributedConf())


def register() -> None:
    cs = ConfigStore.instance()
    for group, node in (("target", TargetConf), ("drafter", DrafterConf), ("gpu", GpuConf),
                        ("decoding", DecodingConf), ("bench", BenchConf)):
        cs.store(group=group, name=f"{group}_schema", node=node)


def validate(cfg: DictConfig) -> None:
    """Raise ConfigValueError naming the key for impossible values (types are checked by Hydra)."""
    t, d, b, dec = cfg.target, cfg.drafter, cfg.bench, cfg.decoding
    if t.source not in TARGET_SOURCES:
        _fail("target.source", f"{t.source!r} is not one of {TARGET_SOURCES}")
    if cfg.get("simulated_cpu_devices") is not None and cfg.simulated_cpu_devices < 1:
        _fail("simulated_cpu_devices", f"must be >= 1, got {cfg.simulated_cpu_devices}")
    if t.source == "hf" and not t.path:
        _fail("target.path", "an hf target needs the path of a local checkpoint directory")
    if t.source == "hf" and not Path(str(t.path)).expanduser().is_dir():
        _fail("target.path", f"no checkpoint directory at {t.path}")
    if t.source == "gguf" and not (t.path and Path(str(t.path)).expanduser().is_file()):
        _fail("target.path", f"a gguf target needs the path of a local .gguf file; none at {t.path}")
    if t.source == "random" and not t.model:
        _fail("target.model", "a random target needs its shape (config.json fields)")
    if t.layout not in ("fused", "separate"):
        _fail("target.layout", f"{t.layout!r} is not fused or separate")
    for fmt, impl in cfg.gpu.matmul.items():
        _check_implementations(f"gpu.matmul.{fmt}", impl)
    for i, impl in enumerate(cfg.gpu.ar_baselines):
        _check_implementations(f"gpu.ar_baselines.{i}", impl)
    if t.init not in ("normal", "wide_margin"):
        _fail("target.init", f"{t.init!r} is not normal or wide_margin")
    if t.dtype not in ("bfloat16", "float32"):
        _fail("target.dtype", f"{t.dtype!r} is not bfloat16 or float32")
    if t.matmul_precision not in MATMUL_PRECISIONS:
        _fail("target.matmul_precision", f"{t.matmul_precision!r} is not null or one of {MATMUL_PRECISIONS[1:]}")
    if d.source not in DRAFTER_SOURCES:
        _fail("drafter.source", f"{d.source!r} is not one of {DRAFTER_SOURCES}")
    if d.block_size < 1:
        _fail("drafter.block_size", f"must be >= 1, got {d.block_size}")
    if d.num_layers < 1:
        _fail("drafter.num_layers", f"must be >= 1, got {d.num_layers}")
    if d.draft_vocab is None and d.draft_vocab_ids is not None:
        _fail("drafter.draft_vocab_ids", "names a ranking, but drafter.draft_vocab is null; set it, e.g. 8192")
    if d.draft_vocab is not None and d.draft_vocab < 1:
        _fail("drafter.draft_vocab", f"must be >= 1 (or null for the full vocabulary), got {d.draft_vocab}")
    if d.draft_vocab is not None and d.source in ("none", "oracle", "oracle_trace"):
        _fail("drafter.draft_vocab", f"a {d.source!r} drafter has no draft head to reduce (oracle drafters "
              "replay the target's tokens); set drafter.draft_vocab=null")
    if d.source == "embedded" and t.source != "embedded":
        _fail("drafter.source", "the embedded drafter belongs to the embedded target (target=embedded)")
    if b.prompts == "heldout" and t.source != "embedded":
        _fail("bench.prompts", "held-out prompts come from the embedded corpus and tokenizer; use "
              "target=embedded or bench.prompts=random")
    if d.source == "dflash" and not d.path:
        _fail("drafter.path", "a dflash drafter needs the path of a local checkpoint directory")
    if d.source == "packaged":
        if str(d.path) not in packaged_drafters():
            _fail("drafter.path", f"{d.path!r} is not a drafter shipped in {PACKAGED} (there: "
                  f"{', '.join(packaged_drafters()) or 'none'})")
    if d.source == "oracle" and d.acceptance is None and d.tau is None and not d.acceptance_trace:
        _fail("drafter.acceptance", "an oracle drafter needs an acceptance profile, a tau or a trace")
    if d.acceptance_trace and d.acceptance is not None:
        _fail("drafter.acceptance_trace", "give an acceptance profile or a trace, not both")
    if d.acceptance_trace:
        trace = Path(d.acceptance_trace).expanduser()
        if not (trace / "results.jsonl" if trace.is_dir() else trace).is_file():
            _fail("drafter.acceptance_trace", f"no results.jsonl at {trace}")
    if d.source == "oracle" and d.tau is not None and not d.acceptance_trace and not 1 <= d.tau <= d.block_size:
        _fail("drafter.tau", f"{d.tau} is impossible with block size {d.block_size}")
    if d.source == "oracle_trace":
        if not d.step_trace or not trace_path(d.step_trace).is_file():
            _fail("drafter.step_trace", f"an oracle_trace drafter needs a step trace file, got {d.step_trace!r}")
    if d.confidence_trace:
        config_files.check_confidence_trace(d)
    if d.source in ("oracle", "oracle_trace") and dec.temperature != 0:
        _fail("drafter.source", "oracle acceptance replays greedy continuations; use temperature 0")
    plans = build_plans(cfg)
    for plan in plans:
        key = f"decoding.plans.{plan.name}"
        for op in plan_mod.KERNEL_OPS:
            _check_implementations(f"{key}.kernels.{op}.implementation", getattr(plan.kernels, op).implementation,
                                   op=op, variants=True)
        if plan.uses_drafter and d.source == "oracle_trace":
            config_files.check_step_trace(plan, d.step_trace)
        if plan.uses_drafter and d.source == "none":
            _fail("drafter", f"plan {plan.name!r} ({plan.verify} verification) needs a drafter; choose one, "
                  "e.g. drafter=embedded")
        if plan.weights == "w12" and t.dtype != "bfloat16":
            _fail("target.dtype", f"plan {plan.name!r}: the 12-bit weight format encodes bfloat16 weights; "
                  "set target.dtype=bfloat16")
        if plan.kernels.matmul.implementation[0] == "mosaic" and t.dtype != "bfloat16":
            _fail("target.dtype", f"plan {plan.name!r}: the Mosaic GPU kernel multiplies bfloat16 weights; "
                  "set target.dtype=bfloat16")
        if plan.verify in plan_mod.TREE_KINDS and d.source != "none":
            if plan.tree.depth + 1 > d.block_size:
                _fail(f"{key}.tree.depth", f"a depth-{plan.tree.depth} tree needs a drafter block of "
                      f"{plan.tree.depth + 1}; drafter.block_size is {d.block_size}")
            if d.source == "oracle" and plan.tree.depth + 1 != d.block_size:
                _fail(f"{key}.tree.depth", f"an oracle drafter replays a profile for block size {d.block_size}; "
                      f"a tree over it takes depth {d.block_size - 1}, got {plan.tree.depth}")
        elif plan.uses_drafter and d.source == "oracle" and plan.block_size > d.block_size:
            # a smaller block verifies the profile's first drafts: the same drafter, fewer of its drafts
            _fail(f"{key}.block_size", f"an oracle drafter replays a profile for block size {d.block_size}; "
                  f"a chain plan verifies at most that block, got {plan.block_size} (or raise "
                  f"drafter.block_size)")
    if dec.temperature < 0 or not 0 < dec.top_p <= 1 or dec.top_k < 0:
        _fail("decoding", "temperature >= 0, top_k >= 0 and 0 < top_p <= 1 are required")
    for key in ("num_prompts", "prompt_len", "new_tokens", "batch_size", "repeats"):
        if b[key] < 1:
            _fail(f"bench.{key}", f"must be >= 1, got {b[key]}")
    if b.batch_size > b.num_prompts:
        _fail("bench.batch_size", f"{b.batch_size} is larger than the prompt set ({b.num_prompts})")
    if b.prompts not in PROMPT_SETS:
        _fail("bench.prompts", f"{b.prompts!r} is not one of {PROMPT_SETS}")
    config_files.check_text_prompts(t, b)
    config_files.check_stop(t, b)
    block = max(p.block_size for p in plans)
    needed = b.prompt_len + b.new_tokens + block
    if b.cache_len is not None and b.cache_len < needed:
        _fail("bench.cache_len", f"{b.cache_len} cannot hold prompt_len + new_tokens + the largest block size "
              f"= {needed}")
    shapes.check_drafter_fits(cfg)  # the drafter reads the target's states, embedding and head


def _check_implementations(key: str, impl, op: str = "matmul", variants: bool = False) -> None:
    """`variants`: kernel variants (`variant:<hash>`, the optimization loop's) may be named too (plans)."""
    impl = list(impl or [])
    if not impl:
        _fail(key, f"name at least one {op} implementation")
    known = tuple(dispatch.IMPLEMENTATIONS[op])
    for name in impl:
        if name not in known and not (variants and dispatch.is_variant(name)):
            _fail(key, f"{name!r} is not one of {known}" + (" or variant:<hash>" if variants else ""))


def plan_defaults(cfg: DictConfig) -> dict:
    """`plan_mod.build`'s keyword arguments for this deployment: the drafter's block size and the `gpu`
    group's default implementations."""
    d = cfg.drafter
    return {"drafter_block_size": int(d.block_size) if d.source != "none" else None,
            "default_matmul": {k: list(v) for k, v in cfg.gpu.matmul.items()},
            "default_gated_delta_rule": tuple(str(i) for i in cfg.gpu.gated_delta_rule),
            **{f"default_{op}": tuple(str(i) for i in cfg.gpu[op]) for op in DEFAULTED_OPS}}


def build_plans(cfg: DictConfig) -> list[Plan]:
    """The run's plans: the AR baseline candidates of the device first (`gpu.ar_baselines`, unless a plan
    of `decoding.plans` already is one; Mosaic candidates only for bf16 targets), then `decoding.plans` in
    order. Raises ConfigValueError naming
    the field of an impossible plan."""
    _check_implementations("gpu.gated_delta_rule", cfg.gpu.gated_delta_rule, op="gated_delta_rule")
    for op in DEFAULTED_OPS:
        _check_implementations(f"gpu.{op}", cfg.gpu[op], op=op)
    defaults = plan_defaults(cfg)
    gdr = defaults["default_gated_delta_rule"]
    op_defaults = {f"default_{op}": defaults[f"default_{op}"] for op in DEFAULTED_OPS}
    try:
        given = [plan_mod.build(str(name), OmegaConf.to_container(fields, resolve=True), **defaults)
                 for name, fields in cfg.decoding.plans.items()]
    except plan_mod.PlanError as e:
        raise ConfigValueError(str(e)) from None
    baselines = []
    names = {p.name for p in given}
    for impl in cfg.gpu.ar_baselines:
        impl = tuple(str(i) for i in impl)
        if impl[0] == "mosaic" and cfg.target.dtype != "bfloat16":
            continue  # the Mosaic kernel multiplies bf16 weights: no candidate for another dtype
        if any(plan_mod.is_ar_baseline_candidate(p) and p.mesh.is_single and p.kernels.matmul.implementation == impl
               and p.kernels.gated_delta_rule.implementation == gdr
               and p.kernels.attention.implementation == op_defaults["default_attention"]
               and p.kernels.residual_norm.implementation == op_defaults["default_residual_norm"]
               for p in given):  # the reference: one device, the default kernels (others are checked against it)
            continue
        name = "ar" if impl[0] == "xla" else f"ar_{impl[0]}"
        if name in names:
            _fail(f"decoding.plans.{name}", f"the name is the AR baseline's on this gpu ({list(impl)}); rename it")
        kernels = plan_mod.Kernels(dispatch.choice("matmul", impl), dispatch.choice("gated_delta_rule", gdr),
                                   **{op: dispatch.choice(op, op_defaults[f"default_{op}"])
                                      for op in DEFAULTED_OPS})
        baselines.append(plan_mod.Plan(name=name, verify="ar", kernels=kernels))
        names.add(name)
    plans = baselines + given
    if not any(plan_mod.is_ar_baseline_candidate(p) for p in plans):
        _fail("gpu.ar_baselines", "no bf16 ar plan to measure the AR baseline with")
    return plans


def typed(cfg: DictConfig) -> DictConfig:
    """Merge the composed config onto the top-level schema: a misspelled or mistyped key fails here, also
    one added with Hydra's `+` (which bypasses the group schemas)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as e:
        raise ConfigValueError(config_errors.from_omegaconf(e)) from None
    OmegaConf.set_struct(merged, True)
    return merged


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)
