"""Continuous batching: Poisson arrivals (throughput, TTFT, TPOT, KV in use) and fixed batches (steady-state
decode throughput, speedup over AR), for AR and speculative plans, through `specpilot.serving.Engine`.

    PYTHONPATH=. python experiments/bench/bench_engine.py [--shape smollm2|tiny] [--m 4] [--rates 0.5,2,8]
        [--requests 16] [--new-tokens 64] [--plans ar,stock] [--out engine.json]
        [--batching fixed,budget,budget+packed] [--token-budget N] [--overlap none,halves]
    PYTHONPATH=. python experiments/bench/bench_engine.py --deployment "<run.py overrides>" --plans ar,stock ...
    PYTHONPATH=. python experiments/bench/bench_engine.py --smoke     # tiny random pair, a few seconds

Where the target and drafter come from:
- `--deployment "<overrides>"`: the config groups of experiments/run.py, composed with Hydra (space
  separated, e.g. `experiment=stock_qwen3_8b_h200`, `target=qwen3_8b drafter=oracle gpu=h200 decoding=w12`).
  `--plans` names plans of that config (`ar`, `stock`, `ar_w12`, `stock_w12`, the gpu's AR baselines such as
  `ar_mosaic` on the H200, tree plans such as `tree_n16` of `decoding=tree`); each is built as
  `Engine.from_plan` builds it (its target, weights, kernels, drafter and tree shape; a tree plan runs only
  --batching fixed --overlap none). Prompts are the deployment's (`bench.prompts`, `bench.prompt_len`:
  random ids at a random-weight shape); `bench.num_prompts` is raised to the requests needed and
  `bench.batch_size` set to the smallest slot count. An oracle drafter (`drafter=oracle`: `drafter.tau`,
  `drafter.acceptance` or `drafter.acceptance_trace`) replays each request's reference: the prompt and the
  target's own greedy continuation, taken from the AR reference plan (the config's first AR baseline, run
  first at every slot count, added to --plans if missing) on the same requests (`Request.draft_reference`).
  Rows of such a run are oracle-acceptance results (the record's notes say so). `drafter=oracle_trace` does
  not run through the engine. Without --batching / --overlap a plan keeps its own `batching` fields; with
  them, each given value replaces the plan's draft budget, verification, token budget and overlap (policy
  kept).
- `--shape smollm2`: the real SmolLM2-135M-Instruct pair (target converted from its GGUF, the packaged block
  drafter at --block), chat prompts of at most --prompt-len tokens, each request stopping at the model's
  end-of-turn token or after --new-tokens. `--shape tiny` (and --smoke): a 2-layer random target with a
  random block drafter, random prompts.

--batching (speculative plans): `fixed` verifies every row's full block, `budget` chooses each row's draft
count per step from the drafter's confidence under --token-budget (mechanism 1; default half of slots x
block), `budget+packed` also packs only the kept candidates into the verify forward (mechanism 2).
--overlap: `halves` verifies one half of the slots per step while drafting the other in the same program
(mechanism 3; a step then verifies half the slots, so the default budget is half of slots/2 x block).
--step-cost model (--deployment): a budget over packed verification weighs expected accepted tokens against
the cost model's step time of the token count (`budget.StepCost.from_predict`, the gpu's calibrated rates)
instead of filling the token budget (padded verification computes the whole block either way).

Workloads, per slot count of --m and per (plan, batching, overlap), one engine compiled before any clock
starts (`Engine.warm_up`; its seconds are each row's `compile_s`, for budgeting device time):
- a rate > 0: --requests requests (budgets drawn in [1, --new-tokens]) arrive as a Poisson process at that
  many requests per second (wall clock, seeded) and the engine steps while any is in flight. TTFT counts
  from arrival, TPOT per request after its first token; throughput is output tokens over the time from
  the first arrival to the last token.
- rate 0 (`--rates 0`, or `0,2,8` beside Poisson rates): a fixed batch. As many requests as slots (the
  first `slots` prompts), each of exactly --new-tokens tokens and no stop token, are submitted at t=0. The
  steady state is the decode steps during which every slot decodes (no prefill, no row finished yet):
  `decode_tok_s` is the output tokens those steps emit over their time, `step_ms` a step's mean time,
  `tokens_per_step` the tokens one emits over the batch. `speedup` = the row's decode_tok_s over the
  fastest AR baseline plan's at the same slot count in the same run (DESIGN.md: AR baseline, speedup).
With --deployment, each AR baseline plan is also timed in the harness's own loop on the same fixed batch
(`<plan>_lockstep`: `ar.generate`, the whole decode in one jitted loop; --lockstep-ar off skips it), and
speedups are over the fastest AR row of the slot count, engine or lockstep.
Every row reports `mismatched_requests`: requests whose tokens differ from the AR reference's on the same
requests at the same slot count (0 is the lossless check; oracle acceptance must not change a token).
The JSON record (--out) is rewritten after every row, so a run cut short keeps what it measured.

Oracle drafters: `drafter=oracle` drafts one-hot, all equally confident, so `budget` (mechanism 1) has no
signal under it; `drafter=oracle_calibrated` draws each draft's confidence from a trained pair's recorded
ones (`specpilot.models.confidence_trace`).

H200, Qwen3-8B shape (random bf16 weights, oracle at GSM8K's tau 6.27, block 16, 512-token random prompts;
numbers and where the time goes: docs/performance.md). Each (plan, slot count, batching) is one engine
compiled first (~20-30 s); past the per-command limit, split --m over commands with one --compile-cache:

    PYTHONPATH=. python experiments/bench/bench_engine.py \\
        --deployment "experiment=stock_qwen3_8b_h200 drafter=oracle_calibrated" --plans ar,stock \\
        --m 16,32 --rates 0,4 --requests 32 --new-tokens 256 --batching fixed,budget,budget+packed \\
        --step-cost model --compile-cache /tmp/xla --out engine_8b_mechanisms.json
    ... --m 1,4,8,64 --rates 0                       # the fixed-batch sweep
    ... --overlap none,halves                        # mechanism 3 (even slot counts)
    ... --trace-top 12                               # the decode's top device kernels per fixed row
    ... --deployment "experiment=stock_qwen3_8b_h200 decoding=tree" --plans ar,tree_n16   # tree plans
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.harness import bench
from specpilot.serving import Engine, Request
from specpilot.serving.workloads import run_fixed, run_workload

DEFAULT_SMOLLM2_DIRS = ("~/.cache/specpilot/gguf", "/tmp/smolcache/gguf")
CONF = Path(__file__).resolve().parents[2] / "conf"


BATCHINGS = {"fixed": {}, "budget": {"draft_budget": "confidence"},
             "budget+packed": {"draft_budget": "confidence", "verify": "packed"}}


def batching_for(name: str, slots: int, block: int, token_budget: int, overlap: str = "none"):
    """The plan.Batching of a --batching name and --overlap value (budgeted ones at token_budget, default
    rows x block / 2 over the rows one step verifies: the slots, or half of them under halves)."""
    from specpilot.plan import Batching

    fields = BATCHINGS[name]
    if not fields:
        return Batching(overlap=overlap)
    rows = slots // 2 if overlap == "halves" else slots
    return Batching(**fields, token_budget=token_budget or max(2 * rows, rows * block // 2), overlap=overlap)


def batching_label(b) -> str:
    """A Batching as --batching names it (+halves, /static where they apply); None (AR): fixed."""
    if b is None:
        return "fixed"
    name = {("fixed", "padded"): "fixed", ("confidence", "padded"): "budget",
            ("confidence", "packed"): "budget+packed"}.get((b.draft_budget, b.verify), f"{b.draft_budget}+{b.verify}")
    return name + ("+halves" if b.overlap == "halves" else "") + ("/static" if b.policy == "static" else "")


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
    from specpilot.models import dense
    from specpilot.models import drafter as dr
    from specpilot.models.config import ModelConfig

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
    from specpilot.data import prompt_sets
    from specpilot.models import dense
    from specpilot.models import drafter as dr
    from specpilot.models.checkpoint import load_hf

    params, cfg = load_hf(folder, dtype=jnp.float32)
    dparams, dcfg = dr.load_drafter(dr.PACKAGED / "smollm2-135m-instruct-dflash-b8", dtype=jnp.float32)
    dcfg = dataclasses.replace(dcfg, block_size=block)
    cfg = cfg.with_taps(dcfg.tap_layers)
    prompts, _ = prompt_sets.build("chat", prompt_sets.load_model_text(folder), num, prompt_len)
    return (dense.target(cfg, jnp.float32), params, dr.BlockDrafter(dcfg, cfg), dparams, prompts,
            prompt_sets.eos_token_id(folder))


def context_for(prompts, new_tokens: int) -> int:
    return -(-(max(len(p) for p in prompts) + new_tokens) // 64) * 64


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
    return Setup(args.shape, runs, prompts, poisson, context_for(prompts, args.new_tokens))


def compose_config(overrides: str, n_prompts: int, batch: int):
    """run.py's config with `overrides` (space separated), bench.num_prompts >= n_prompts, typed and
    validated; a bad override or value raises ValueError naming it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from specpilot.harness import config_schema

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
    from specpilot.serving.budget import StepCost

    batching = batching or plan.batching
    cost = None
    if cost_setting is not None and batching.draft_budget == "confidence" and batching.verify == "packed":
        rows = slots // 2 if batching.overlap == "halves" else slots
        cost = StepCost.from_predict(plan, cost_setting, rows)
    return Engine.from_plan(dep, plan, slots=slots, context_len=context_len, prefill_chunk=prefill_chunk,
                            sampling=False, batching=batching, step_cost=cost)


