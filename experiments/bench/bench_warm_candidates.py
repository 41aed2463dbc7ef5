"""What a plan-only candidate costs the optimization loop, each in a fresh process against the warm worker:
the same specs (the incumbent and plan rewrites of it) through the evaluator, cold, then warm for two
rounds (the second finds the deployment and the incumbent's compiles kept), with every candidate's tokens
compared across the modes.

    PYTHONPATH=. python experiments/bench/bench_warm_candidates.py
    PYTHONPATH=. python experiments/bench/bench_warm_candidates.py --deployment "experiment=stock_qwen3_8b_h200" \
        --candidates "block_size=8;block_size=12;verify=ar" --sandbox none
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specpilot.agent import evaluator as ev
from specpilot.agent import space as sp
from specpilot.agent.gate import Gate
from specpilot.harness import config_schema, devices

CONF = Path(__file__).resolve().parents[2] / "conf"
DEFAULT_CANDIDATES = "block_size=2;block_size=3;block_size=5;block_size=6;block_size=8;verify=ar;" \
                     "batching.dispatch=sync;block_size=7"


def rewrite(text: str) -> dict:
    """The loop's dotted rewrite of "block_size=8,batching.dispatch=sync" (values as JSON where they parse)."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployment", default="", help="run.py overrides (default: the default deployment)")
    ap.add_argument("--candidates", default=DEFAULT_CANDIDATES, help="';'-separated rewrites of the incumbent")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--sandbox", default="bwrap")
    ap.add_argument("--workdir", default=None,
                    help="keep the candidates' and warm workers' folders (stderr.txt) here (default: a temporary "
                         "folder)")
    ap.add_argument("--modes", default="cold,warm,warm", help="evaluator modes in order (warm twice: two rounds)")
    args = ap.parse_args(argv)
    devices.share_gpu_memory()  # this process (the gate) and the candidates' share the GPU

    config_schema.register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=shlex.split(args.deployment)
                      + [f"bench.new_tokens={args.new_tokens}"])
    cfg = config_schema.typed(cfg)
    plans = OmegaConf.to_container(cfg.decoding.plans, resolve=True)
    incumbent = next(iter(plans.values()))
    gate = Gate(cfg, heldout=max(4, args.prompts), prompts_per_round=args.prompts, secret=0)
    prompts = gate.draw(0)
    config = OmegaConf.to_container(cfg, resolve=True)
    changes = [rewrite(c) for c in args.candidates.split(";") if c.strip()]

    def specs(tag: str) -> list[dict]:
        named = [("incumbent", incumbent)] + [(f"c{i}", sp.apply(incumbent, c)) for i, c in enumerate(changes)]
        return [{"name": f"{tag}-{n}", "fields": f, "config": config, "prompts": prompts,
                 "new_tokens": args.new_tokens, "repeats": args.repeats, "stage": "full",
                 "compile_cache": str(Path(cfg.cache_dir).expanduser() / "xla"), "workload": "harness",
                 "profile": n == "incumbent"}  # as the loop asks: the stage split for the incumbent only
                for n, f in named]

    print(f"incumbent {json.dumps(incumbent)}; candidates {json.dumps(changes)}", flush=True)
    tokens: dict[str, list] = {}
    with (contextlib.nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory(prefix="bench-warm-")) \
            as work, ev.Evaluator(1, timeout_s=args.timeout, memory_mb=None, workdir=work, sandbox=args.sandbox) as e:
        for r, mode in enumerate(args.modes.split(",")):
            batch = specs(f"r{r}")
            t0 = time.perf_counter()
            results = e.evaluate(batch, warm=mode == "warm")
            wall = time.perf_counter() - t0
            ok = [x for x in results if x["status"] == "ok"]
            start = results[0].get("worker_start_s") if mode == "warm" else None
            print(f"\n{mode} (round {r}): {len(batch)} specs in {wall:.1f} s, {wall / len(batch):.1f} s per spec; "
                  f"{len(ok)} ok" + (f"; the warm worker started in {start:.1f} s" if start else ""), flush=True)
            print("| spec | rewrite | ready s | timed runs s | ms/token | compiles while timed | tokens as cold |")
            print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
            for spec, res in zip(batch, results):
                short = spec["name"].split("-", 1)[1]
                if res["status"] != "ok":
                    print(f"| {short} | | {res['status']}: {res.get('reason', '')[:80]} | | | | |")
                    continue
                same = tokens.setdefault(short, res["tokens"][0]) == res["tokens"][0]
                ch = "incumbent" if short == "incumbent" else json.dumps(changes[int(short[1:])])
                print(f"| {short} | {ch} | {res.get('ready_s', float('nan')):.1f} | {sum(res['wall_s']):.1f} | "
                      f"{1e3 * res['s_per_token']:.2f} | {res.get('timed_compiles', '-')} | {'yes' if same else 'NO'} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
