"""AR decode benchmark: time per token, tokens/s and achieved bandwidth vs the bytes a step must read.

    PYTHONPATH=. python3 experiments/bench/bench_ar.py --shape qwen3-8b --out results.json
    PYTHONPATH=. python3 experiments/bench/bench_ar.py --shape tiny --kernel xla --weights bf16,w12   # CPU, seconds
    PYTHONPATH=. python3 experiments/bench/bench_ar.py --shape qwen3-8b --variants fused --weights bf16,w12,twin \
        --kernel mosaic,xla --new-tokens 64 --context 256 --out ar_w12.json                     # H200

The last one: at batch 1, XLA's bf16 step ("fused"), bf16 weights through the Mosaic W12 kernel's twin
("fused@twin", tiled once) and W12 weights through the kernel ("fused@w12"); the W12 row must equal the
twin row bit for bit.

Design notes: docs/design/bench.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import ar_variants
from pallas_kernels import dispatch
from pallas_kernels import w12_mosaic
from specpilot import formats
from specpilot.harness import bench
from specpilot.formats import w12
from specpilot.models import dense
from specpilot.models.config import ModelConfig

SHAPES = {
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True,
                            tie_word_embeddings=False, max_position_embeddings=40960),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=1e6, qk_norm=True),
    # the smallest shape the Mosaic W12 kernel tiles (K/2 and N multiples of 64): --kernel mosaic on the CPU
    "tiny-mosaic": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                               num_kv_heads=2, head_dim=32, rope_theta=1e6, qk_norm=True,
                               tie_word_embeddings=False),
}


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
    for _ in range(args.trials):  # back-to-back generation, `trials` passes: their median
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
    v = variant(name.split("@")[0], args)
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
        if any(name.startswith(prefix) for prefix in args.profile):
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


def variant(name: str, args) -> ar_variants.Variant:
    """The named variant with the run's matmul choice (stock: dense.forward, each weight's own kernel)."""
    v = ar_variants.VARIANTS[name]
    return v if v.stock else dataclasses.replace(v, matmul=args.choice)


def _layout_bytes(w) -> int:
    return (w12_mosaic.storage_bytes(w) if isinstance(w, w12_mosaic.W12NK) else w12.storage_bytes(w))["total"]


def encode_w12(params: dict, args) -> tuple[dict, dict]:
    """Stock params -> (params in W12, in the layout of the run's kernel choice, encoding record): cold
    (compiles included) and warm wall time of encode + layout, bits/weight and exceptions over the encoded
    matrices, the bytes the kernel reads, and the matrices left bf16 (too many exceptions)."""
    def encode():
        enc = jax.block_until_ready(formats.encode_params(params, "w12"))
        laid = dispatch.prepare_params(enc, args.choice, rows=args.batch, layout_bf16=False)
        return enc, jax.block_until_ready(laid)

    t0 = time.perf_counter()
    encode()  # cold: compiles included
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    enc, prepared = encode()
    warm = time.perf_counter() - t0
    numel = exceptions = nbytes = 0
    kept = []

    def named(p):
        return [(f"layers.{i}.{n}", layer[n]) for i, layer in enumerate(p["layers"]) for n in layer
                if n in w12.LINEAR_NAMES] + ([("lm_head", p["lm_head"])] if "lm_head" in p else [])

    for (name, w), (_, laid) in zip(named(enc), named(prepared)):
        if isinstance(w, w12.W12):
            numel += w.shape[0] * w.shape[1]
            exceptions += w.num_exceptions
            nbytes += _layout_bytes(laid)
        else:
            kept.append(name)
    rec = {"encode_s": cold, "encode_warm_s": warm, "matrices": len(named(enc)) - len(kept), "kept_bf16": kept,
           "numel": numel, "exceptions": exceptions, "exception_rate": exceptions / max(numel, 1),
           "bytes": nbytes, "bits_per_weight": 8 * nbytes / max(numel, 1), "bf16_bytes_replaced": 2 * numel,
           "layout": sorted({type(w).__name__ for _, w in named(prepared)})}
    return prepared, rec


def w12_step_bytes(step_bytes: dict, enc_rec: dict) -> dict:
    """A step's bytes with the encoded matrices read as W12 instead of bf16."""
    delta = enc_rec["bytes"] - enc_rec["bf16_bytes_replaced"]
    out = dict(step_bytes)
    for key in ("weights", "total", "total_min"):
        out[key] = step_bytes[key] + delta
    return out


def params_for(params: dict, cfg, name: str, fmt: str, args) -> dict:
    """Stock bf16 params -> variant `name`'s layout in weight format `fmt` (for the run's kernel choice)."""
    v = ar_variants.VARIANTS[name]
    laid = ar_variants.prepare_params(params, cfg, v)
    if fmt == "bf16":
        return laid
    if v.layout != "kn":
        raise ValueError(f"variant {name}: kernel layouts take the [in, out] weights (layout 'kn')")
    if fmt == "twin":  # bf16, tiled once for the Mosaic kernel's twin
        return dispatch.prepare_params(laid, args.choice, rows=args.batch)
    enc = formats.encode_params(laid, "w12")
    return dispatch.prepare_params(enc, args.choice, rows=args.batch, layout_bf16=False)


def compare_to_twin(generated: np.ndarray, logits, twin: dict) -> dict:
    """A W12 run against the bf16 run that must give its bits (the same kernel's twin, or XLA's dot of
    the bf16 weights for decode + XLA): equal bit for bit if lossless."""
    out = {"twin": twin["name"], **token_agreement(generated, twin["tokens"])}
    if logits is not None and twin["logits"] is not None:
        out["first_logits_bit_equal"] = bool(np.array_equal(logits.view(np.uint32),
                                                            twin["logits"].view(np.uint32)))
    out["exact"] = out["token_match_frac"] == 1.0 and out.get("first_logits_bit_equal", True)
    return out


def parse_args(argv=None):
    p = bench.common_parser(__doc__.split("\n")[0], shape_default="qwen3-8b",
                            shape_help=f"the model shape: one of {', '.join(sorted(SHAPES))}", m_default="1",
                            m_help="rows per product: the batch (one value)", kernel_default="mosaic,xla")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--variants", default="stock", help=f"comma list or 'all' of {', '.join(ar_variants.VARIANTS)}")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--hlo-dir", default="", help="write each variant's optimized HLO here")
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--fori-reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=("wide_margin", "normal"), default="wide_margin",
                   help="random weights: wide greedy margins (tokens comparable across variants) or N(0, 0.02)")
    p.add_argument("--weights", default="bf16",
                   help="comma list of weight formats: bf16, w12, twin (each variant runs on each, in that order)")
    args = bench.parse_common(p, argv)
    if args.shape not in SHAPES:
        p.error(f"--shape takes one of {', '.join(sorted(SHAPES))}, got {args.shape!r}")
    if len(args.m) != 1:
        p.error(f"--m takes one batch size here, got {args.m}")
    args.batch = args.m[0]
    args.variants = list(ar_variants.VARIANTS) if args.variants == "all" else bench.comma_list(args.variants)
    unknown = [s for s in args.variants if s not in ar_variants.VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    args.weights = bench.comma_list(args.weights)
    if not args.weights or set(args.weights) - {"bf16", "w12", "twin"}:
        p.error(f"--weights takes bf16, w12 and/or twin, got {args.weights}")
    if "twin" in args.weights and args.choice.implementation[0] != "mosaic":
        p.error("--weights ...,twin tiles the weights for the Mosaic kernel's twin: it takes --kernel mosaic[,...]")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = SHAPES[args.shape]
    ctx, b = args.context, args.batch
    max_len = ctx + args.new_tokens
    record = {"date": datetime.date.today().isoformat(), "shape": args.shape, "config": cfg.to_hf_dict(),
              "batch": b, "context": ctx, "new_tokens": args.new_tokens, "device": bench.device_info(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "kernel": list(args.choice.implementation),
              "kernel_config": dataclasses.asdict(args.choice.config) if args.choice.config else {},
              "trials": args.trials, "variants": {}}

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
    params = bench.init_params_on_device(cfg, jax.random.PRNGKey(args.seed), wide_margin=args.init == "wide_margin")
    record["init_s"] = time.perf_counter() - t0
    prompt = jax.random.randint(jax.random.PRNGKey(args.seed + 1), (b, ctx), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    def fresh():
        return dense.init_state(cfg, b, max_len, params["embed"].dtype)

    prefill, record["prefill_compile_s"] = bench.timed_compile(dense.prefill, params, cfg, prompt, lengths, fresh())
    jax.block_until_ready(prefill(params, prompt, lengths, fresh()))
    cache = fresh()
    t0 = time.perf_counter()
    last_logits, _, snapshot = jax.block_until_ready(prefill(params, prompt, lengths, cache))
    record["prefill_ms"] = (time.perf_counter() - t0) * 1e3
    tokens0 = jnp.argmax(last_logits, axis=-1).astype(jnp.int32)
    print(f"prefill {ctx} tokens: {record['prefill_ms']:.1f} ms", flush=True)
    save()

    enc_stock, sb_w12 = None, step_bytes
    if "w12" in args.weights:
        enc_stock, record["w12"] = encode_w12(params, args)
        sb_w12 = w12_step_bytes(step_bytes, record["w12"])
        record["step_bytes_w12"] = sb_w12
        e = record["w12"]
        print(f"w12 encode {e['encode_s']:.2f} s cold, {e['encode_warm_s']:.2f} s warm; "
              f"{e['bits_per_weight']:.4f} bits/weight, exception rate {e['exception_rate']:.2e}, "
              f"{len(e['kept_bf16'])} matrices kept bf16", flush=True)
        save()

    def rank(n):  # stock first (the reference), then the other variants
        return not ar_variants.VARIANTS[n].stock

    order = sorted(args.variants, key=rank)
    runs = [(n, fmt) for fmt in ("bf16", "twin", "w12") if fmt in args.weights for n in order]
    exact_ref = {}  # (variant, "twin" or "bf16") -> the run a @w12 row must equal bit for bit
    by_key: dict = {(("stock",), "bf16"): params}
    if enc_stock is not None:
        by_key[(("stock",), "w12")] = enc_stock
    del enc_stock

    def param_key(n, fmt):
        return (ar_variants.VARIANTS[n].param_key, fmt)

    ref: dict = {}
    for i, (name, fmt) in enumerate(runs):
        key = name if fmt == "bf16" else f"{name}@{fmt}"
        try:
            if param_key(name, fmt) not in by_key:
                by_key[param_key(name, fmt)] = params_for(params, cfg, name, fmt, args)
            rec, generated, logits = run_variant(key, cfg, by_key[param_key(name, fmt)], snapshot, tokens0,
                                                 args, ctx, sb_w12 if fmt == "w12" else step_bytes, copy_bw, ref)
            if fmt != "w12":
                exact_ref[name, fmt] = {"name": key, "tokens": generated, "logits": logits}
            if fmt == "w12" and (name, "twin") in exact_ref:
                rec["vs_twin"] = compare_to_twin(generated, logits, exact_ref[name, "twin"])
            if fmt == "w12" and args.choice.implementation[0] == "xla" and (name, "bf16") in exact_ref:
                rec["vs_bf16"] = compare_to_twin(generated, logits, exact_ref[name, "bf16"])
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
            rec = {"error": repr(e)[:2000]}
        v = variant(name, args)
        record["variants"][key] = {"variant": {f.name: str(getattr(v, f.name)) if f.name == "matmul" else
                                               getattr(v, f.name) for f in dataclasses.fields(v)},
                                   "weights": fmt, **rec}
        print(format_row(key, rec), flush=True)
        save()
        later = {param_key(n, f) for n, f in runs[i + 1:]}
        for k in [k for k in by_key if k not in later and k != (("stock",), "bf16")]:
            del by_key[k]  # free a layout no later run uses
    print_table(record)
    return record


def format_row(name: str, rec: dict) -> str:
    if "error" in rec:
        return f"{name:20s} ERROR {rec['error'][:300]}"
    step = (f"{rec['median_ms']:7.3f} ms/step (p10 {rec['p10_ms']:.3f} p90 {rec['p90_ms']:.3f}) "
            f"{rec['pct_copy_bw']:5.1f}% " if "median_ms" in rec else " " * 47)
    passes = rec.get("gen_ms_per_token_passes", [])
    spread = f" [{min(passes):.3f}-{max(passes):.3f}]" if len(passes) > 1 else ""
    return (f"{name:20s} {step}gen {rec['gen_ms_per_token']:7.3f} ms/tok{spread} {rec['gen_pct_copy_bw']:5.1f}% "
            f"{rec['tokens_per_s']:7.1f} tok/s  match {rec['token_match_frac']:.2f}"
            + (f" relerr {rec['first_logits_rel_err_vs_ref']:.1e}" if "first_logits_rel_err_vs_ref" in rec else "")
            + "".join(f"  vs {t['twin']}: {'EXACT' if t['exact'] else 'DIFFERS'} (match {t['token_match_frac']:.2f})"
                      for t in (rec.get("vs_twin"), rec.get("vs_bf16")) if t))


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
