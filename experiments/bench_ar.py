"""AR decode benchmark: time per token, tokens/s and achieved bandwidth vs the bytes a step must read.

    PYTHONPATH=. python3 experiments/bench_ar.py --shape qwen3-8b --out results.json
    PYTHONPATH=. python3 experiments/bench_ar.py --shape tiny          # CPU, seconds

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
from specpilot.models import dense  # noqa: E402
from specpilot.models.config import ModelConfig  # noqa: E402

SHAPES = {
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True,
                            tie_word_embeddings=False, max_position_embeddings=40960),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=1e6, qk_norm=True),
}


def init_params_on_device(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, std: float = 0.02):
    """Random params with dense.param_shapes' structure, generated on the device one layer at a time.

    One normal draw per layer, sliced into its matrices: each distinct random call costs a compile
    (about 0.5 s on a CPU), and one jitted layer initializer serves every layer.
    """
    shapes = dense.param_shapes(cfg)
    layer = shapes["layers"][0]
    mats = [n for n in layer if not n.endswith(("norm", "bias"))]
    sizes = [math.prod(layer[n]) for n in mats]

    @jax.jit
    def make_layer(k):
        flat = (std * jax.random.normal(k, (sum(sizes),), jnp.float32)).astype(dtype)
        out, start = {}, 0
        for n, size in zip(mats, sizes):
            out[n] = flat[start:start + size].reshape(layer[n])
            start += size
        for n in layer:
            if n not in out:  # norms are ones, biases zeros
                out[n] = (jnp.ones if n.endswith("norm") else jnp.zeros)(layer[n], dtype)
        return out

    @jax.jit
    def make_matrix(k):
        return (std * jax.random.normal(k, shapes["embed"], jnp.float32)).astype(dtype)

    k_layers, k_embed, k_head = jax.random.split(key, 3)
    layers = tuple(jax.block_until_ready(make_layer(k)) for k in jax.random.split(k_layers, cfg.num_layers))
    params = {"layers": layers, "final_norm": jnp.ones((cfg.hidden_size,), dtype), "embed": make_matrix(k_embed)}
    if "lm_head" in shapes:  # [H, V]: the same draw as an embedding, transposed
        params["lm_head"] = jax.jit(lambda k: make_matrix(k).T)(k_head)
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
    cache, tok = cache.with_lengths(rewind()), tokens0
    generated = []
    t0 = time.perf_counter()
    for _ in range(args.new_tokens):
        tok, _, cache = step(params, tok, cache)
        generated.append(tok)
    jax.block_until_ready(tok)
    gen_s = time.perf_counter() - t0
    rec = bench.summarize(times)
    rec["gen_ms_per_token"] = gen_s / args.new_tokens * 1e3
    return rec, np.stack([np.asarray(t) for t in generated], axis=1), cache


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


def run_variant(name, cfg, params_v, snapshot, tokens0, args, ctx, step_bytes, copy_bw, ref):
    v = ar_variants.VARIANTS[name]
    cache = copy_tree(snapshot)
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
        if name in args.profile:
            rec["profile"], cache = profile_steps(compiled, params_v, cache, tokens0, args.profile_steps,
                                                  ctx, args.batch)
    gen_ms = rec["gen_ms_per_token"]
    rec["tokens_per_s"] = args.batch * 1e3 / gen_ms
    rec.update({f"gen_{k}": x for k, x in
                bench.bandwidth_fields(step_bytes["total"], gen_ms / 1e3, copy_bw).items()})
    if ref.get("tokens") is None:
        ref["tokens"] = generated
    same = generated == ref["tokens"]
    rec["token_match_frac"] = float(same.mean())
    rec["token_prefix_match"] = int(np.argmin(np.concatenate([same.all(0), [False]])))
    del cache
    return rec


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.variants = list(ar_variants.VARIANTS) if args.variants == "all" else [
        s for s in args.variants.split(",") if s]
    unknown = [s for s in args.variants if s not in ar_variants.VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}")
    args.profile = [s for s in args.profile.split(",") if s]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = SHAPES[args.shape]
    ctx, b = args.context, args.batch
    max_len = ctx + args.new_tokens
    record = {"date": datetime.date.today().isoformat(), "shape": args.shape, "config": cfg.to_hf_dict(),
              "batch": b, "context": ctx, "new_tokens": args.new_tokens, "device": bench.device_info(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "variants": {}}

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
    params = init_params_on_device(cfg, jax.random.PRNGKey(args.seed))
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

    ref: dict = {}
    by_key: dict = {}
    order = sorted(args.variants, key=lambda n: (not ar_variants.VARIANTS[n].stock,))
    for i, name in enumerate(order):
        v = ar_variants.VARIANTS[name]
        if v.param_key not in by_key:
            by_key[v.param_key] = ar_variants.prepare_params(params, cfg, v)
        try:
            rec = run_variant(name, cfg, by_key[v.param_key], snapshot, tokens0, args, ctx, step_bytes,
                              copy_bw, ref)
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
            rec = {"error": repr(e)[:2000]}
        record["variants"][name] = {"variant": dataclasses.asdict(v), **rec}
        print(format_row(name, rec), flush=True)
        save()
        later = {ar_variants.VARIANTS[n].param_key for n in order[i + 1:]}
        for key in [k for k in by_key if k not in later and k != ("stock",)]:
            del by_key[key]  # free a layout no later variant uses
    print_table(record)
    return record


def format_row(name: str, rec: dict) -> str:
    if "error" in rec:
        return f"{name:20s} ERROR {rec['error'][:300]}"
    step = (f"{rec['median_ms']:7.3f} ms/step (p10 {rec['p10_ms']:.3f} p90 {rec['p90_ms']:.3f}) "
            f"{rec['pct_copy_bw']:5.1f}% " if "median_ms" in rec else " " * 47)
    return (f"{name:20s} {step}gen {rec['gen_ms_per_token']:7.3f} ms/tok {rec['gen_pct_copy_bw']:5.1f}% "
            f"{rec['tokens_per_s']:7.1f} tok/s  match {rec['token_match_frac']:.2f}"
            + (f" relerr {rec['first_logits_rel_err_vs_ref']:.1e}" if "first_logits_rel_err_vs_ref" in rec else ""))


def print_table(record: dict) -> None:
    sb = record["step_bytes"]
    print(f"\n{record['shape']} batch {record['batch']} context {record['context']} new {record['new_tokens']} "
          f"on {record['device']['device_kind']} (jax {record['device']['jax']})")
    print(f"bytes/step {sb['total'] / 1e9:.3f} GB (weights {sb['weights'] / 1e9:.3f}, kv {sb['kv_read'] / 1e9:.3f}); "
          f"copy bw {record['copy']['bw'] / 1e12:.3f} TB/s; floor {record['floor_ms']:.3f} ms/token")
    for name, rec in record["variants"].items():
        print(format_row(name, rec))


if __name__ == "__main__":
    main()
