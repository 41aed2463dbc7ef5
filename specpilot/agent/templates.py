"""Template expansion: kernel variants written as complete source modules from the Pallas kernels'
templates (gated delta rule, W12 / bf16-twin matmul) with their tilings, warps, stages and loop schedule
as constants, so what is timed is exactly what the sandbox file says. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import itertools
import string

from specpilot.harness.kernel_variants import Variant

GDR_TEMPLATE = '''"""gated_delta_rule, template expansion of pallas_kernels.gated_delta_rule: block_v=$block_v,
num_warps=$num_warps, num_stages=$num_stages, unroll=$unroll."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_V, NUM_WARPS, NUM_STAGES, UNROLL = $block_v, $num_warps, $num_stages, $unroll


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, states_ref):
    # q_ref, k_ref: [T, DK]; v_ref: [T, BV]; g_ref, beta_ref: [T]; s0_ref: [DK, BV]; o_ref: [T, BV];
    # states_ref: [T, DK, BV]
    def step(t, s):
        k_t = k_ref[t, :][:, None]
        s = s * jnp.exp(g_ref[t])
        predicted = jnp.sum(s * k_t, axis=0)
        s = s + k_t * (beta_ref[t] * (v_ref[t, :] - predicted))[None, :]
        o_ref[t, :] = jnp.sum(s * q_ref[t, :][:, None], axis=0)
        states_ref[t, :, :] = s
        return s

    jax.lax.fori_loop(0, q_ref.shape[0], step, s0_ref[...], unroll=min(UNROLL, q_ref.shape[0]))


def _pow2(n):
    return n > 0 and n & (n - 1) == 0


def gated_delta_rule(q, k, v, g, beta, s0):
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    bv = min(BLOCK_V, dv)
    if not (_pow2(dk) and _pow2(dv)) or dv % bv:
        raise NotImplementedError(f"power-of-two head dims divisible by {bv}, got DK {dk}, DV {dv}")
    if {x.dtype for x in (q, k, v, g, beta, s0)} != {jnp.dtype(jnp.float32)}:
        raise NotImplementedError("float32 inputs only")
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        raise NotImplementedError(f"a Triton-backend kernel, not {backend}")

    def per_token(width, block):
        return pl.BlockSpec((None, t, None, width), lambda i, j: (i // h, 0, i % h, block(j)))

    keys, values = per_token(dk, lambda j: 0), per_token(bv, lambda j: j)
    scalars = pl.BlockSpec((None, t, None), lambda i, j: (i // h, 0, i % h))
    return pl.pallas_call(
        _kernel,
        grid=(b * h, dv // bv),
        in_specs=[keys, keys, values, scalars, scalars,
                  pl.BlockSpec((None, None, dk, bv), lambda i, j: (i // h, i % h, 0, j))],
        out_specs=[values, pl.BlockSpec((None, t, None, dk, bv), lambda i, j: (i // h, 0, i % h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=backend == "cpu",
    )(q, k, v, g, beta, s0)
'''

MATMUL_TEMPLATE = '''"""matmul, template expansion of pallas_kernels.w12_matmul (W12 weights, and the bf16 twin for bf16
ones): blocks = the shape's defaults with $overrides, swapped=$swapped."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels import w12_matmul as kernel
from specpilot.formats.w12 import W12

OVERRIDES = $overrides
SWAPPED = $swapped


def matmul(x, w):
    k, n = w.shape
    m = math.prod(x.shape[:-1])
    if x.dtype != jnp.bfloat16 or not (isinstance(w, W12) or (isinstance(w, jax.Array) and w.dtype == jnp.bfloat16)):
        raise NotImplementedError("bf16 activations times W12 or bf16 weights")
    blocks = dataclasses.replace(kernel.default_blocks(k, n, m=m), **OVERRIDES)
    try:
        kernel.check_blocks(k, n, blocks)
    except ValueError as e:
        raise NotImplementedError(str(e)) from None
    config = kernel.W12TritonConfig(blocks=blocks, swapped=SWAPPED)
    if isinstance(w, W12):
        return kernel.w12_matmul(x, w, config)
    return kernel.bf16_matmul(x, w, config)
'''

# each knob's values, the kernel's default first
GDR_KNOBS = {"block_v": (32, 16, 64), "num_warps": (4, 2, 8), "num_stages": (1, 2), "unroll": (1, 2, 4)}
MATMUL_KNOBS = {"block_n": (128, 64, 256), "block_k": (32, 64), "num_warps": (4, 8), "num_stages": (3, 2, 4),
                "prefetch": (True, False), "exceptions": ("loop", "branch"), "swapped": (False, True)}


def source(op: str, knobs: dict) -> str:
    """The module of `op`'s template at `knobs` (every knob given)."""
    if op == "gated_delta_rule":
        missing = set(GDR_KNOBS) - set(knobs)
        if missing:
            raise ValueError(f"gated_delta_rule template: missing knob(s) {sorted(missing)}")
        return string.Template(GDR_TEMPLATE).substitute({k: int(knobs[k]) for k in GDR_KNOBS})
    if op == "matmul":
        unknown = set(knobs) - set(MATMUL_KNOBS)
        if unknown:
            raise ValueError(f"matmul template: unknown knob(s) {sorted(unknown)}; known: {sorted(MATMUL_KNOBS)}")
        overrides = {k: v for k, v in knobs.items() if k != "swapped"}
        return string.Template(MATMUL_TEMPLATE).substitute(overrides=repr(dict(sorted(overrides.items()))),
                                                           swapped=bool(knobs.get("swapped", False)))
    raise ValueError(f"no template for op {op!r}")


def expansions(op: str):
    """(knobs, Variant) of `op`'s template: one knob off its default at a time, then two."""
    table = GDR_KNOBS if op == "gated_delta_rule" else MATMUL_KNOBS
    default = {k: v[0] for k, v in table.items()}
    for width in (1, 2):
        for names in itertools.combinations(table, width):
            for values in itertools.product(*(table[n][1:] for n in names)):
                knobs = {**default, **dict(zip(names, values))}
                shown = knobs if op == "gated_delta_rule" else dict(zip(names, values))
                yield dict(zip(names, values)), Variant(op, source(op, shown))
