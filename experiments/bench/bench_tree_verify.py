"""Tree verification's step cost against node count: one target forward over N tree nodes, XLA vs the
Pallas tree kernels, at the Qwen3-8B shape and the Qwen3.5-27B hybrid shape (random weights).

    PYTHONPATH=. python3 experiments/bench/bench_tree_verify.py --shapes qwen3_8b --out tree_8b.csv       # GPU
    PYTHONPATH=. python3 experiments/bench/bench_tree_verify.py --shapes qwen3_5_27b --layers 16 --out t27.csv
    PYTHONPATH=. python3 experiments/bench/bench_tree_verify.py --smoke --out /tmp/tree.csv               # CPU

Design notes: docs/design/bench.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf

from pallas_kernels import dispatch
from specpilot.harness import bench
from specpilot import state as st
from specpilot.decoding.token_tree import build_tree, max_nodes
from specpilot.models import dense, hybrid
from specpilot.models.config import ModelConfig
from specpilot.models.hybrid_config import HybridConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "target"
SHAPES = {"qwen3_8b": "qwen3_8b.yaml", "qwen3_5_27b": "qwen3_5_27b.yaml",  # conf/target files
          "tiny_dense": "tiny_random.yaml", "tiny_hybrid": "tiny_hybrid.yaml"}
# the tree ops each implementation runs through a Pallas kernel (falling through to XLA where it cannot)
KERNEL_OPS = tuple(op for op in ("tree_attention", "tree_gated_delta_rule") if op in dispatch.CONFIGS)
IMPLS = ("xla", "triton") + KERNEL_OPS  # an op's name: that op alone through its kernel
CSV_FIELDS = ("shape", "layers", "batch", "context", "cache_len", "nodes", "depth", "branching", "impl", "ops", "config",
              "ms_median", "ms_min", "x_vs_xla", "max_abs_diff_logits", "argmax_agree", "compile_s", "calls",
              "trials", "device", "jax")


def load_shape(name: str, layers: int | None, dtype: str):
    """(config, dtype) of a named shape from its conf/target file; `layers` truncates the stack."""
    hf = OmegaConf.to_container(OmegaConf.load(CONF / SHAPES[name]).model, resolve=True)
    if layers is not None:
        hf["num_hidden_layers"] = layers
    is_hybrid = hf.get("model_type") == "qwen3_5_text"
    cfg = (HybridConfig if is_hybrid else ModelConfig).from_hf_dict(hf)
    return cfg, jnp.dtype(dtype)


def init_params(cfg, dtype, seed: int = 0):
    """Random weights on the device: the dense shapes through bench_ar's one-layer initializer (one compile,
    never on the host), hybrids through `hybrid.init`."""
    if isinstance(cfg, HybridConfig):
        return jax.block_until_ready(hybrid.init(jax.random.key(seed), cfg, dtype))

    return bench.init_params_on_device(cfg, jax.random.key(seed), dtype)


def kernel_ops(cfg, impl: str) -> tuple[str, ...]:
    """The tree ops `impl` runs through their kernels on this target (a dense one has no recurrence)."""
    ops = KERNEL_OPS if impl == "triton" else () if impl == "xla" else (impl,)
    return tuple(op for op in ops if hasattr(cfg, op))


def make_target(cfg, dtype, nodes: int, impl: str, interpret: bool, configs: dict | None = None):
    """The target with `impl`'s op choices in its config (hybrids keep one snapshot per node). `configs`:
    op -> kernel settings (`--config`)."""
    choices = {}
    for op in kernel_ops(cfg, impl):
        settings = dict((configs or {}).get(op, {}), interpret=interpret)
        choices[op] = dispatch.choice(op, ("triton", "xla"), settings)
    cfg = dataclasses.replace(cfg, **choices)
    if isinstance(cfg, HybridConfig):
        return hybrid.target(cfg, dtype, max_block_size=nodes)
    return dense.target(cfg, dtype)


@jax.jit
def _fill(state, seed, lengths):
    # values in [-0.5, 0.5] from a sine of the index: as good as random draws for timing, and an
    # elementwise fusion compiles in a fraction of the time of one normal draw per leaf
    leaves, tree = jax.tree.flatten(state.layers)
    leaves = [(0.5 * jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) * 12.9898 + seed + j))
              .astype(x.dtype) for j, x in enumerate(leaves)]
    return st.TargetState(jax.tree.unflatten(tree, leaves), lengths)


def random_state(target, batch: int, cache_len: int, context: int, seed: int):
    """The target's state with `context` committed slots of pseudo-random K/V and recurrent states (scale
    0.5), made on the device; a fresh one per row (the timed forward donates it)."""
    shapes = jax.eval_shape(lambda: target.init_state(batch, cache_len))
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    return _fill(zeros, jnp.float32(seed), jnp.full((batch,), context, jnp.int32))


def random_tree(batch: int, nodes: int, depth: int, branching: int, vocab: int, seed: int):
    """A drafted tree as the decoding loop builds it (`build_tree` over random draft log-probabilities)."""
    key = jax.random.key(seed)
    logits = 4.0 * jax.random.normal(key, (batch, depth, vocab), jnp.float32)
    root = jax.random.randint(jax.random.fold_in(key, 1), (batch,), 0, vocab, jnp.int32)
    return jax.jit(build_tree, static_argnums=(2, 3, 4))(jax.nn.log_softmax(logits, axis=-1), root, nodes, depth,
                                                          branching)


def verify_fn(target):
    """The verification forward of `tree.verify_phase`, jitted with the state donated -> (logits, state)."""

    def verify(params, state, tree):
        positions = state.lengths[:, None] + tree.depths
        logits, _, state = target.forward(params, tree.tokens, positions, state,
                                          st.tree_mask(state, tree.ancestors), parents=tree.parents)
        return logits, state

    return jax.jit(verify, donate_argnums=1)


def time_rows(fn, params, state, tree, calls: int, trials: int) -> tuple[list[float], object, object]:
    """(ms per call of each pass, the first call's logits, the state) — calls back to back, one sync."""
    logits, state = fn(params, state, tree)
    first = logits
    jax.block_until_ready(state)
    passes = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            logits, state = fn(params, state, tree)
        jax.block_until_ready(logits)
        passes.append(1e3 * (time.perf_counter() - t0) / calls)
    return passes, first, state


class Budget:
    """Stops starting rows past `seconds` from construction; estimates a row by the shape's last one."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.last = time.monotonic(), seconds, 0.0

    def allows(self) -> bool:
        return time.monotonic() - self.start + 1.2 * self.last < self.seconds


def bench_shape(name: str, args, interpret: bool, budget: Budget, emit) -> None:
    cfg, dtype = load_shape(name, args.layers, args.dtype)
    t0 = time.perf_counter()
    params = init_params(cfg, dtype)
    print(f"{name}: {cfg.num_layers} layers, params made in {time.perf_counter() - t0:.1f} s", flush=True)
    dev = jax.devices()[0]
    for nodes in args.nodes:
        depth = min(args.depth, nodes - 1)
        if nodes > max_nodes(depth, args.branching):
            raise SystemExit(f"{nodes} nodes exceed a full tree of depth {depth}, branching {args.branching}")
        tree = random_tree(args.batch, nodes, depth, args.branching, cfg.vocab_size, seed=nodes)
        want = None
        for impl in args.impls:
            if not budget.allows():
                print(f"  {name} N={nodes} {impl}: skipped (the --budget-s {args.budget_s:.0f} s would pass)",
                      flush=True)
                continue
            row_start = time.monotonic()
            ops = kernel_ops(cfg, impl)
            if impl not in ("xla", "triton") and not ops:
                continue  # an op this target does not have
            target = make_target(cfg, dtype, nodes, impl, interpret, args.configs)
            fn = verify_fn(target)
            state = random_state(target, args.batch, args.cache_len, args.context, seed=1)
            t0 = time.perf_counter()
            fn = fn.lower(params, state, tree).compile()
            compile_s = time.perf_counter() - t0
            passes, logits, state = time_rows(fn, params, state, tree, args.calls, args.trials)
            del state
            row = dict(shape=name, layers=cfg.num_layers, batch=args.batch, context=args.context,
                       cache_len=args.cache_len, nodes=nodes, depth=depth, branching=args.branching, impl=impl,
                       ops="+".join(ops), config=";".join(f"{op}.{k}={v}" for op in ops
                                                           for k, v in args.configs.get(op, {}).items()),
                       ms_median=statistics.median(passes),
                       ms_min=min(passes), compile_s=compile_s, calls=args.calls, trials=args.trials,
                       device=f"{dev.platform}:{getattr(dev, 'device_kind', '')}", jax=jax.__version__)
            if impl == "xla":
                want, want_ms = logits, row["ms_median"]
            elif want is not None:
                row["x_vs_xla"] = want_ms / row["ms_median"]
                row["max_abs_diff_logits"] = float(jnp.max(jnp.abs(logits - want)))
                row["argmax_agree"] = float(jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(want, -1)))
            budget.last = time.monotonic() - row_start
            emit(row)
    del params


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)} (default qwen3_8b,qwen3_5_27b; smoke "
                                    "tiny_dense,tiny_hybrid)")
    p.add_argument("--nodes", help="tree node counts (default 16,32,64,128; smoke 8)")
    p.add_argument("--impls", default="xla,triton", help=f"comma list of {', '.join(IMPLS)} (default xla,triton)")
    p.add_argument("--layers", type=int, help="truncate the stack to this many layers (default: the shape's; "
                                              "smoke 2)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, help="committed slots (default 1024; smoke 24)")
    p.add_argument("--cache-len", type=int, help="cache slots (default 2048; smoke 64)")
    p.add_argument("--depth", type=int, default=8, help="deepest node (capped at nodes - 1)")
    p.add_argument("--branching", type=int, default=4)
    p.add_argument("--dtype", help="activations and weights (default bfloat16; smoke float32)")
    p.add_argument("--calls", type=int, help="forwards per timed pass (default 10; smoke 1)")
    p.add_argument("--trials", type=int, help="timed passes, the median reported (default 5; smoke 1)")
    p.add_argument("--config", action="append", default=[], metavar="OP.KEY=VALUE",
                   help="a kernel setting, e.g. tree_attention.splits=16 (repeatable; integers)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no row that would end past this")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (any backend)")
    p.add_argument("--out", help="CSV path for the rows")
    args = p.parse_args(argv)
    defaults = (dict(shapes="tiny_dense,tiny_hybrid", nodes="8", layers=2, context=24, cache_len=64,
                     dtype="float32", calls=1, trials=1) if args.smoke else
                dict(shapes="qwen3_8b,qwen3_5_27b", nodes="16,32,64,128", layers=None, context=1024,
                     cache_len=2048, dtype="bfloat16", calls=10, trials=5))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shapes = args.shapes.split(",")
    args.nodes = [int(n) for n in args.nodes.split(",")]
    args.impls = args.impls.split(",")
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: unknown shape {s!r}; known: {', '.join(SHAPES)}")
    for i in args.impls:
        if i not in IMPLS:
            p.error(f"--impls: unknown implementation {i!r}; known: {', '.join(IMPLS)}")
    args.configs = {}
    for item in args.config:
        op, _, rest = item.partition(".")
        key, _, value = rest.partition("=")
        if op not in KERNEL_OPS or not key or not value.lstrip("-").isdigit():
            p.error(f"--config: {item!r} is not OP.KEY=INTEGER with OP one of {', '.join(KERNEL_OPS)}")
        args.configs.setdefault(op, {})[key] = int(value)
    for op, settings in args.configs.items():
        try:
            dispatch.choice(op, "triton", settings)
        except ValueError as e:
            p.error(f"--config: {e}")
    if min(args.nodes) < 2:
        p.error("--nodes: a tree has the root and >= 1 drafted node")
    if args.context + max(args.nodes) > args.cache_len:
        p.error(f"--context {args.context} + {max(args.nodes)} nodes exceed --cache-len {args.cache_len}")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    dev = jax.devices()[0]
    print(f"device {dev.platform}:{getattr(dev, 'device_kind', '')}, jax {jax.__version__}, batch {args.batch}, "
          f"context {args.context} of {args.cache_len} slots, tree depth <= {args.depth} branching "
          f"{args.branching}, kernel ops {', '.join(KERNEL_OPS)}" + (" (interpreted)" if interpret else ""),
          flush=True)
    print(f"{'shape':<12}{'L':>4}{'N':>5} {'impl':<22}{'ms':>9}{'min':>9}{'x xla':>7}{'diff':>10}{'agree':>7}"
          f"{'compile s':>10}", flush=True)
    rows: list[dict] = []

    def emit(row):
        rows.append(row)
        speed = f"{row['x_vs_xla']:>7.2f}" if "x_vs_xla" in row else f"{'':>7}"
        diff = (f"{row['max_abs_diff_logits']:>10.2e}{row['argmax_agree']:>7.3f}" if "max_abs_diff_logits" in row
                else f"{'':>17}")
        print(f"{row['shape']:<12}{row['layers']:>4}{row['nodes']:>5} {row['impl']:<22}{row['ms_median']:>9.3f}"
              f"{row['ms_min']:>9.3f}{speed}{diff}{row['compile_s']:>10.1f}", flush=True)
        if args.out:
            with open(args.out, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
                w.writeheader()
                w.writerows(rows)

    budget = Budget(args.budget_s)
    for name in args.shapes:
        bench_shape(name, args, interpret, budget, emit)
    if args.out:
        print(f"wrote {len(rows)} rows to {args.out}")
    return rows


if __name__ == "__main__":
    main()