def deployment_setup(args, n_prompts: int) -> Setup:
    """--deployment: run.py's config groups; --plans names the config's plans (the AR reference first)."""
    from specpilot import plan as plan_mod
    from specpilot.harness import config_schema, deploy, devices

    for flag, value in (("--prompt-len", args.prompt_len), ("--block", args.block), ("--model-dir", args.model_dir)):
        if value:
            raise ValueError(f"{flag} belongs to --shape; with --deployment set it in the config "
                             f"(bench.prompt_len, drafter.block_size, target.path)")
    cfg = compose_config(args.deployment, n_prompts, min(args.m))
    if cfg.drafter.source == "oracle_trace":
        raise ValueError("drafter=oracle_trace: its per-plan step traces do not run through the engine; use "
                         "drafter=oracle (drafter.tau, drafter.acceptance or drafter.acceptance_trace)")
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
    oracle = cfg.drafter.source == "oracle" and any(by_name[n].uses_drafter for n in wanted)
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
        from specpilot.costmodel import prediction

        cost_setting = prediction.Setting.from_deployment(dep, cfg.gpu)
    runs = [PlanRun(p.name, lambda s, b, c, ch, p=p: deployment_engine(dep, p, s, b, c, ch, cost_setting),
                    block=p.block_size,
                    ar_baseline=plan_mod.is_ar_baseline_candidate(p), replays=oracle and p.uses_drafter,
                    batching=p.batching, tree=p.verify == "tree",
                    lockstep=((dep.target_for(p), dep.params_for(p)) if args.lockstep_ar == "on"
                              and plan_mod.is_ar_baseline_candidate(p) and p.mesh.is_single else None))
            for p in selected]
    prompts = [list(p) for p in dep.prompts]
    poisson = random_budgets(prompts[: args.requests], args.new_tokens, args.seed, dep.stop_token)
    context = context_for(prompts, args.new_tokens)
    if context > dep.cfg.max_position_embeddings:
        raise ValueError(f"prompts of up to {max(map(len, prompts))} tokens + --new-tokens {args.new_tokens} need "
                         f"{context} positions, past the target's max_position_embeddings "
                         f"({dep.cfg.max_position_embeddings})")
    return Setup(args.deployment, runs, prompts, poisson, context, list(dep.notes), has_own_batching=True)


