"""AR decode benchmark: time per token, tokens/s and achieved bandwidth vs the bytes a step must read.

    PYTHONPATH=. python3 experiments/bench_ar.py --shape qwen3-8b --out results.json
    PYTHONPATH=. python3 experiments/bench_ar.py --shape tiny          # CPU, seconds
    PYTHONPATH=. python3 experiments/bench_ar.py --shape qwen3-8b --weights bf16,w12 --out ar_w12.json

The last one: bf16 vs W12 weights at batch 1, three rows: "stock" (XLA bf16), "stock_twin" (bf16 through
the W12 kernel's bf16 twin) and "stock@w12" (the same params encoded to W12 on the device, the library's
W12 path); `--shape tiny` runs it on the CPU in interpret mode.

Design choices:
- Random weights are made on the device layer by layer by one jitted initializer, so a 16 GB target
  never exists on the host and the initializer compiles once.
- The context is a real prefill (`dense.prefill`) of random prompt tokens; its time is reported apart.
  Each variant starts from a device copy of that prefilled cache, and rewinds by resetting lengths
  (positions past a length are masked and overwritten, so no clearing is needed).
- Per token: the median over new_tokens individually synced steps after warm-up (latency, dispatch
  included); generation: new_tokens steps issued back to back with the sampled token fed back on the
  device, one sync at the end, divided by new_tokens (what a user of the AR loop gets). "fori"
  variants generate inside one jit, so only the generation number exists for them.
- The card's copy bandwidth is measured in the same run; % of copy bandwidth = bytes per step (every
  weight once + K/V over the whole cache + logits) / time / copy bandwidth.
- Variants (experiments/ar_variants.py) are named; `--variants` picks them. Every variant's first
  logits and generated tokens are compared to stock's, so a fast variant that computes something else
  shows up in the record.
- `--weights bf16,w12` runs every variant on the bf16 params and on the same params encoded to W12
  (`w12.encode_params` on the device; timed twice: cold with compiles, then warm; bits/weight and
  exceptions recorded), recorded as `name` and `name@w12`. The W12 kernel sums in its own order, so W12
  logits equal those of the kernel's bf16 twin, not XLA's: each variant's twin ("stock" -> "stock_twin")
  runs on bf16 too, and every @w12 row records `vs_twin` (token match, first logits bit-equal, `exact`).
  Bandwidth of @w12 rows counts the W12 bytes a step reads instead of the bf16 weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import ar_variants  # noqa: E402
from specpilot import bench  # noqa: E402
from specpilot.cache import init_cache  # noqa: E402
from specpilot.formats import w12  # noqa: E402
from specpilot.models import dense  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402

SHAPES = {
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True,
                            tie_word_embeddings=False, max_position_embeddings=40960),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=1e6, qk_norm=True),
    # the smallest shape the Mosaic W12 kernel tiles (K/2 and N multiples of 64): --w12-kernel mosaic on the CPU
    "tiny-mosaic": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                               num_kv_heads=2, head_dim=32, rope_theta=1e6, qk_norm=True,
                               tie_word_embeddings=False),
}


def init_params_on_device(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, std: float = 0.02,
                          wide_margin: bool = True):
    """Random params with dense.param_shapes' structure, generated on the device one layer at a time.

    One normal draw per layer, sliced into its matrices: each distinct random call costs a compile
    (about 0.5 s on a CPU), and one jitted layer initializer serves every layer. `wide_margin` applies
    `dense.init_wide_margin`'s scheme (embed N(0, 1), residual writes o/down at std / (3 sqrt(2L)), head =
    permuted embedding / sqrt(H)), so variants' greedy tokens are comparable: with N(0, std) everywhere
    the top-2 logits are near-ties and any change of kernel changes the tokens.
    """
    shapes = dense.param_shapes(cfg)
    layer = shapes["layers"][0]
    mats = [n for n in layer if not n.endswith(("norm", "bias"))]
    sizes = [math.prod(layer[n]) for n in mats]

    out_std = std / (3.0 * (2.0 * cfg.num_layers) ** 0.5) if wide_margin else std

    @jax.jit
    def make_layer(k):
        flat = jax.random.normal(k, (sum(sizes),), jnp.float32)
        out, start = {}, 0
        for n, size in zip(mats, sizes):
            scale = out_std if n in ("o", "down") else std
            out[n] = (scale * flat[start:start + size]).astype(dtype).reshape(layer[n])
            start += size
        for n in layer:
            if n not in out:  # norms are ones, biases zeros
                out[n] = (jnp.ones if n.endswith("norm") else jnp.zeros)(layer[n], dtype)
        return out

    embed_std = 1.0 if wide_margin else std

    @jax.jit
    def make_matrix(k):
        return (embed_std * jax.random.normal(k, shapes["embed"], jnp.float32)).astype(dtype)

    @jax.jit
    def permuted_head(embed, k):  # [H, V]: column v reads embedding row pi(v)
        perm = jax.random.permutation(k, cfg.vocab_size)
        return (embed[perm].astype(jnp.float32).T / math.sqrt(cfg.hidden_size)).astype(dtype)

    k_layers, k_embed, k_head = jax.random.split(key, 3)
    layers = tuple(jax.block_until_ready(make_layer(k)) for k in jax.random.split(k_layers, cfg.num_layers))
    params = {"layers": layers, "final_norm": jnp.ones((cfg.hidden_size,), dtype), "embed": make_matrix(k_embed)}
    if "lm_head" in shapes:  # [H, V]
        params["lm_head"] = (permuted_head(params["embed"], k_head) if wide_margin
                             else jax.jit(lambda k: make_matrix(k).T)(k_head))
    return jax.block_until_ready(params)


def copy_tree(tree):
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def run_host_loop(step, params, cache, tokens0, args, context):
    """Per-step latency and back-to-back generation for a jitted greedy step. Returns (record, tokens)."""
    def rewind():  # a fresh array each time: the step donates the cache, lengths included
        return jnp.full((args.batch,), context, jnp.int32)

    tok, _, cache = step(params, tokens0, cache)
    for _ in range(args.warmup):
        tok, _, cache = step(params, tok, cache)
    jax.block_until_ready(tok)
    cache, tok = cache.with_lengths(rewind()), tokens0
    times = []
    for _ in range(args.new_tokens):
        t0 = time.perf_counter()
        tok, _, cache = step(params, tok, cache)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t0)
    passes, first = [], None
    for _ in range(args.gen_repeats):  # back-to-back generation, `gen_repeats` passes: their median
        cache, tok = cache.with_lengths(rewind()), tokens0
        generated = []
        t0 = time.perf_counter()
        for _ in range(args.new_tokens):
            tok, _, cache = step(params, tok, cache)
            generated.append(tok)
        jax.block_until_ready(tok)
        passes.append((time.perf_counter() - t0) / args.new_tokens * 1e3)
        tokens = np.stack([np.asarray(t) for t in generated], axis=1)
        if first is None:
            first = tokens
        elif not np.array_equal(tokens, first):
            raise AssertionError("a greedy generation pass gave other tokens than the first")
    rec = bench.summarize(times)
    rec["gen_ms_per_token"] = float(np.median(passes))
    rec["gen_ms_per_token_passes"] = passes
    return rec, first, cache


def run_fori(cfg, v, params, cache, tokens0, args, context):
    gen = ar_variants.make_generate(cfg, v, args.new_tokens)
    compiled, compile_s = bench.timed_compile(gen, params, tokens0, cache)
    out, cache = compiled(params, tokens0, cache)  # warm-up
    jax.block_until_ready(out)
    runs = []
    for _ in range(args.fori_reps):
        cache = cache.with_lengths(jnp.full((args.batch,), context, jnp.int32))
        t0 = time.perf_counter()
        out, cache = compiled(params, tokens0, cache)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / args.new_tokens)
    rec = {"compile_s": compile_s, "gen_ms_per_token": float(np.median(runs)) * 1e3,
           "gen_runs_ms_per_token": [r * 1e3 for r in runs]}
    return rec, np.asarray(out), cache


def profile_steps(step, params, cache, tokens0, n_steps: int, context: int, batch: int):
    """Trace n_steps host-loop steps with the JAX profiler; returns bench.kernel_summary or an error."""
    cache = cache.with_lengths(jnp.full((batch,), context, jnp.int32))
    tok, _, cache = step(params, tokens0, cache)
    jax.block_until_ready(tok)
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(n_steps):
                    tok, _, cache = step(params, tok, cache)
                jax.block_until_ready(tok)
            return bench.kernel_summary(d, n_steps), cache
        except Exception as e:  # noqa: BLE001 - profiling is optional evidence, never fatal
            return {"error": repr(e)[:500]}, cache


def mosaic_calls(profile: dict, params, name: str) -> None:
    """Adds to a profile the Mosaic kernel's time per matrix (qkv, o, gate_up, down, lm_head, ...): the
    per-call medians of one step grouped by the matrix each call multiplies (`bench.label_calls`), so that
    AR's kernels compare with the chains' (`bench_w12.py`). Left out where the calls do not match the
    matrices one to one (a matrix kept bf16, or no Mosaic kernel)."""
    seqs = {n: q for n, q in (profile.get("sequences") or {}).items() if "mosaic_gpu" in n}
    if len(seqs) != 1:
        return
    calls = bench.label_calls(next(iter(seqs.values())), ar_variants.linear_call_labels(params))
    if calls:
        profile["mosaic_calls"] = calls
        print(f"{name:20s} Mosaic kernel per call (median us, calls per step): " + ", ".join(
            f"{label} {c['us_median']:.1f} x{c['calls']}" for label, c in calls.items()), flush=True)


def token_agreement(generated: np.ndarray, ref_tokens: np.ndarray) -> dict:
    same = generated == ref_tokens
    return {"token_match_frac": float(same.mean()),
            "token_prefix_match": int(np.argmin(np.concatenate([same.all(0), [False]])))}


def run_variant(name, cfg, params_v, snapshot, tokens0, args, ctx, step_bytes, copy_bw, ref):
    """Time one variant on one set of params. Returns (record, generated tokens, first logits or None)."""
    v = ar_variants.VARIANTS[name.split("@")[0].split("+")[0]]
    cache = copy_tree(snapshot)
    first_logits = None
    if v.loop == "fori":
        rec, generated, cache = run_fori(cfg, v, params_v, cache, tokens0, args, ctx)
    else:
        step = ar_variants.make_step(cfg, v)
        compiled, compile_s = bench.timed_compile(step, params_v, tokens0, cache)
        _, logits, cache = compiled(params_v, tokens0, cache)
        first_logits = np.asarray(logits, np.float32)
        cache = cache.with_lengths(jnp.full((args.batch,), ctx, jnp.int32))
        rec, generated, cache = run_host_loop(compiled, params_v, cache, tokens0, args, ctx)
        rec["compile_s"] = compile_s
        rec.update(bench.bandwidth_fields(step_bytes["total"], rec["median_ms"] / 1e3, copy_bw))
        rec["tokens_per_s_step"] = args.batch * 1e3 / rec["median_ms"]
        if ref.get("logits") is None:
            ref["logits"] = first_logits
        diff = np.linalg.norm(first_logits - ref["logits"]) / np.linalg.norm(ref["logits"])
        rec["first_logits_rel_err_vs_ref"] = float(diff)
        rec["first_logits_finite"] = bench.finite(first_logits)
        if args.hlo_dir:
            text = compiled.as_text()
            rec["hlo"] = bench.hlo_summary(text)
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
        if name in args.profile or name.split("@")[0] in args.profile:
            rec["profile"], cache = profile_steps(compiled, params_v, cache, tokens0, args.profile_steps,
                                                  ctx, args.batch)
            mosaic_calls(rec["profile"], params_v, name)
    gen_ms = rec["gen_ms_per_token"]
    rec["tokens_per_s"] = args.batch * 1e3 / gen_ms
    rec.update({f"gen_{k}": x for k, x in
                bench.bandwidth_fields(step_bytes["total"], gen_ms / 1e3, copy_bw).items()})
    rec["step_bytes_total"] = step_bytes["total"]
    if ref.get("tokens") is None:
        ref["tokens"] = generated
    rec.update(token_agreement(generated, ref["tokens"]))
    del cache
    return rec, generated, first_logits


W12_KERNEL = "pallas"  # --w12-kernel: the kernel W12 weights are encoded for (`w12.encode_params`)
W12_ROWS = 1  # rows per product in a decoding step (--batch): the Mosaic kernel's step is chosen for it


def encode_w12(params: dict) -> tuple[dict, dict]:
    """Stock params -> (params with linear weights in W12 via the device encoder, encoding record):
    cold (compiles included) and warm wall time, bits/weight and exceptions over the encoded matrices,
    and the matrices left bf16 (too many exceptions)."""
    t0 = time.perf_counter()
    enc = jax.block_until_ready(w12.encode_params(params, kernel=W12_KERNEL, rows=W12_ROWS))
    cold = time.perf_counter() - t0
    del enc
    t0 = time.perf_counter()
    enc = jax.block_until_ready(w12.encode_params(params, kernel=W12_KERNEL, rows=W12_ROWS))
    warm = time.perf_counter() - t0
    numel = exceptions = nbytes = 0
    kept = []
    named = [(f"layers.{i}.{n}", layer[n]) for i, layer in enumerate(enc["layers"]) for n in layer
             if n in w12.LINEAR_NAMES] + ([("lm_head", enc["lm_head"])] if "lm_head" in enc else [])
    for name, w in named:
        if isinstance(w, w12.ENCODED):
            numel += w.shape[0] * w.shape[1]
            exceptions += w.num_exceptions
            nbytes += w12.storage_bytes(w)["total"]
        else:
            kept.append(name)
    rec = {"encode_s": cold, "encode_warm_s": warm, "matrices": len(named) - len(kept), "kept_bf16": kept,
           "numel": numel, "exceptions": exceptions, "exception_rate": exceptions / max(numel, 1),
           "bytes": nbytes, "bits_per_weight": 8 * nbytes / max(numel, 1), "bf16_bytes_replaced": 2 * numel}
    return enc, rec


def w12_step_bytes(step_bytes: dict, enc_rec: dict) -> dict:
    """A step's bytes with the encoded matrices read as W12 instead of bf16."""
    delta = enc_rec["bytes"] - enc_rec["bf16_bytes_replaced"]
    out = dict(step_bytes)
    for key in ("weights", "total", "total_min"):
        out[key] = step_bytes[key] + delta
    return out


