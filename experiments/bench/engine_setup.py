"""What the engine benchmark runs (`bench_engine.py`): its plans, each with the engine it builds at a slot
count and batching, the prompts and the requests of its workloads, from a --shape pair built here or a
--deployment composed from run.py's config groups.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import open_dict
from omegaconf.errors import OmegaConfBaseException

from specpilot.costmodel import prediction
from specpilot.data import prompt_sets
from specpilot.harness import bench, config_schema, deploy, devices
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.models.config import ModelConfig
from specpilot.plan import Batching, is_ar_baseline_candidate
from specpilot.training.locate import DEFAULT_DRAFTER
from specpilot.serving import Engine, Request
from specpilot.serving.budget import StepCost

DEFAULT_SMOLLM2_DIRS = ("~/.cache/specpilot/gguf", "/tmp/smolcache/gguf")
CONF = Path(__file__).resolve().parents[2] / "conf"
BATCHINGS = {"fixed": {}, "budget": {"draft_budget": "confidence"},
             "budget+packed": {"draft_budget": "confidence", "verify": "packed"}}


def batching_for(name: str, slots: int, block: int, token_budget: int, overlap: str = "none", streams: int = 1,
                 pricing: str = "flat"):
    """The plan.Batching of a --batching name and --overlap value (budgeted ones at token_budget, default
    rows x block / 2 over the rows one step verifies: the slots, or half of them under halves; packed ones
    with `streams` stream sizes and `pricing`)."""
    fields = dict(BATCHINGS[name])
    if not fields:
        return Batching(overlap=overlap)
    rows = slots // 2 if overlap == "halves" else slots
    if fields.get("verify") == "packed":
        fields.update(streams=streams, pricing=pricing)
    return Batching(**fields, token_budget=token_budget or max(2 * rows, rows * block // 2), overlap=overlap)


def batching_label(b) -> str:
    """A Batching as --batching names it (+halves, /static, /paged where they apply); None (AR): fixed."""
    if b is None:
        return "fixed"
    name = {("fixed", "padded"): "fixed", ("confidence", "padded"): "budget",
            ("confidence", "packed"): "budget+packed"}.get((b.draft_budget, b.verify), f"{b.draft_budget}+{b.verify}")
    return (name + ("+halves" if b.overlap == "halves" else "") + ("/static" if b.policy == "static" else "")
            + ("/paged" if b.kv == "paged" else ""))


@dataclasses.dataclass
class PlanRun:
    """One plan of the bench: `make(slots, batching or None, context_len, prefill_chunk)` builds its engine."""

    name: str
    make: Callable[..., Engine]
    block: int = 1  # 1: AR
    ar_baseline: bool = False  # one of the AR baselines speedups are measured against (the fastest)
    replays: bool = False  # an oracle drafter: requests carry the AR reference's continuation
    batching: object = None  # the plan's own plan.Batching (deployment plans)
    lockstep: tuple | None = None  # (target, params) of an AR plan also timed in the harness's loop
    tree: bool = False  # a tree plan: the chain-only mechanisms (--batching budget*, --overlap halves) refused

    @property
    def speculative(self) -> bool:
        return self.block > 1


@dataclasses.dataclass
class Setup:
    label: str
    plans: list[PlanRun]  # the reference first, where there is one
    prompts: list[list[int]]
    poisson: list[Request]  # the Poisson workload's requests
    context: int
    notes: list[str] = dataclasses.field(default_factory=list)
    has_own_batching: bool = False  # deployment plans keep their batching unless --batching / --overlap

    @property
    def reference(self) -> PlanRun | None:
        """The AR plan whose tokens every plan is checked against (and an oracle drafter replays)."""
        return self.plans[0] if self.plans[0].ar_baseline else None


def tiny_pair(block: int):
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
    params = dense.init(jax.random.key(0), cfg, dtype=jnp.float32, std=0.5)
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=block)
    return dense.target(cfg, jnp.float32), params, dr.BlockDrafter(dcfg, cfg), dr.init(jax.random.key(1), dcfg,
                                                                                       jnp.float32)


def random_budgets(prompts, new_tokens: int, seed: int, stop=None) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(p, int(rng.integers(1, new_tokens + 1)), stop_token=stop) for p in prompts]


def smollm2_folder(given: str) -> Path:
    if given:
        return Path(given).expanduser()
    for root in DEFAULT_SMOLLM2_DIRS:
        found = sorted(Path(root).expanduser().glob("SmolLM2-135M-Instruct*/config.json"))
        if found:
            return found[0].parent
    raise SystemExit(f"no converted SmolLM2 folder under {DEFAULT_SMOLLM2_DIRS}; run experiments/run.py "
                     f"target=smollm2 once, or pass --model-dir")


def smollm2_pair(folder: Path, block: int, num: int, prompt_len: int):
    params, cfg = load_hf(folder, dtype=jnp.float32)
    dparams, dcfg = dr.load_drafter(dr.PACKAGED / DEFAULT_DRAFTER, dtype=jnp.float32)
    trained, dcfg = dcfg.block_size, dataclasses.replace(dcfg, block_size=block)
    cfg = cfg.with_taps(dcfg.tap_layers)
    prompts, _ = prompt_sets.build("chat", prompt_sets.load_model_text(folder), num, prompt_len)
    return (dense.target(cfg, jnp.float32), params, dr.BlockDrafter(dcfg, cfg, draft_width=trained), dparams, prompts,
            prompt_sets.eos_token_id(folder))


def context_for(prompts, new_tokens: int, asked: int = 0) -> int:
    """Positions per slot: `asked` (--context), which must hold the longest prompt and `new_tokens`; 0: that
    length rounded up to 64."""
    need = max(len(p) for p in prompts) + new_tokens
    if asked and asked < need:
        raise ValueError(f"--context {asked} is shorter than the longest prompt ({max(map(len, prompts))} tokens) "
                         f"plus --new-tokens {new_tokens}: give at least {need}")
    return asked or -(-need // 64) * 64


def shape_setup(args, n_prompts: int) -> Setup:
    """--shape tiny | smollm2: the pair built here, plans ar and stock (at --block)."""
    wanted = bench.comma_list(args.plans)
    if not wanted or set(wanted) - {"ar", "stock"}:
        raise ValueError(f"--plans takes ar and/or stock with --shape {args.shape}, got {args.plans!r}")
    block = args.block or (4 if args.shape == "tiny" else 8)
    prompt_len = args.prompt_len or (12 if args.shape == "tiny" else 192)
    if args.shape == "tiny":
        target, params, drafter, dparams = tiny_pair(block)
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(0, target.vocab_size, rng.integers(1, prompt_len + 1)).tolist()
                   for _ in range(n_prompts)]
        stop = None
    else:
        target, params, drafter, dparams, prompts, stop = smollm2_pair(
            smollm2_folder(args.model_dir), block, n_prompts, prompt_len)

    def make(d, dp, bs):
        return lambda slots, batching, context_len, prefill_chunk: Engine(
            target, params, d, dp, block_size=bs, slots=slots, context_len=context_len,
            prefill_chunk=prefill_chunk, sampling=False, batching=batching)

    plans = {"ar": PlanRun("ar", make(None, None, None), ar_baseline=True),
             "stock": PlanRun("stock", make(drafter, dparams, block), block=block)}
    if "ar" not in wanted and 0.0 in args.rates:  # fixed batches report speedups over AR
        wanted = ["ar"] + wanted
    runs = [plans["ar"]] * ("ar" in wanted) + [plans[p] for p in wanted if p != "ar"]
    poisson = (random_budgets(prompts[: args.requests], args.new_tokens, args.seed) if args.shape == "tiny"
               else [Request(p, args.new_tokens, stop_token=stop) for p in prompts[: args.requests]])
    context = context_for(prompts, args.new_tokens, getattr(args, "context", 0))
    return Setup(args.shape, runs, prompts, poisson, context)


def compose_config(overrides: str, n_prompts: int, batch: int):
    """run.py's config with `overrides` (space separated), bench.num_prompts >= n_prompts, typed and
    validated; a bad override or value raises ValueError naming it."""
    config_schema.register()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = compose(config_name="config", overrides=shlex.split(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        why = " ".join(f"{e} {e.__cause__ or ''}".split())
        raise ValueError(f"--deployment {overrides!r}: {why}") from None
    with open_dict(cfg):
        cfg.bench.num_prompts = max(int(cfg.bench.num_prompts), n_prompts, batch)
        cfg.bench.batch_size = batch
    cfg = config_schema.typed(cfg)
    config_schema.validate(cfg)
    return cfg


def deployment_engine(dep, plan, slots: int, batching, context_len: int, prefill_chunk: int,
                      cost_setting=None) -> Engine:
    """`Engine.from_plan(dep, plan, ...)` with the bench's engine settings (greedy). With `cost_setting` (a
    `prediction.Setting`), a confidence budget over packed verification prices its token counts by the cost
    model's step time at the rows one step verifies (`budget.StepCost.from_predict`); padded verification
    computes every row's whole block whatever it keeps, so its step cost stays flat, as without."""
    batching = batching or plan.batching
    cost = None
    if cost_setting is not None and batching.draft_budget == "confidence" and batching.verify == "packed":
        rows = slots // 2 if batching.overlap == "halves" else slots
        cost = StepCost.from_predict(plan, cost_setting, rows)
    return Engine.from_plan(dep, plan, slots=slots, context_len=context_len, prefill_chunk=prefill_chunk,
                            sampling=False, batching=batching, step_cost=cost)