def batchings(setup: Setup, run: PlanRun, args, slots: int) -> list:
    """The plan.Batching values to run `run` with at `slots` (None: the engine's default, AR)."""
    if not run.speculative:
        return [None]
    if setup.has_own_batching and args.batching is None and args.overlap is None:
        return [run.batching]
    out = []
    for name in bench.comma_list(args.batching or "fixed"):
        for overlap in bench.comma_list(args.overlap or "none"):
            b = batching_for(name, slots, run.block, args.token_budget, overlap)
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
                if b is not None and b.overlap == "halves" and (slots < 2 or slots % 2):
                    raise ValueError(f"--m {slots} with --overlap halves: halves splits the slots in two equal "
                                     f"halves; give even slot counts")


def lockstep_ar_row(run: PlanRun, requests: list[Request], context: int) -> tuple[dict, list[list[int]]]:
    """The AR plan's harness loop over a fixed batch (`ar.generate`: every decode step of the batch inside
    one jitted loop, no host work between steps), compiled by a first call and timed by a second -> (a
    fixed-batch row named `<plan>_lockstep`, each request's tokens). An AR baseline beside the engine's
    AR: speedups are taken over the faster (DESIGN.md, AR baseline)."""
    from specpilot.decoding import ar

    target, params = run.lockstep
    prompts = [r.prompt_ids for r in requests]
    new = requests[0].max_new_tokens
    t0 = time.perf_counter()
    ar.generate(target, params, prompts, new, cache_len=context)
    compile_s = time.perf_counter() - t0
    res = ar.generate(target, params, prompts, new, cache_len=context)
    slots, steps = len(prompts), res.decode_steps
    row = {"plan": f"{run.name}_lockstep", "speculative": False, "ar_baseline": True, "batching": "lockstep",
           "overlap": "none", "slots": slots, "compile_s": compile_s, "token_budget": slots, "rate": 0.0,
           "requests": slots, "output_tokens": int(res.tokens.size), "total_s": res.prefill_s + res.decode_s,
           "prefill_s": res.prefill_s, "decode_steps": steps, "decode_s": res.decode_s,
           "decode_tok_s": slots * steps / res.decode_s, "step_ms": 1e3 * res.decode_s / steps,
           "tokens_per_step": float(slots), "ms_per_token": 1e3 * res.decode_s / (slots * steps),
           "tokens_per_row_step": 1.0, "tokens_per_decode": float(slots), "verify_tokens_per_decode": float(slots),
           "forward_tokens_per_decode": float(slots), "steps": steps}
    return row, res.as_lists()


