"""Kernel variants: source modules with an op's signature (`matmul(x, w)`, `gated_delta_rule(q, k, v, g,
beta, s0)`), named by their digest, statically checked, loaded into the dispatch and checked against the
op's pure-jnp reference at a deployment's shapes. The optimization loop proposes them and a run that
names one loads it (`plan_variants`). Design notes: docs/design/harness.md.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels.gated_delta_rule import gated_delta_rule_reference
from specpilot.formats import w12 as w12_format

OPS = ("matmul", "gated_delta_rule")
SIGNATURES = {"matmul": ("x", "w"), "gated_delta_rule": ("q", "k", "v", "g", "beta", "s0")}
ALLOWED_IMPORTS = ("jax", "jaxlib", "numpy", "math", "functools", "itertools", "operator", "dataclasses",
                   "typing", "time", "__future__", "pallas_kernels", "specpilot.formats")
FORBIDDEN_NAMES = ("open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "breakpoint",
                   "input", "getattr", "setattr", "delattr", "memoryview", "exit", "quit")
GDR_ATOL = GDR_RTOL = 1e-5
UNIT_ROUNDOFF = 2.0 ** -24


class VariantRejected(Exception):
    """A variant that cannot run in a plan: its source, its import, or its answers (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    op: str
    source: str

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"a kernel variant is of one of {OPS}, got {self.op!r}")

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.op}\n{self.source}".encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        return f"variant:{self.digest}"

    def write(self, sandbox: str | Path) -> Path:
        """The module file in `sandbox` (created), named by its digest."""
        folder = Path(sandbox)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.digest}.py"
        path.write_text(self.source)
        return path

    def spec_entry(self, sandbox: str | Path) -> dict:
        """What a candidate spec carries of it: the op, the name, the module's path."""
        return {"op": self.op, "name": self.name, "path": str(self.write(sandbox))}


