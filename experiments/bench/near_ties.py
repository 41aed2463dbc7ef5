"""Token forcing across dtypes on real weights: where float32 and bfloat16 greedy choices part, and by how much.

    PYTHONPATH=. python3 experiments/bench/near_ties.py --checkpoint /tmp/smolcache/gguf/<folder> \\
        --out outputs/near_ties.json
    PYTHONPATH=. python3 experiments/bench/near_ties.py --checkpoint DIR --num-prompts 4 --new-tokens 32 --margin 0.5

Prints a summary, writes the whole report as JSON to --out, and exits 1 (FAILURE printed) when a
mismatch is not a near-tie: the reference's top-1 minus top-2 logit there is at least --margin.

Design notes: docs/design/bench.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from specpilot import forcing
from specpilot.data import prompt_sets
from specpilot.decoding import ar
from specpilot.harness.config_schema import ConfigValueError
from specpilot.harness.deploy import eos_token_id, text_prompts
from specpilot.models import dense
from specpilot.models.checkpoint import CheckpointError, load_hf
from specpilot.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MARGIN = 1.0  # logits; why: docs/design/bench.md (near_ties.py)
MARGIN_BINS = (0.01, 0.1, 0.5, 1.0)
DTYPES = ("float32", "bfloat16")


def bench_settings(prompt_set: str) -> dict:
    """prompts, num_prompts, prompt_len and new_tokens of `conf/bench/<prompt_set>.yaml`."""
    path = ROOT / "conf" / "bench" / f"{prompt_set}.yaml"
    if not path.is_file():
        raise SystemExit(f"error: no bench config {path} for prompt set {prompt_set!r}")
    conf = OmegaConf.load(path)
    return {k: conf[k] for k in ("prompts", "num_prompts", "prompt_len", "new_tokens")}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="Hugging Face model folder with tokenizer.json and a "
                                                        "chat template (e.g. the converted SmolLM2 folder)")
    ap.add_argument("--prompts", default="chat", help="bench prompt set (conf/bench/<name>.yaml)")
    ap.add_argument("--num-prompts", type=int, help="default: the bench config's (chat: 16)")
    ap.add_argument("--prompt-len", type=int, help="longest prompt kept, tokens (chat: 256)")
    ap.add_argument("--new-tokens", type=int, help="new tokens per prompt (chat: 128)")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help=f"reference margin (logits) at or above which a mismatch fails (default {DEFAULT_MARGIN})")
    ap.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    ap.add_argument("--out", default="outputs/near_ties.json", help="JSON report path")
    args = ap.parse_args(argv)
    if not args.margin > 0:
        ap.error(f"--margin must be a positive number of logits, got {args.margin}")
    return args


def load_models(folder) -> tuple[dict, object]:
    """{dtype name: (params, target)} for both dtypes of one folder, and its config."""
    models, cfg = {}, None
    for name in DTYPES:
        try:
            params, cfg = load_hf(folder, dtype=jnp.dtype(name))
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: {e}")
        if not isinstance(cfg, ModelConfig):
            raise SystemExit(f"error: {folder} is not a dense (Llama/Qwen3) model; this study runs dense targets")
        models[name] = (params, dense.target(cfg, jnp.dtype(name)))
    return models, cfg


def load_prompts(folder, settings: dict) -> tuple[list[list[int]], list[str]]:
    """The bench prompt set through the deployment's code path (`deploy.text_prompts`)."""
    if not prompt_sets.has_tokenizer(folder):
        raise SystemExit(f"error: {folder} has no tokenizer.json; text prompts need one")
    try:
        return text_prompts(OmegaConf.create(settings), prompt_sets.load_model_text(folder))
    except (ConfigValueError, prompt_sets.PromptSetError) as e:
        raise SystemExit(f"error: {e}")


def generate_outputs(models: dict, prompts, new_tokens: int, stop_token: int | None) -> dict:
    """{dtype: greedy AR tokens [B, N]} (positions after the stop token read -1)."""
    return {name: ar.generate(target, params, prompts, new_tokens, stop_token=stop_token).tokens
            for name, (params, target) in models.items()}