def trace_decode(engine: Engine, calls: int, top: int) -> dict | None:
    """`engine.device_step_ms(calls)` under the JAX profiler -> the device kernels per decode call
    (`bench.kernel_summary`: busy time, categories, the `top` kernels; None where the device has no
    kernel trace, as on a CPU). The calls commit nothing, so the engine is left as it was."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            engine.device_step_ms(calls)
            jax.effects_barrier()
        return bench.kernel_summary(d, calls + 1, top=top)  # device_step_ms runs one call before its clock


def print_kernels(row: dict) -> None:
    k = row.get("kernels")
    if not k or "top" not in k:
        return
    cats = ", ".join(f"{c} {ms:.2f}" for c, ms in k["category_ms_per_step"].items())
    print(f"    device busy {k['busy_ms_per_step']:.2f} ms per decode call, {k['kernels_per_step']:.0f} kernels; {cats}")
    for t in k["top"]:
        print(f"    {t['ms_per_step']:7.3f} ms {t['calls_per_step']:6.1f}x {t['us_median']:8.1f} us  {t['name'][:90]}")


def with_reference(requests: list[Request], tokens: list[list[int]]) -> list[Request]:
    return [dataclasses.replace(r, draft_reference=list(r.prompt_ids) + list(t)) for r, t in zip(requests, tokens)]


def add_speedups(rows: list[dict]) -> None:
    """Fixed-batch rows: speedup = decode_tok_s over the fastest AR baseline's at the same slot count."""
    fixed = [r for r in rows if r["rate"] == 0]
    for r in fixed:
        base = [b for b in fixed if b["ar_baseline"] and b["slots"] == r["slots"]
                and b["decode_tok_s"] == b["decode_tok_s"]]
        if base:
            best = max(base, key=lambda b: b["decode_tok_s"])
            r["speedup"], r["baseline"] = r["decode_tok_s"] / best["decode_tok_s"], best["plan"]