def static_check(op: str, source: str) -> None:
    """VariantRejected unless `source` parses, defines `op`'s function and stays to the allowed modules."""
    if not source or not source.strip():
        raise VariantRejected("empty source")
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise VariantRejected(f"does not parse: line {e.lineno}: {e.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise VariantRejected(f"line {node.lineno}: relative import")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if not any(name == a or name.startswith(a + ".") for a in ALLOWED_IMPORTS):
                    raise VariantRejected(f"line {node.lineno}: imports {name!r}, which a kernel variant may "
                                          f"not (allowed: {', '.join(ALLOWED_IMPORTS)})")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            raise VariantRejected(f"line {node.lineno}: uses {node.id!r}, which a kernel variant may not")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__") and node.attr.endswith("__"):
            raise VariantRejected(f"line {node.lineno}: touches the attribute {node.attr!r}")
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if op not in funcs:
        raise VariantRejected(f"defines no top-level function {op}({', '.join(SIGNATURES[op])})")
    args = funcs[op].args
    n_positional = len(args.posonlyargs) + len(args.args)
    if args.vararg is None and (n_positional < len(SIGNATURES[op])
                                or n_positional - len(args.defaults) > len(SIGNATURES[op])):
        raise VariantRejected(f"{op} must take ({', '.join(SIGNATURES[op])}), got {n_positional} positional "
                              f"parameter(s)")


def load(op: str, name: str, path: str | Path):
    """The function of the variant module at `path` (after `static_check`), registered with the dispatch."""
    path = Path(path)
    source = path.read_text()
    static_check(op, source)
    if Variant(op, source).name != name:
        raise VariantRejected(f"{path.name}: its source is not variant {name}")
    module_name = f"specpilot_variant_{name.split(':')[1]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    except Exception as e:  # the variant's own code: anything it raises rejects it
        raise VariantRejected(f"raised on import: {type(e).__name__}: {e}") from None
    fn = getattr(module, op, None)
    if not callable(fn):
        raise VariantRejected(f"its module has no callable {op}")
    dispatch.register_variant(op, name, fn)
    return fn


# ---- reference checks --------------------------------------------------------------------------------

def check_shapes(model_cfg, batch_size: int, block_size: int, weights: str = "bf16") -> dict:
    """The shapes a deployment's variants are checked at: matmul [M, K, N] for the MLP's two products
    (M = batch x block rows), gated_delta_rule [B, T, H, DK, DV] for a hybrid's linear layers."""
    m = int(batch_size) * int(block_size)
    h, i = model_cfg.hidden_size, model_cfg.intermediate_size
    out = {"weights": weights, "matmul": [[m, h, i], [m, i, h]]}
    if getattr(model_cfg, "linear_num_value_heads", None):
        out["gated_delta_rule"] = [[int(batch_size), int(block_size), model_cfg.linear_num_value_heads,
                                    model_cfg.linear_key_head_dim, model_cfg.linear_value_head_dim]]
    return out


def _first_bad(got, want, tol, what: str, draw: int) -> str | None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"draw {draw}: {what} has shape {got.shape}, the reference's is {want.shape}"
    bad = ~(np.abs(got - want) <= tol)  # NaN is bad
    if not bad.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    t = tol[idx] if np.ndim(tol) else tol
    return (f"draw {draw}: {what} wrong at {list(idx)} ({int(bad.sum())} of {bad.size} elements): "
            f"{got[idx]!r} vs the reference's {want[idx]!r} (tolerance {float(t):.3g})")


def _matmul_case(rng, m: int, k: int, n: int, weights: str):
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.bfloat16)
    x = rng.normal(size=(m, k))
    onehot = rng.permutation(m)[: max(1, m // 2)]  # these rows of x select one row of W each
    picks = rng.integers(0, k, size=onehot.size)
    x[onehot] = 0.0
    x[onehot, picks] = 1.0
    x = jnp.asarray(x, jnp.bfloat16)
    wx = jax.tree.map(jnp.asarray, w12_format.encode(np.asarray(w))) if weights == "w12" else w
    ref = np.asarray(jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32), np.float64)
    tol = 2 * k * UNIT_ROUNDOFF * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    tol[onehot] = 0.0  # exact
    ref[onehot] = np.asarray(w, np.float64)[picks]
    return (x, wx), [ref], [tol], ["y"]


def _gdr_case(rng, b: int, t: int, h: int, dk: int, dv: int):
    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    q = unit(rng.normal(size=(b, t, h, dk))) * dk ** -0.5
    kk = unit(rng.normal(size=(b, t, h, dk)))
    args = tuple(jnp.asarray(a, jnp.float32) for a in (
        q, kk, rng.normal(size=(b, t, h, dv)), -rng.uniform(0.0, 0.5, size=(b, t, h)),
        rng.uniform(0.0, 1.0, size=(b, t, h)), rng.normal(size=(b, h, dk, dv))))
    refs = [np.asarray(r, np.float64) for r in gated_delta_rule_reference(*args)]
    return args, refs, [GDR_ATOL + GDR_RTOL * np.abs(r) for r in refs], ["o", "states"]


def check(op: str, fn, shapes: dict, seed: int, draws: int = 2) -> dict:
    """VariantRejected unless `fn` (a variant of `op`) agrees with the op's reference within the written
    tolerance on `draws` fresh draws at each of `shapes[op]` (`check_shapes`); eagerly, and under jit on
    the last draw. Returns what was checked."""
    cases = shapes.get(op) or []
    if not cases:
        raise VariantRejected(f"the deployment has no {op} to check a variant of")
    rng = np.random.default_rng(int(seed))
    checked = 0
    for shape in cases:
        for draw in range(draws):
            if op == "matmul":
                args, refs, tols, names = _matmul_case(rng, *shape, shapes.get("weights", "bf16"))
            else:
                args, refs, tols, names = _gdr_case(rng, *shape)
            calls = [("eager", fn)] + ([("jit", jax.jit(fn))] if draw == draws - 1 else [])
            for how, f in calls:
                try:
                    got = jax.block_until_ready(f(*args))
                except NotImplementedError as e:
                    raise VariantRejected(f"declines the deployment's shape {shape} ({how}): {e}") from None
                except Exception as e:  # the variant's own code
                    raise VariantRejected(f"raised at shape {shape} ({how}): {type(e).__name__}: {e}") from None
                outs = [got] if op == "matmul" else list(got) if isinstance(got, (tuple, list)) else [got]
                if len(outs) != len(refs):
                    raise VariantRejected(f"returned {len(outs)} array(s), {op} returns {len(refs)}")
                for out, ref, tol, what in zip(outs, refs, tols, names):
                    why = _first_bad(out, ref, tol, f"{what} at shape {shape} ({how})", draw)
                    if why:
                        raise VariantRejected(why)
                checked += 1
    return {"op": op, "shapes": cases, "draws": draws, "calls": checked}


def load_and_check(entries: list[dict], shapes: dict, seed: int) -> list[dict]:
    """Every spec entry (`Variant.spec_entry`) loaded, registered and checked; VariantRejected names the
    first variant that fails."""
    out = []
    for i, e in enumerate(entries):
        try:
            fn = load(e["op"], e["name"], e["path"])
            out.append({"name": e["name"], **check(e["op"], fn, shapes, int(seed) + i)})
        except VariantRejected as err:
            raise VariantRejected(f"{e['name']} ({e['op']}): {err}") from None
    return out