def force_direction(reference: tuple, candidate: tuple, prompts, forced, margin: float) -> forcing.PairedForcing:
    """The candidate (params, target) forced on the reference's output `forced`, both in AR decode numerics."""
    ref = forcing.chunked_scorer(*reference, chunk=1)
    cand = forcing.chunked_scorer(*candidate, chunk=1)
    return forcing.force_paired(ref, cand, prompts, forced, tie_margin=margin)


def self_mismatches(paired: forcing.PairedForcing, forced: np.ndarray) -> list[dict]:
    """Positions where the reference's own argmax under forcing is not the token it generated."""
    rows = []
    for b, i in zip(*np.nonzero(paired.checked & (paired.reference_choice != forced))):
        rows.append(dict(prompt=int(b), position=int(i), generated_token=int(forced[b, i]),
                         reference_choice=int(paired.reference_choice[b, i]),
                         reference_margin=float(paired.reference_margin[b, i])))
    return rows


def failures(paired: forcing.PairedForcing, forced: np.ndarray, margin: float) -> list[dict]:
    """What fails the study: mismatches and reference self-mismatches whose reference margin is at least
    `margin` (or not a number), and positions with non-finite logits."""
    out = [dict(kind="mismatch", **m) for m in paired.mismatch_rows()
           if not m["reference_margin"] < margin]
    out += [dict(kind="reference_self_mismatch", **m) for m in self_mismatches(paired, forced)
            if not m["reference_margin"] < margin]
    out += [dict(kind="non_finite", prompt=b, position=n.position, side=n.side)
            for b, p in enumerate(paired.report.prompts) for n in p.non_finite]
    return out


def direction_summary(paired: forcing.PairedForcing, forced: np.ndarray, margin: float) -> dict:
    checked = paired.checked
    margins = paired.reference_margin[checked]
    diffs = paired.max_abs_diff[checked]
    tops = np.abs(paired.reference_top[checked])
    report = paired.report
    return dict(
        positions=report.num_positions,
        mismatches=report.num_mismatches,
        near_ties=report.num_near_ties,
        failures=failures(paired, forced, margin),
        mismatch_list=paired.mismatch_rows(),
        reference_self_mismatches=self_mismatches(paired, forced),
        non_finite_positions=report.num_non_finite,
        margin_histogram={f"<{t:g}": int((margins < t).sum()) for t in MARGIN_BINS},
        reference_margin_min=float(margins.min()) if margins.size else None,
        max_abs_logit_diff=dict(max=float(diffs.max()), p99=float(np.quantile(diffs, 0.99)),
                                median=float(np.median(diffs))) if diffs.size else None,
        reference_top_logit=dict(median=float(np.median(tops)), max=float(tops.max())) if tops.size else None,
    )


def bf16_spacing(x: float) -> float:
    """The gap between consecutive bfloat16 values at magnitude x (8 significant bits)."""
    return float(2.0 ** (np.floor(np.log2(abs(x))) - 7)) if x else 0.0


def measure(models: dict, prompts, new_tokens: int, stop_token: int | None, margin: float) -> dict:
    """Generate with both dtypes, force each on the other's output, and summarize both directions."""
    t0 = time.perf_counter()
    outputs = generate_outputs(models, prompts, new_tokens, stop_token)
    t_gen = time.perf_counter() - t0
    directions, timings = {}, {"generate_s": t_gen}
    for ref_name, cand_name in (("float32", "bfloat16"), ("bfloat16", "float32")):
        t = time.perf_counter()
        forced = outputs[ref_name]
        paired = force_direction(models[ref_name], models[cand_name], prompts, forced, margin)
        key = f"{cand_name} forced on {ref_name} tokens"
        directions[key] = dict(reference=ref_name, candidate=cand_name,
                               **direction_summary(paired, forced, margin))
        timings[f"{key}_s"] = time.perf_counter() - t
    a, b = outputs["float32"], outputs["bfloat16"]
    differ = [i for i in range(len(prompts)) if not np.array_equal(a[i], b[i])]
    first = {i: int(np.flatnonzero(a[i] != b[i])[0]) for i in differ}
    return dict(margin=margin, stop_token=stop_token, num_prompts=len(prompts), new_tokens=new_tokens,
                generated={k: int((v >= 0).sum()) for k, v in outputs.items()},
                outputs_differ=dict(prompts=differ, first_divergence=first),
                directions=directions, timings=timings,
                failed=any(d["failures"] for d in directions.values()))