HEAD = f"{'plan':>30} {'slots':>5} {'rate':>6} {'diff':>4} {'tau':>5} {'tok/dec':>7} {'ver/dec':>7} {'fwd/dec':>7}"


def print_row(row: dict) -> None:
    label = row["plan"] + ("/" + row["batching"] if row["speculative"] else "")
    common = (f"{label:>30} {row['slots']:>5} {row['rate']:>6.2f} {str(row['mismatched_requests']):>4} "
              f"{row['tokens_per_row_step']:>5.2f} {row['tokens_per_decode']:>7.2f} "
              f"{row['verify_tokens_per_decode']:>7.2f} {row['forward_tokens_per_decode']:>7.1f}")
    if row["rate"] == 0:
        print(f"{common}   fixed: {row['decode_tok_s']:.1f} tok/s, {row['step_ms']:.2f} ms/step "
              f"(device {row.get('device_step_ms', float('nan')):.2f}), "
              f"{row['tokens_per_step']:.2f} tok/step over {row['decode_steps']} steps, prefill "
              f"{row['prefill_s']:.2f} s, compile {row['compile_s']:.1f} s", flush=True)
    else:
        print(f"{common}   {row['throughput_tok_s']:.1f} tok/s, ttft {row['ttft_p50_s']:.3f}/{row['ttft_p99_s']:.3f} s,"
              f" tpot {row['tpot_p50_s']:.4f}/{row['tpot_p99_s']:.4f} s, slots {row['slots_in_use_mean']:.2f}, kv max "
              f"{row['kv_tokens_max']}, rows V/D {row['rows_verified_per_decode']:.2f}/"
              f"{row['rows_drafted_per_decode']:.2f}, both {row['both_halves_busy_fraction']:.2f}, compile "
              f"{row['compile_s']:.1f} s", flush=True)


def print_fixed_summary(rows: list[dict]) -> None:
    fixed = [r for r in rows if r["rate"] == 0]
    if not fixed:
        return
    print(f"\nfixed batches (steady-state decode; speedup over the fastest AR baseline at the same slots)\n"
          f"{'plan':>30} {'slots':>5} {'tok/s':>9} {'ms/step':>8} {'device':>7} {'tok/step':>8} {'ms/tok':>7} "
          f"{'speedup':>7} {'diff':>4}")
    for r in fixed:
        label = r["plan"] + ("/" + r["batching"] if r["speculative"] else "")
        print(f"{label:>30} {r['slots']:>5} {r['decode_tok_s']:>9.1f} {r['step_ms']:>8.2f} "
              f"{r.get('device_step_ms', float('nan')):>7.2f} {r['tokens_per_step']:>8.2f} {r['ms_per_token']:>7.3f} "
              f"{r.get('speedup', float('nan')):>7.2f} "
              f"{str(r['mismatched_requests']):>4}")