def params_for(params: dict, cfg, name: str, fmt: str) -> dict:
    """Stock bf16 params -> variant `name`'s layout in weight format `fmt`."""
    v = ar_variants.VARIANTS[name]
    if fmt == "bf16":
        return ar_variants.prepare_params(params, cfg, v)
    if fmt == "twin":  # bf16, tiled once for the Mosaic kernel's twin (`w12.TwinNK`)
        if v.layout != "kn":
            raise ValueError(f"variant {name}: the twin's tiles need the [in, out] layout")
        return w12.twin_params(params if v.stock else ar_variants.prepare_params(params, cfg, v))
    if v.stock:
        return w12.encode_params(params, kernel=W12_KERNEL, rows=W12_ROWS)
    if v.layout != "kn":
        raise ValueError(f"variant {name}: W12 weights need the [in, out] layout")
    return w12.encode_params(ar_variants.prepare_params(params, cfg, v), kernel=W12_KERNEL, rows=W12_ROWS)


def compare_to_twin(generated: np.ndarray, logits, twin: dict) -> dict:
    """A W12 run against the bf16 twin run of the same variant: equal bit for bit if lossless."""
    out = {"twin": twin["name"], **token_agreement(generated, twin["tokens"])}
    if logits is not None and twin["logits"] is not None:
        out["first_logits_bit_equal"] = bool(np.array_equal(logits.view(np.uint32),
                                                            twin["logits"].view(np.uint32)))
    out["exact"] = out["token_match_frac"] == 1.0 and out.get("first_logits_bit_equal", True)
    return out


