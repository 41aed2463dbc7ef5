"""W12 weight preparation for the Mosaic kernel, stage by stage: the whole model as a run prepares it (cold:
compiles included), encoding and layout per matrix shape (warm), and the encodings' cache: write and reload.

    PYTHONPATH=. python3 experiments/bench/bench_w12_prep.py                       # H200: Qwen3-8B shape
    PYTHONPATH=. python3 experiments/bench/bench_w12_prep.py --shape tiny          # CPU smoke
    PYTHONPATH=. python3 experiments/bench/bench_w12_prep.py --layers 4 --out p.json     # fewer layers

Design notes and measurements: docs/w12.md ("Preparation and its cache").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels import w12_mosaic as mk
from pallas_kernels.w12_mosaic import layout
from specpilot import formats
from specpilot.formats import w12, w12_cache
from specpilot.harness import bench
from specpilot.models import dense
from specpilot.models.config import ModelConfig

SHAPES = {  # config.json fields of the shapes a run prepares (Qwen3-8B, Qwen3-4B) and a CPU smoke shape
    "qwen3_8b": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3_4b": {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
    "tiny": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
}


def model_config(shape: str, layers: int | None) -> ModelConfig:
    hf = {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 1e6, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 4096, "tie_word_embeddings": False, **SHAPES[shape]}
    if layers:
        hf["num_hidden_layers"] = layers
    return ModelConfig.from_hf_dict(hf)


def seconds(fn):
    """(result, wall seconds) of fn() with its device work finished."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def matrices(params: dict) -> dict[str, jax.Array]:
    """One matrix of each distinct name of a fused dense model (layer 0's and the head), by name."""
    out = {n: w for n, w in params["layers"][0].items() if n in w12.LINEAR_NAMES}
    out["lm_head"] = params["lm_head"]
    return out


def per_shape(params: dict, rows: int, config, record: dict) -> None:
    """Each distinct matrix once, after the whole model (compiled): encoding, then the layout's two parts
    (the packed planes on the device, the slot table on the host), the best of two calls each; and the
    sum over the model's matrices (each layer's, once per layer, and the head)."""
    total = 0.0
    for name, w in matrices(params).items():
        k, n = w.shape
        block_k = mk.default_block_k(k, n, rows, config)
        row = {"shape": [k, n], "count": 1 if name == "lm_head" else len(params["layers"])}
        for stage, fn in (("encode", lambda: w12.encode_device(w)),
                          ("planes", lambda: layout.packed_planes(enc.sm, enc.nib, block_k)),
                          ("slots", lambda: layout.exception_slots(enc, block_k))):
            out, t0 = seconds(fn)
            _, t1 = seconds(fn)
            row[f"{stage}_s"] = min(t0, t1)
            if stage == "encode":
                enc = out
        row["exceptions"] = enc.num_exceptions
        total += row["count"] * (row["encode_s"] + row["planes_s"] + row["slots_s"])
        record["per_shape"][name] = row
        print(f"  {name:8s} {str((k, n)):16s} x{row['count']:<3d} exceptions {enc.num_exceptions:6d}  encode "
              f"{row['encode_s']:7.3f} s  layout: planes {row['planes_s']:7.3f} s, slots {row['slots_s']:7.3f} s",
              flush=True)
    record["per_shape_model_s"] = total
    print(f"  per-matrix stages summed over the model: {total:.2f} s", flush=True)


def whole_model(params: dict, rows: int, choice, record: dict) -> None:
    """The run's preparation of every matrix (`formats.encode_params`, then `dispatch.prepare_params`)."""
    print(f"  encoding {len(w12.matrix_names(params))} matrices, then their layout ...", flush=True)
    encoded, record["encode_s"] = seconds(lambda: formats.encode_params(params, "w12"))
    print(f"  encode (every matrix)        {record['encode_s']:7.2f} s", flush=True)
    _, record["layout_s"] = seconds(lambda: dispatch.prepare_params(encoded, choice, rows, layout_bf16=False))
    print(f"  layout (every matrix)        {record['layout_s']:7.2f} s", flush=True)
    record["prep_total_s"] = record["encode_s"] + record["layout_s"]
    record["encoded_bytes"] = sum(w12.storage_bytes(w)["total"] for w in jax.tree_util.tree_leaves(
        encoded, is_leaf=lambda x: isinstance(x, w12.W12)) if isinstance(w, w12.W12))


