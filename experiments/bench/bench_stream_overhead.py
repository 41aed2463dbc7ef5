"""One stream's decode time, batch 1, greedy (and sampled with `--temperatures`), through run.py's stock (the harness's compiled loop), the
serving engine and the OpenAI server on loopback, on the same deployment, prompts and new-token count:
the engine's and the server's overhead over the harness. Compiles are excluded (each path runs once
first); every figure is a median over `--repeats` runs per prompt, the paths interleaved run by run.
Greedy tokens are checked equal to the harness's (sampled streams draw their own tokens, so only their
time is compared). docs/performance-engine.md has the measured table.

    PYTHONPATH=. python experiments/bench/bench_stream_overhead.py [--deployment "<run.py overrides>"]
        [--prompts 2] [--new-tokens 96] [--repeats 3] [--engines 1:0:off,1:0:auto,4:2048:auto] [--paths all]
        [--temperatures 0,0.7]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import statistics
import time

from experiments.bench.engine_setup import compose_config
from specpilot.decoding import spec
from specpilot.harness import bench, config_schema, deploy, devices
from specpilot.serving import Engine, Request
from specpilot.serving.driver import EngineDriver
from specpilot.serving.http_limits import ServerLimits
from specpilot.serving.openai_server import ServedModel, create_app, serve_in_thread

PATHS = ("harness", "engine", "server")
PREFILL_CHUNK = 32  # serve.py's default


def harness_stream(dep, plan, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """run.py's stock on one prompt (its while loop, its cache length) -> (decode ms/token, tokens)."""
    drafter, dparams = dep.drafter_for(plan)
    res = spec.generate(dep.target_for(plan), dep.params_for(plan), drafter, dparams, [prompt], new,
                        block_size=plan.block_size, sampling=dep.sampling, key=dep.key, cache_len=dep.cache_len)
    return 1e3 * res.decode_time_per_token, [int(t) for t in res.tokens[0][:new]]


def engine_stream(engine: Engine, prompt: list[int], new: int, temperature: float = 0.0) -> tuple[float, list[int]]:
    """One request through `engine.step()` -> (ms per token after its first, tokens)."""
    handle = engine.submit(Request(prompt, new, temperature=temperature))
    engine.run()
    return 1e3 * handle.tpot_s, list(handle.tokens)