def parse_args(argv=None):
    """-> (parsed and checked arguments, the parser); bad values exit naming the flag."""
    ap = bench.common_parser(__doc__.split("\n")[0], shape_default="smollm2", shape_help="smollm2 or tiny",
                             m_default="4", m_help="comma list of engine slot counts", trials_default=1,
                             kernel_default="xla")
    ap.add_argument("--deployment", default="", help="run.py's config overrides, space separated "
                    "(e.g. 'experiment=stock_qwen3_8b_h200'); replaces --shape")
    ap.add_argument("--rates", default="0.5,2,8", help="comma list of arrival rates (requests per second); "
                    "0: a fixed batch of one request per slot")
    ap.add_argument("--requests", type=int, default=16, help="requests of each Poisson workload")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=0, help="the longest prompt (tokens; --shape only)")
    ap.add_argument("--plans", default="ar,stock", help="comma list of plan names (--shape: ar, stock)")
    ap.add_argument("--block", type=int, default=0, help="stock's block size (--shape only; default 8, tiny 4)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (prompt tokens per row per step)")
    ap.add_argument("--model-dir", default="", help="the converted SmolLM2 folder (default: found in the cache)")
    ap.add_argument("--batching", default=None, help=f"comma list of {', '.join(BATCHINGS)} (speculative plans; "
                    f"default fixed, or a --deployment plan's own batching)")
    ap.add_argument("--overlap", default=None, help="comma list of none, halves (speculative plans)")
    ap.add_argument("--token-budget", type=int, default=0, help="verification tokens per step (0: slots x block / 2)")
    ap.add_argument("--step-cost", default="flat", choices=("flat", "model"), help="what a confidence budget "
                    "takes a step's time to be: flat (fill the token budget) or model (the cost model's step time "
                    "of a token count, from the gpu's rates; --deployment only)")
    ap.add_argument("--compile-cache", default="", help="jax's persistent compilation cache folder")
    ap.add_argument("--device-calls", type=int, default=20, help="fixed batches: decode calls timed back to back "
                    "after the run (device_step_ms; host_step_ms is the rest of a step), 0: off")
    ap.add_argument("--trace-top", type=int, default=0, help="fixed batches: run the --device-calls decode calls "
                    "under the JAX profiler and keep the N kernels that take the most device time per step (0: off)")
    ap.add_argument("--lockstep-ar", default="on", choices=("on", "off"), help="--deployment, fixed batches: "
                    "also time each AR baseline plan in the harness's loop (ar.generate) on the same batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny random pair, 6 requests: a few seconds")
    args = bench.parse_common(ap, argv)
    if args.smoke:
        args.deployment, args.shape, args.requests, args.new_tokens, args.prompt_len = "", "tiny", 6, 8, 12
        args.rates, args.m, args.block, args.chunk = "0,200", [2], 4, 8
    try:
        args.rates = bench.comma_list(args.rates, float)
    except ValueError:
        ap.error(f"--rates takes a comma list of numbers, got {args.rates!r}")
    for flag, value, allowed in (("--batching", args.batching, BATCHINGS),
                                 ("--overlap", args.overlap, ("none", "halves"))):
        if value is not None and (not bench.comma_list(value) or set(bench.comma_list(value)) - set(allowed)):
            ap.error(f"{flag} takes a comma list of {', '.join(allowed)}, got {value!r}")
    if not args.rates or min(args.rates) < 0:
        ap.error(f"--rates takes request rates >= 0 (0: a fixed batch), got {args.rates}")
    if args.requests < 1 or args.chunk < 1 or args.new_tokens < 1 or args.device_calls < 0 or args.trace_top < 0:
        ap.error("--requests, --chunk and --new-tokens must be >= 1, --device-calls and --trace-top >= 0")
    if args.trace_top and not args.device_calls:
        ap.error("--trace-top traces the --device-calls decode calls: give --device-calls >= 1")
    if 0.0 in args.rates and args.new_tokens < 2:
        ap.error("--rates 0 measures decode steps: --new-tokens must be >= 2 (the first token comes from prefill)")
    if args.step_cost == "model" and not args.deployment:
        ap.error("--step-cost model prices a --deployment's plans (the cost model needs its gpu's rates)")
    if not args.deployment and args.shape not in ("tiny", "smollm2"):
        ap.error(f"--shape takes smollm2 or tiny, got {args.shape!r}")
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return args, ap