def write_entry(path: Path, key: str, names: list[str], sources: list) -> float:
    """Seconds to write the cache entry of the encoded matrices (the encodings are freed after)."""
    entries = {name: w12.encode_matrix(x) for name, x in zip(names, sources)}
    return seconds(lambda: w12_cache.save(path, key, entries))[1]


def cache(params: dict, rows: int, choice, cache_dir: Path, record: dict) -> None:
    """A run with the cache, first (encode and write the entry) and second (load it): key, write and load
    timed apart, then the second run's whole preparation (`formats.encode_params` with cache_dir, layout)."""
    names = w12.matrix_names(params)
    sources: list = []
    w12.map_matrices(lambda x: sources.append(x) or x, params)
    key, record["cache_key_s"] = seconds(lambda: w12_cache.cache_key(names, sources, {"max_exception_rate": 0.01}))
    print(f"  cache key (content digests)  {record['cache_key_s']:7.2f} s", flush=True)
    path = cache_dir / w12_cache.SUBDIR / f"{key[:40]}.safetensors"
    record["cache_write_s"] = write_entry(path, key, names, sources)
    record["cache_bytes"] = path.stat().st_size
    print(f"  cache write                  {record['cache_write_s']:7.2f} s ({record['cache_bytes'] / 1e9:.2f} GB)",
          flush=True)
    loaded, record["cache_load_s"] = seconds(lambda: w12_cache.load(path, key, dict(zip(names, sources))))
    if loaded is None:
        raise RuntimeError(f"the cache entry just written at {path} did not load")
    del loaded
    print(f"  cache load (digests checked) {record['cache_load_s']:7.2f} s", flush=True)
    encoded, record["reload_s"] = seconds(lambda: formats.encode_params(params, "w12", cache_dir=str(cache_dir)))
    _, record["reload_layout_s"] = seconds(lambda: dispatch.prepare_params(encoded, choice, rows, layout_bf16=False))
    record["cached_total_s"] = record["reload_s"] + record["reload_layout_s"]
    print(f"  second run: cached encode {record['reload_s']:.2f} s + layout {record['reload_layout_s']:.2f} s = "
          f"{record['cached_total_s']:.2f} s", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_8b")
    p.add_argument("--layers", type=int, default=None, help="layers to build (default: the shape's)")
    p.add_argument("--rows", type=int, default=16, help="rows per product the layout is stepped for (batch x block)")
    p.add_argument("--skip-per-shape", action="store_true", help="leave out the per-shape split")
    p.add_argument("--cache-dir", default="",
                   help="where the temporary cache folder goes (default: the system temp folder); removed after")
    p.add_argument("--out", default="", help="write the record as JSON here")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    cfg = model_config(args.shape, args.layers)
    choice = dispatch.choice("matmul", ["mosaic", "xla"])
    record = {"shape": args.shape, "layers": cfg.num_layers, "rows": args.rows, "device": str(jax.devices()[0]),
              "per_shape": {}}
    print(f"W12 preparation, {args.shape} shape, {cfg.num_layers} layers, rows {args.rows}, on {record['device']}",
          flush=True)
    params, record["init_s"] = seconds(lambda: dense.fuse_projections(
        bench.init_params_on_device(cfg, jax.random.key(0), jnp.bfloat16, wide_margin=False)))
    print(f"  random weights  {record['init_s']:7.2f} s (not preparation)", flush=True)
    whole_model(params, args.rows, choice, record)
    print(f"total preparation {record['prep_total_s']:.2f} s (encode {record['encode_s']:.2f} + layout "
          f"{record['layout_s']:.2f}, compiles included), {record['encoded_bytes'] / 1e9:.2f} GB encoded", flush=True)
    if not args.skip_per_shape:
        per_shape(params, args.rows, choice.config or mk.DEFAULT, record)
    with tempfile.TemporaryDirectory(dir=args.cache_dir or None) as tmp:
        cache(params, args.rows, choice, Path(tmp), record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