def server_stream(port: int, model: str, prompt: list[int], new: int,
                  temperature: float = 0.0) -> tuple[float, list[int]]:
    """One streamed /v1/completions request on loopback -> (ms per token after the first chunk's, tokens),
    each chunk's tokens timed when the client reads it."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new, "temperature": temperature, "stream": True,
                       "return_token_ids": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"the server answered {reply.status}: {reply.read()[:200]!r}")
    tokens, first_n, first_s, last_s = [], 0, None, None
    for line in reply:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
        if ids:
            now = time.perf_counter()
            tokens += ids
            if first_s is None:
                first_s, first_n = now, len(ids)
            last_s = now
    conn.close()
    return 1e3 * (last_s - first_s) / max(1, len(tokens) - first_n), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployment", default="", help="run.py's config overrides (default: run.py's default)")
    ap.add_argument("--plan", default="stock")
    ap.add_argument("--prompts", type=int, default=2, help="the deployment's first N prompts")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="1:0:auto,4:2048:auto",
                    help="engines as SLOTS:CONTEXT:COMPACT, comma separated (CONTEXT 0: the context whose slots "
                         "equal the harness's cache length; COMPACT on, off or auto: Engine(compact=...))")
    ap.add_argument("--paths", default="all", help=f"comma list of {', '.join(PATHS)} (all)")
    ap.add_argument("--dispatch", default="", help="engine dispatch (sync|pipelined; default the plan's)")
    ap.add_argument("--temperatures", default="0", help="comma list of the engine's and server's request "
                    "temperatures (the harness runs the deployment's own sampling)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    paths = PATHS if args.paths == "all" else tuple(bench.comma_list(args.paths))
    cfg = compose_config(args.deployment, args.prompts, 1)
    devices.setup(cfg)
    plan = {p.name: p for p in config_schema.build_plans(cfg)}[args.plan]
    dep = deploy.build(cfg, [plan])
    prompts = [list(p) for p in dep.prompts[: args.prompts]]
    new = args.new_tokens
    temperatures = bench.comma_list(args.temperatures, float)
    sampled = any(t > 0 for t in temperatures)
    rows, reference = [], {}
    print(f"deployment {args.deployment or '(run.py default)'}, plan {plan.name} ({plan.describe()}), "
          f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {new} new tokens, harness cache "
          f"{dep.cache_len}, medians of {args.repeats}")

    runs: dict = {}  # (path, slots label, context) -> {prompt: a run's () -> (ms/token, tokens)}
    for i, p in enumerate(prompts):
        reference[i] = harness_stream(dep, plan, p, new)[1]
        if "harness" in paths:
            runs.setdefault(("harness", "1/loop", dep.cache_len, dep.sampling.temperature), {})[i] = \
                lambda p=p: harness_stream(dep, plan, p, new)
    servers = []
    for slots, context, compact in (e.split(":") for e in bench.comma_list(args.engines)):
        slots, context = int(slots), int(context) or dep.cache_len - max(PREFILL_CHUNK, plan.block_size)
        batching = plan.batching if not args.dispatch else dataclasses.replace(plan.batching, dispatch=args.dispatch)

        def make(compact=compact, slots=slots, context=context, batching=batching):
            return Engine.from_plan(dep, plan, slots=slots, context_len=context, prefill_chunk=PREFILL_CHUNK,
                                    sampling=sampled, batching=batching,
                                    compact={"on": True, "off": False, "auto": None}[compact])

        engine = make()  # the server's driver thread owns an engine of its own
        label = f"{slots}/{'compact' if engine.compact else 'plain'}"
        for temp in temperatures if "engine" in paths else ():
            runs[("engine", label, context, temp)] = {
                i: lambda p=p, e=engine, t=temp: engine_stream(e, p, new, t) for i, p in enumerate(prompts)}
        if "server" in paths:
            driver = EngineDriver(make()).start()
            served = ServedModel("bench", dep.tokenizer, dep.chat_template, None, context, sampling=sampled)
            server, thread, port = serve_in_thread(create_app(driver, served, ServerLimits()))
            servers.append((server, thread, driver))
            for temp in temperatures:
                runs[("server", label, context, temp)] = {
                    i: lambda p=p, port=port, t=temp: server_stream(port, "bench", p, new, t)
                    for i, p in enumerate(prompts)}
    times: dict = {}
    try:
        for key, by_prompt in runs.items():  # a first run compiles and warms what each path calls
            for i, fn in by_prompt.items():
                t0 = time.perf_counter()
                fn()
                print(f"  first run {key[0]:8s} slots={key[1]:10s} T={key[3]:g} prompt {i}: "
                      f"{time.perf_counter() - t0:.1f} s")
        for _ in range(args.repeats):  # paths interleaved: drift on a shared machine hits each alike
            for key, by_prompt in runs.items():
                for i, fn in by_prompt.items():
                    ms, tokens = fn()
                    times.setdefault((key, i), []).append(ms)
                    if key[0] != "harness" and key[3] == 0 == dep.sampling.temperature and tokens != reference[i]:
                        raise SystemExit(f"{key[0]} {key[1]} prompt {i}: tokens differ from the harness's")
    finally:
        for server, thread, driver in servers:
            server.should_exit = True
            thread.join(10)
            driver.stop()
    for (key, i), ms in times.items():
        rows.append({"path": key[0], "slots": key[1], "context": key[2], "temperature": key[3], "prompt": i,
                     "ms_per_token": statistics.median(ms), "runs_ms": ms})
        print(f"  {key[0]:8s} slots={key[1]:10s} context={key[2]!s:5s} T={key[3]:g} prompt {i}: {statistics.median(ms):7.2f} "
              f"ms/token (runs {', '.join(f'{m:.1f}' for m in ms)})")
    print("every greedy engine and server stream emitted the harness's tokens")
    print("\nmedian over prompts (ms/token):")
    base = statistics.median(r["ms_per_token"] for r in rows if r["path"] == "harness") if "harness" in paths \
        else None
    fields = ("path", "slots", "context", "temperature")
    keys = sorted({tuple(r[f] for f in fields) for r in rows}, key=lambda k: (PATHS.index(k[0]), k[1:]))
    for path, slots, context, temp in keys:
        ms = statistics.median(r["ms_per_token"] for r in rows if tuple(r[f] for f in fields)
                               == (path, slots, context, temp))
        rel = f"  {ms / base:.2f}x harness" if base else ""
        print(f"  {path:8s} slots={slots!s:10s} context={context!s:5s} T={temp:<4g} {ms:7.2f}{rel}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