def deployment_setup(args, n_prompts: int) -> Setup:
    """--deployment: run.py's config groups; --plans names the config's plans (the AR reference first)."""
    for flag, value in (("--prompt-len", args.prompt_len), ("--block", args.block), ("--model-dir", args.model_dir)):
        if value:
            raise ValueError(f"{flag} belongs to --shape; with --deployment set it in the config "
                             f"(bench.prompt_len, drafter.block_size, target.path)")
    cfg = compose_config(args.deployment, n_prompts, min(args.m))
    devices.setup(cfg)
    plans = config_schema.build_plans(cfg)
    by_name = {p.name: p for p in plans}
    wanted = bench.comma_list(args.plans)
    unknown = [n for n in wanted if n not in by_name]
    if not wanted or unknown:
        raise ValueError(f"--plans: {', '.join(unknown) or repr(args.plans)} not a plan of this config "
                         f"(decoding={cfg.decoding.name}: {', '.join(by_name)})")
    for name in wanted:
        if by_name[name].verify not in ("ar", "chain", "tree"):
            raise ValueError(f"--plans: {name!r} is a {by_name[name].verify} plan; the engine runs ar, chain and "
                             f"tree plans")
    reference = plans[0]  # the run harness's reference: the device's first AR baseline candidate
    oracle = cfg.drafter.source in ("oracle", "oracle_trace") and any(by_name[n].uses_drafter for n in wanted)
    if reference.name not in wanted and (oracle or 0.0 in args.rates):
        wanted = [reference.name] + wanted
    selected = [reference] * (reference.name in wanted) + [by_name[n] for n in wanted if n != reference.name]
    for p in selected:
        for m in args.m:
            if m % p.mesh.data:
                raise ValueError(f"--m: {m} slots do not divide over decoding.plans.{p.name}.mesh.data={p.mesh.data}")
    dep = deploy.build(cfg, selected)
    cost_setting = None
    if args.step_cost == "model":
        cost_setting = prediction.Setting.from_deployment(dep, cfg.gpu)
    runs = [PlanRun(p.name, lambda s, b, c, ch, p=p: deployment_engine(dep, p, s, b, c, ch, cost_setting),
                    block=p.block_size,
                    ar_baseline=is_ar_baseline_candidate(p), replays=oracle and p.uses_drafter,
                    batching=p.batching, tree=p.verify == "tree",
                    lockstep=((dep.target_for(p), dep.params_for(p)) if args.lockstep_ar == "on"
                              and is_ar_baseline_candidate(p) and p.mesh.is_single else None))
            for p in selected]
    prompts = [list(p) for p in dep.prompts]
    poisson = random_budgets(prompts[: args.requests], args.new_tokens, args.seed, dep.stop_token)
    context = context_for(prompts, args.new_tokens, getattr(args, "context", 0))
    if context > dep.cfg.max_position_embeddings:
        raise ValueError(f"prompts of up to {max(map(len, prompts))} tokens + --new-tokens {args.new_tokens} need "
                         f"{context} positions, past the target's max_position_embeddings "
                         f"({dep.cfg.max_position_embeddings})")
    return Setup(args.deployment, runs, prompts, poisson, context, list(dep.notes), has_own_batching=True)