def format_summary(result: dict) -> str:
    m = result["margin"]
    lines = [f"near-ties, float32 vs bfloat16: {result['num_prompts']} prompts, up to {result['new_tokens']} "
             f"new tokens, stop token {result['stop_token']}; generated {result['generated']}; margin {m:g}",
             f"AR outputs differ in {len(result['outputs_differ']['prompts'])} prompts "
             f"(first divergence per prompt: {result['outputs_differ']['first_divergence']})"]
    for key, d in result["directions"].items():
        hist = ", ".join(f"{k}: {v}" for k, v in d["margin_histogram"].items())
        lines.append(f"[{key}] positions {d['positions']}, mismatches {d['mismatches']} "
                     f"({d['near_ties']} near-ties), reference self-mismatches "
                     f"{len(d['reference_self_mismatches'])}, non-finite {d['non_finite_positions']}, "
                     f"failures {len(d['failures'])}")
        lines.append(f"  reference margins at all positions: {hist}; smallest {d['reference_margin_min']:.4g}")
        if d["max_abs_logit_diff"]:
            diff, top = d["max_abs_logit_diff"], d["reference_top_logit"]
            lines.append(f"  |logit_{d['candidate']} - logit_{d['reference']}| (largest over the vocabulary, per "
                         f"position): max {diff['max']:.3f}, p99 {diff['p99']:.3f}, median {diff['median']:.3f}; "
                         f"top-1 logit median {top['median']:.2f} (bf16 step there "
                         f"{bf16_spacing(top['median']):g}), max {top['max']:.2f}")
        for r in d["mismatch_list"]:
            tag = "near-tie" if r["near_tie"] else "FAILURE"
            lines.append(f"  {tag}: prompt {r['prompt']} token {r['position']}: {d['reference']} "
                         f"{r['reference_token']} vs {d['candidate']} {r['candidate_token']}, reference "
                         f"margin {r['reference_margin']:.4g}, candidate margin {r['candidate_margin']:.4g}")
        for r in d["reference_self_mismatches"]:
            tag = "near-tie" if r["reference_margin"] < m else "FAILURE"
            lines.append(f"  {tag}, reference self-mismatch: prompt {r['prompt']} token {r['position']}: generated "
                         f"{r['generated_token']}, forced argmax {r['reference_choice']}, margin "
                         f"{r['reference_margin']:.4g}")
    for key, t in result["timings"].items():
        lines.append(f"time {key}: {t:.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    folder = Path(args.checkpoint)
    if not folder.is_dir():
        raise SystemExit(f"error: checkpoint folder {folder} does not exist")
    settings = bench_settings(args.prompts)
    for key, value in (("num_prompts", args.num_prompts), ("prompt_len", args.prompt_len),
                       ("new_tokens", args.new_tokens)):
        if value is not None:
            if value < 1:
                raise SystemExit(f"error: --{key.replace('_', '-')} must be at least 1, got {value}")
            settings[key] = value
    models, cfg = load_models(folder)
    prompts, notes = load_prompts(folder, settings)
    stop = None
    if not args.no_stop:
        stop = eos_token_id(folder)
        if stop is None:
            raise SystemExit(f"error: {folder} names no end-of-sequence token; pass --no-stop")
    result = measure(models, prompts, int(settings["new_tokens"]), stop, args.margin)
    result.update(command=" ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None
                                                                         else argv)]),
                  checkpoint=str(folder), prompt_settings=dict(settings), notes=notes,
                  wall_s=time.perf_counter() - t0)
    print(format_summary(result))
    print(f"wall time {result['wall_s']:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"report: {out}")
    if result["failed"]:
        n = sum(len(d["failures"]) for d in result["directions"].values())
        msg = (f"FAILURE: {n} mismatches at reference margins >= {args.margin:g} (or non-finite logits): not "
               f"explained by bf16 rounding; see the lines marked FAILURE above and {out}")
        print(msg)
        print(msg, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