def build_setup(args, ap=None) -> Setup:
    """The plans, prompts and requests of `args`; a bad value exits naming it (raises ValueError without `ap`)."""
    n_prompts = max([args.requests] + (args.m if 0.0 in args.rates else []))
    try:
        setup = deployment_setup(args, n_prompts) if args.deployment else shape_setup(args, n_prompts)
        check_grid(setup, args)
    except (ValueError, NotImplementedError) as e:
        if ap is None:
            raise
        ap.error(str(e))
    return setup


def main(argv=None):
    args, ap = parse_args(argv)
    setup = build_setup(args, ap)
    print(f"device {jax.devices()[0]}, jax {jax.__version__}, {setup.label}, plans "
          f"{', '.join(p.name for p in setup.plans)}, <= {args.new_tokens} new tokens, context {setup.context}")
    for note in setup.notes:
        print(f"  note: {note}")
    print(HEAD)
    rows = []
    record = {"setup": setup.label, "shape": "deployment" if args.deployment else args.shape, "jax": jax.__version__,
              "device": str(jax.devices()[0]), "new_tokens": args.new_tokens, "context": setup.context,
              "chunk": args.chunk, "block": max(p.block for p in setup.plans), "notes": setup.notes, "rows": rows}
    reference = setup.reference
    for slots in args.m:
        fixed = [Request(p, args.new_tokens) for p in setup.prompts[:slots]]
        want = {}  # workload -> the reference plan's tokens per request, at this slot count
        for run in setup.plans:
            for batching in batchings(setup, run, args, slots):
                engine = run.make(slots, batching, setup.context, args.chunk)
                t0 = time.perf_counter()
                engine.warm_up()
                compile_s = time.perf_counter() - t0
                for i, rate in enumerate(args.rates):
                    workload = "fixed" if rate == 0 else "poisson"
                    requests = fixed if rate == 0 else setup.poisson
                    if run.replays:
                        requests = with_reference(requests, want[workload])
                    engine.stats = type(engine.stats)()
                    row, handles = (run_fixed(engine, requests, args.device_calls) if rate == 0
                                    else run_workload(engine, requests, rate, args.seed + i))
                    if rate == 0 and args.trace_top:
                        row["kernels"] = trace_decode(engine, args.device_calls, args.trace_top)
                    tokens = [h.tokens for h in handles]
                    if run is reference:
                        want.setdefault(workload, tokens)
                    diff = sum(a != b for a, b in zip(tokens, want[workload])) if workload in want else None
                    row = {"plan": run.name, "speculative": run.speculative, "ar_baseline": run.ar_baseline,
                           "batching": batching_label(batching), "overlap": getattr(batching, "overlap", "none"),
                           "slots": slots, "compile_s": compile_s, "token_budget": engine.setup.token_budget,
                           "mismatched_requests": diff, **row}
                    rows.append(row)
                    print_row(row)
                    print_kernels(row)
                    add_speedups(rows)
                    if args.out:
                        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
                del engine  # its slot state (K/V of every slot) goes before the next engine's
            if run.lockstep is not None and 0.0 in args.rates:
                row, tokens = lockstep_ar_row(run, fixed, setup.context)
                diff = sum(a != b for a, b in zip(tokens, want["fixed"])) if "fixed" in want else None
                rows.append({**row, "mismatched_requests": diff})
                print_row(rows[-1])
                add_speedups(rows)
                if args.out:
                    Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print_fixed_summary(rows)
    return record


if __name__ == "__main__":
    main()