def batchings(setup: Setup, run: PlanRun, args, slots: int) -> list:
    """The plan.Batching values to run `run` with at `slots` (None: the engine's default, AR), each with
    every K/V layout of --kv."""
    layouts = bench.comma_list(getattr(args, "kv", None) or "")
    if not layouts:
        return _mechanisms(setup, run, args, slots)
    pages = {"page_size": args.page_size, "pages": args.pages or None}
    return [dataclasses.replace(b or run.batching or Batching(), kv=kv, **(pages if kv == "paged" else {}))
            for b in _mechanisms(setup, run, args, slots) for kv in layouts]


def _mechanisms(setup: Setup, run: PlanRun, args, slots: int) -> list:
    if not run.speculative:
        return [None]
    if setup.has_own_batching and args.batching is None and args.overlap is None:
        return [run.batching]
    out = []
    for name in bench.comma_list(args.batching or "fixed"):
        for overlap in bench.comma_list(args.overlap or "none"):
            b = batching_for(name, slots, run.block, args.token_budget, overlap, getattr(args, "streams", 1),
                             "measured" if getattr(args, "step_cost", "flat") == "measured" else "flat")
            out.append(dataclasses.replace(b, policy=run.batching.policy) if run.batching is not None else b)
    return out


def check_grid(setup: Setup, args) -> None:
    """Slot counts the mechanisms cannot split, before anything compiles."""
    for slots in args.m:
        for run in setup.plans:
            for b in batchings(setup, run, args, slots):
                if b is not None and run.tree and (b.draft_budget, b.verify, b.overlap) != ("fixed", "padded", "none"):
                    raise ValueError(f"--plans {run.name} is a tree plan: --batching {batching_label(b)} is "
                                     f"chain-only; give --batching fixed --overlap none")
                if b is not None and b.kv == "paged" and (run.tree or (b.verify, b.overlap) != ("padded", "none")):
                    raise ValueError(f"--kv paged runs ar and chain plans with padded verification and no halves; "
                                     f"--plans {run.name} with --batching {batching_label(b)} needs --kv contiguous")
                if b is not None and b.overlap == "halves" and (slots < 2 or slots % 2):
                    raise ValueError(f"--m {slots} with --overlap halves: halves splits the slots in two equal "
                                     f"halves; give even slot counts")


def with_reference(requests: list[Request], tokens: list[list[int]]) -> list[Request]:
    return [dataclasses.replace(r, draft_reference=list(r.prompt_ids) + list(t)) for r, t in zip(requests, tokens)]