# The Mosaic kernel's on/off switches a run can set: (flag, pallas_kernels.w12_mosaic attribute, meaning).
MOSAIC_SWITCHES = (
    ("--w12-mma", "MMA_ORDER", "pack the planes in the wgmma register order or not"),
    ("--w12-adjacent", "ADJACENT", "pack adjacent row blocks per step (x not reordered per call) or the K halves"),
    ("--w12-pad-x", "PAD_X", "pad (and fold) x per call, or pass it as it is"),
    ("--w12-sum-in-kernel", "SUM_SPLITS_IN_KERNEL", "the kernel adds its K splits itself, or XLA adds the partials"),
    ("--w12-tiled", "TILED", "store the packed planes tile by tile (each step's tile contiguous) or row by row"),
    ("--w12-early-base", "EARLY_BASE", "copy the rows' bases alongside the pipeline's first steps or before them"),
    ("--w12-wide-swizzle", "WIDE_SWIZZLE",
     "pack steps of 128 copied as 128-byte-swizzled tiles and decoded in 64-column halves, or the default steps"),
    ("--w12-plain-planes", "PLAIN_PLANES", "copy the packed plane tiles as stored (no tiling or swizzle) or swizzled"),
    ("--w12-xor-chunks", "XOR_CHUNKS",
     "store tiled steps of 64 in the bank-conflict-free chunk order (loaded by the PTX decode) or as they are"),
    ("--w12-owner-branch", "OWNER_BRANCH",
     "patch exceptions only in the threads that hold their row, or compare them in every thread"),
    ("--w12-out-rows", "OUT_ROWS",
     "the products store their sums row by row ([split, M, N]), or column by column ([split, N, M])"),
    ("--w12-row-branch", "ROW_BRANCH",
     "the owning thread compares only the registers of the exception's row and K half, or all of its registers"),
    ("--w12-sum-barrier", "SUM_BARRIER",
     "materialize each Mosaic product after its split sum (an optimization barrier) or let XLA fuse the sum"),
    ("--w12-halves", "HALVES", "two warpgroups per program, one per K half of each step, or one for both"),
    ("--w12-auto-barriers", "AUTO_BARRIERS",
     "let Pallas insert warpgroup barriers around copies and conditionals, or leave them out (both kernels)"),
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")  # argparse's attribute (and the record's key) for a flag


def _switch(args, flag: str) -> str:
    return getattr(args, _dest(flag))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--variants", default="stock", help=f"comma list or 'all' of {', '.join(ar_variants.VARIANTS)}")
    p.add_argument("--profile", default="", help="comma list of variants to trace with the JAX profiler")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--hlo-dir", default="", help="write each variant's optimized HLO here")
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--fori-reps", type=int, default=3)
    p.add_argument("--gen-repeats", type=int, default=5,
                   help="back-to-back generation passes per row; the row's ms/token is their median (1 before "
                        "the eighteenth session's records)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("wide_margin", "normal"), default="wide_margin",
                   help="random weights: wide greedy margins (tokens comparable across variants) or N(0, 0.02)")
    p.add_argument("--weights", default="bf16",
                   help="comma list of weight formats: bf16, w12, twin (each variant runs on each; w12 adds "
                        "each variant's bf16 twin for the exact comparison; twin: the bf16 weights tiled once "
                        "for the Mosaic kernel's twin, with --w12-kernel mosaic: a bf16 row with W12's kernel "
                        "structure, compared with the @w12 row bit for bit)")
    p.add_argument("--w12-kernel", choices=("pallas", "mosaic"), default="pallas",
                   help="with --weights ...,w12: the W12 kernel (and its twin for the twin variants)")
    for flag, attr, what in MOSAIC_SWITCHES:
        p.add_argument(flag, choices=("default", "on", "off"), default="default",
                       help=f"with --w12-kernel mosaic: {what} (pallas_kernels.w12_mosaic.{attr} for this run)")
    p.add_argument("--w12-mp", default="default",
                   help="with --w12-kernel mosaic: the kernel's row paddings, e.g. '8,16,32,64' "
                        "(pallas_kernels.w12_mosaic.MP_CHOICES for this run)")
    p.add_argument("--w12-small-m-stages", type=int, default=0,
                   help="with --w12-kernel mosaic: pipeline stages at steps of 64 for up to 16 rows, both kernels "
                        "(pallas_kernels.w12_mosaic.SMALL_M_STAGES for this run; 0: the default)")
    p.add_argument("--w12-prefetch-slots", type=int, default=-1,
                   help="with --w12-kernel mosaic: slot-table entries per step the PTX decode loads before decoding "
                        "(pallas_kernels.w12_mosaic.PREFETCH_SLOTS for this run; -1: the default)")
    p.add_argument("--w12-copy-steps", type=int, default=0,
                   help="with --w12-kernel mosaic: consecutive steps copied at once where they divide a program's "
                        "steps (pallas_kernels.w12_mosaic.COPY_STEPS for this run; 0: the default)")
    p.add_argument("--qkv-barrier", action="store_true",
                   help="materialize the fused qkv product before its split and norms, in every variant "
                        "(ar_variants.QKV_BARRIER)")
    p.add_argument("--barrier-after", default="",
                   help="products also materialized right after they are computed, in every variant: "
                        "a comma list of o, down (ar_variants.BARRIER_AFTER)")
    p.add_argument("--l2-prefetch", default="",
                   help="L2 prefetches of coming products' weights during the small kernels between products "
                        "(ar_variants.PREFETCH; non-stock variants, GPUs only): a comma list of NAME[=FRACTION[/"
                        "SEGMENTS]], NAME in o, gate_up, down, qkv, lm_head (e.g. 'o,gate_up=0.25/512')")
    p.add_argument("--l2-prefetch-ab", action="store_true",
                   help="with --l2-prefetch: run every row without and then with the prefetches (the latter "
                        "named NAME+l2), in the same process")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.variants = list(ar_variants.VARIANTS) if args.variants == "all" else [
        s for s in args.variants.split(",") if s]
    unknown = [s for s in args.variants if s not in ar_variants.VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    args.profile = [s for s in args.profile.split(",") if s]
    if args.gen_repeats < 1:
        p.error(f"--gen-repeats must be >= 1, got {args.gen_repeats}")
    global W12_KERNEL, W12_ROWS
    W12_KERNEL, W12_ROWS = args.w12_kernel, args.batch
    ar_variants.TWIN_IMPLEMENTATION = "mosaic" if args.w12_kernel == "mosaic" else None
    switched = [(flag, attr) for flag, attr, _ in MOSAIC_SWITCHES if _switch(args, flag) != "default"]
    prefetch = args.w12_prefetch_slots >= 0
    if switched or args.w12_mp != "default" or args.w12_small_m_stages or prefetch or args.w12_copy_steps:
        if args.w12_kernel != "mosaic":
            named = ([f for f, _ in switched] + ["--w12-mp"] * (args.w12_mp != "default")
                     + ["--w12-small-m-stages"] * bool(args.w12_small_m_stages)
                     + ["--w12-prefetch-slots"] * prefetch + ["--w12-copy-steps"] * bool(args.w12_copy_steps))
            p.error(f"{', '.join(named)} take --w12-kernel mosaic")
        from pallas_kernels import w12_mosaic
        for flag, attr in switched:  # read when the weights are packed (MMA_ORDER, ADJACENT) or at each call
            setattr(w12_mosaic, attr, _switch(args, flag) == "on")
        if args.w12_mp != "default":
            choices = tuple(sorted(int(v) for v in args.w12_mp.split(",")))
            if any(v % 8 or v > 64 for v in choices) or choices[-1] != 64:
                p.error(f"--w12-mp takes multiples of 8 up to 64, 64 included; got {args.w12_mp}")
            w12_mosaic.MP_CHOICES = choices
        if args.w12_small_m_stages:
            if not 2 <= args.w12_small_m_stages <= 4:
                p.error(f"--w12-small-m-stages takes 2 to 4, got {args.w12_small_m_stages}")
            w12_mosaic.SMALL_M_STAGES = args.w12_small_m_stages
        if prefetch:
            if args.w12_prefetch_slots >= w12_mosaic.SLOT_ALIGN:
                p.error(f"--w12-prefetch-slots takes 0 to {w12_mosaic.SLOT_ALIGN - 1}, got {args.w12_prefetch_slots}")
            w12_mosaic.PREFETCH_SLOTS = args.w12_prefetch_slots
        if args.w12_copy_steps:
            if not 1 <= args.w12_copy_steps <= 8:
                p.error(f"--w12-copy-steps takes 1 to 8, got {args.w12_copy_steps}")
            w12_mosaic.COPY_STEPS = args.w12_copy_steps
    ar_variants.QKV_BARRIER = args.qkv_barrier
    args.barrier_after = tuple(s for s in args.barrier_after.split(",") if s)
    if set(args.barrier_after) - {"o", "down"}:
        p.error(f"--barrier-after takes o and down, got {args.barrier_after}")
    ar_variants.BARRIER_AFTER = args.barrier_after
    try:
        args.l2_prefetch = parse_prefetch(args.l2_prefetch)
    except ValueError as e:
        p.error(str(e))
    ar_variants.PREFETCH = args.l2_prefetch
    if args.l2_prefetch_ab and not args.l2_prefetch:
        p.error("--l2-prefetch-ab takes --l2-prefetch")
    args.weights = [s for s in args.weights.split(",") if s]
    if not args.weights or set(args.weights) - {"bf16", "w12", "twin"}:
        p.error(f"--weights takes bf16, w12 and/or twin, got {args.weights}")
    if "twin" in args.weights and args.w12_kernel != "mosaic":
        p.error("--weights ...,twin tiles the weights for the Mosaic kernel's twin: it takes --w12-kernel mosaic")
    # the W12 rows' exact reference: each variant's twin, on bf16 params (added if not asked for)
    args.twins = []
    if "w12" in args.weights:
        for name in args.variants:
            t = ar_variants.twin_of(name)
            if t and t not in args.variants and t not in args.twins:
                args.twins.append(t)
    return args


def parse_prefetch(spec: str) -> dict[str, tuple[float, int]]:
    """'o,gate_up=0.25/512' -> {"o": (1.0, 1), "gate_up": (0.25, 512)} (ar_variants.PREFETCH)."""
    out = {}
    for item in (s for s in spec.split(",") if s):
        name, _, rest = item.partition("=")
        if name not in PREFETCH_NAMES:
            raise ValueError(f"--l2-prefetch names {', '.join(PREFETCH_NAMES)}; got {name!r}")
        fraction, _, segments = rest.partition("/")
        try:
            out[name] = (float(fraction) if fraction else 1.0, int(segments) if segments else 1)
        except ValueError:
            raise ValueError(f"--l2-prefetch takes NAME[=FRACTION[/SEGMENTS]], got {item!r}") from None
        if not 0 < out[name][0] <= 1 or out[name][1] < 1:
            raise ValueError(f"--l2-prefetch: fraction in (0, 1] and segments >= 1, got {item!r}")
    return out


PREFETCH_NAMES = ("o", "gate_up", "down", "qkv", "lm_head")


def _as_lists(prefetch: dict) -> dict:  # ar_variants.PREFETCH as JSON writes it
    return {k: list(v) for k, v in prefetch.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = SHAPES[args.shape]
    ctx, b = args.context, args.batch
    max_len = ctx + args.new_tokens
    record = {"date": datetime.date.today().isoformat(), "shape": args.shape, "config": cfg.to_hf_dict(),
              "batch": b, "context": ctx, "new_tokens": args.new_tokens, "device": bench.device_info(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "w12_kernel": args.w12_kernel,
              **{_dest(flag): _switch(args, flag) for flag, _, _ in MOSAIC_SWITCHES},
              "w12_mp": args.w12_mp, "w12_small_m_stages": args.w12_small_m_stages or "default",
              "w12_prefetch_slots": args.w12_prefetch_slots if args.w12_prefetch_slots >= 0 else "default",
              "w12_copy_steps": args.w12_copy_steps or "default",
              "qkv_barrier": args.qkv_barrier, "gen_repeats": args.gen_repeats,
              "barrier_after": list(args.barrier_after),
              "l2_prefetch": _as_lists(args.l2_prefetch),
              "l2_prefetch_ab": args.l2_prefetch_ab, "variants": {}}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1, default=str)

    record["copy"] = bench.copy_bandwidth(int(args.copy_gib * (1 << 30)))
    copy_bw = record["copy"]["bw"]
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s ({record['device']['device_kind']})", flush=True)
    step_bytes = bench.step_bytes(cfg, b, max_len, mean_len=ctx + args.new_tokens / 2)
    record["step_bytes"] = step_bytes
    record["floor_ms"] = step_bytes["total"] / copy_bw * 1e3

    t0 = time.perf_counter()
    params = init_params_on_device(cfg, jax.random.PRNGKey(args.seed), wide_margin=args.init == "wide_margin")
    record["init_s"] = time.perf_counter() - t0
    prompt = jax.random.randint(jax.random.PRNGKey(args.seed + 1), (b, ctx), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    prefill, record["prefill_compile_s"] = bench.timed_compile(
        dense.prefill, params, cfg, prompt, lengths, init_cache(cfg, b, max_len))
    jax.block_until_ready(prefill(params, prompt, lengths, init_cache(cfg, b, max_len)))
    cache = init_cache(cfg, b, max_len)
    t0 = time.perf_counter()
    last_logits, _, snapshot = jax.block_until_ready(prefill(params, prompt, lengths, cache))
    record["prefill_ms"] = (time.perf_counter() - t0) * 1e3
    tokens0 = jnp.argmax(last_logits, axis=-1).astype(jnp.int32)
    print(f"prefill {ctx} tokens: {record['prefill_ms']:.1f} ms", flush=True)
    save()

    enc_stock, sb_w12 = None, step_bytes
    if "w12" in args.weights:
        enc_stock, record["w12"] = encode_w12(params)
        sb_w12 = w12_step_bytes(step_bytes, record["w12"])
        record["step_bytes_w12"] = sb_w12
        e = record["w12"]
        print(f"w12 encode {e['encode_s']:.2f} s cold, {e['encode_warm_s']:.2f} s warm; "
              f"{e['bits_per_weight']:.4f} bits/weight, exception rate {e['exception_rate']:.2e}, "
              f"{len(e['kept_bf16'])} matrices kept bf16", flush=True)
        save()

    def rank(n):  # XLA stock first (the reference), then other stock variants, then the rest
        v = ar_variants.VARIANTS[n]
        return (not v.stock, v.twin)

    bf16_names = args.variants + args.twins if "bf16" in args.weights else args.twins
    runs = [(n, "bf16") for n in sorted(bf16_names, key=rank)]
    runs += [(n, "twin") for n in sorted(args.variants, key=rank) if "twin" in args.weights]
    runs += [(n, "w12") for n in sorted(args.variants, key=rank) if "w12" in args.weights]
    # each row without and then with the prefetches (--l2-prefetch-ab), or as asked
    modes = (False, True) if args.l2_prefetch_ab else (bool(args.l2_prefetch),)
    runs = [(n, f, pf) for n, f in runs for pf in modes  # not the stock rows, nor the added twins
            if not (pf and (ar_variants.VARIANTS[n].stock or (f == "bf16" and n in args.twins)))]

    def param_key(n, fmt):
        return (ar_variants.VARIANTS[n].param_key, fmt)

    ref: dict = {}
    twins: dict = {}  # Variant -> the bf16 twin run's name, tokens and first logits
    plain: dict = {}  # (variant, weights) -> the run without prefetches (--l2-prefetch-ab)
    by_key: dict = {(("stock",), "bf16"): params}
    if enc_stock is not None:
        by_key[(("stock",), "w12")] = enc_stock
    del enc_stock
    for i, (name, fmt, pf) in enumerate(runs):
        v = ar_variants.VARIANTS[name]
        key = (name if fmt == "bf16" else f"{name}@{fmt}") + ("+l2" * (pf and args.l2_prefetch_ab))
        ar_variants.PREFETCH = args.l2_prefetch if pf else {}
        try:
            if param_key(name, fmt) not in by_key:
                by_key[param_key(name, fmt)] = params_for(params, cfg, name, fmt)
            rec, generated, logits = run_variant(key, cfg, by_key[param_key(name, fmt)], snapshot, tokens0,
                                                 args, ctx, sb_w12 if fmt == "w12" else step_bytes,
                                                 copy_bw, ref)
            if fmt == "bf16" and v.twin and not pf:
                twins[v] = {"name": key, "tokens": generated, "logits": logits}
            if fmt == "twin" and not pf:  # the same kernel on tiles made once: W12's twin too
                twins[("tiled", v)] = {"name": key, "tokens": generated, "logits": logits}
            twin = twins.get(dataclasses.replace(v, twin=True))
            if fmt == "w12" and twin is not None:
                rec["vs_twin"] = compare_to_twin(generated, logits, twin)
            if fmt == "w12" and ("tiled", v) in twins:
                rec["vs_tiled_twin"] = compare_to_twin(generated, logits, twins[("tiled", v)])
            if not pf:
                plain[(name, fmt)] = {"name": key, "tokens": generated, "logits": logits}
            elif (name, fmt) in plain:  # a prefetch changes no value: bit for bit the row without it
                rec["vs_no_prefetch"] = compare_to_twin(generated, logits, plain[(name, fmt)])
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
            rec = {"error": repr(e)[:2000]}
        record["variants"][key] = {"variant": dataclasses.asdict(v), "weights": fmt,
                                   "l2_prefetch": _as_lists(ar_variants.PREFETCH), **rec}
        print(format_row(key, rec), flush=True)
        save()
        later = {param_key(n, f) for n, f, _ in runs[i + 1:]}
        for k in [k for k in by_key if k not in later and k != (("stock",), "bf16")]:
            del by_key[k]  # free a layout no later run uses
    print_table(record)
    return record


def format_row(name: str, rec: dict) -> str:
    if "error" in rec:
        return f"{name:20s} ERROR {rec['error'][:300]}"
    step = (f"{rec['median_ms']:7.3f} ms/step (p10 {rec['p10_ms']:.3f} p90 {rec['p90_ms']:.3f}) "
            f"{rec['pct_copy_bw']:5.1f}% " if "median_ms" in rec else " " * 47)
    twin = rec.get("vs_twin")
    passes = rec.get("gen_ms_per_token_passes", [])
    spread = f" [{min(passes):.3f}-{max(passes):.3f}]" if len(passes) > 1 else ""
    return (f"{name:20s} {step}gen {rec['gen_ms_per_token']:7.3f} ms/tok{spread} {rec['gen_pct_copy_bw']:5.1f}% "
            f"{rec['tokens_per_s']:7.1f} tok/s  match {rec['token_match_frac']:.2f}"
            + (f" relerr {rec['first_logits_rel_err_vs_ref']:.1e}" if "first_logits_rel_err_vs_ref" in rec else "")
            + "".join(f"  vs {t['twin']}: {'EXACT' if t['exact'] else 'DIFFERS'} (match {t['token_match_frac']:.2f})"
                      for t in (twin, rec.get("vs_tiled_twin"), rec.get("vs_no_prefetch")) if t))


def print_table(record: dict) -> None:
    sb = record["step_bytes"]
    print(f"\n{record['shape']} batch {record['batch']} context {record['context']} new {record['new_tokens']} "
          f"on {record['device']['device_kind']} (jax {record['device']['jax']})")
    print(f"bytes/step {sb['total'] / 1e9:.3f} GB (weights {sb['weights'] / 1e9:.3f}, kv {sb['kv_read'] / 1e9:.3f}); "
          f"copy bw {record['copy']['bw'] / 1e12:.3f} TB/s; floor {record['floor_ms']:.3f} ms/token")
    if "w12" in record:
        e, sw = record["w12"], record["step_bytes_w12"]
        print(f"w12: {e['matrices']} matrices, {e['bits_per_weight']:.4f} bits/weight, exception rate "
              f"{e['exception_rate']:.2e}, kept bf16 {e['kept_bf16'] or 'none'}; encode {e['encode_s']:.2f} s "
              f"cold / {e['encode_warm_s']:.2f} s warm; bytes/step {sw['total'] / 1e9:.3f} GB")
    for name, rec in record["variants"].items():
        print(format_row(name, rec))


if __name__ == "__main__":
    main()
