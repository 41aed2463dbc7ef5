"""L2 prefetch of a step's next weights while its small kernels run (Mosaic GPU, Hopper).

At batch 1 a decode step alternates weight products, which keep the DRAM busy, with small kernels (norms,
RoPE, the cache writes, attention over a short context), which leave it nearly idle: about a quarter of an
8B model's step on the H200. `prefetch_l2` launches one small kernel that issues TMA L2 prefetches
(`cp.async.bulk.prefetch.tensor`) of some of a coming product's weight bytes and returns at once; the DRAM
fills the L2 with them while the small kernels run, and the product then finds those bytes in the L2.

Nothing is computed: a prefetch changes no value, so every output stays bit for bit what it was. The hint's
place in the step is fixed by data dependencies: the kernel takes `after` (an array the step has just
produced) as an unused input, so it runs after that array's producer, and writes a token of zeros that
`after` is selected through (`where(token == 0, after, NaN)`, fused into whatever reads it next), so the
readers run after the prefetches were issued. The token must be read: a kernel whose output nothing uses
is dead code to XLA, which removes it (the first version's was).

Measured (H200, docs/performance.md, seventeenth pass): it loses. With prefetches of o, a third of qkv and a
tenth of gate_up in each layer of the Qwen3-8B shape, AR decode took 5.04 against 4.31 ms per token (W12)
and 8.85 against 5.02 (bf16 through the twin kernel): a kernel in the stream does not overlap the small
kernels after it, and it costs more the more it prefetches. It is kept, off by default, as a measured option.

The reference beside it (`prefetch_l2_reference`) is the identity: what the kernel means for the values.
Off the GPU (the CPU, the interpreter) `prefetch_l2` returns `after` unchanged, since there is no L2 to fill.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

ROW_BYTES = 256  # each box row: 256 bytes (TMA's box dimensions are at most 256 elements)
BOX_ROWS = 256  # rows per box: 64 KiB per prefetch instruction
BOXES_PER_PROGRAM = 4  # prefetch instructions issued by each program
MIN_BYTES = 1 << 20  # leaves below 1 MiB (scales, exception lists, metadata) are not prefetched


def prefetch_l2_reference(weights, after: jax.Array, **_) -> jax.Array:
    """What `prefetch_l2` computes: `after`, unchanged (a prefetch is a hint and changes no value)."""
    del weights
    return after


def _leaves(weights) -> list[jax.Array]:
    """The arrays of a weight pytree worth prefetching: every leaf of at least MIN_BYTES."""
    leaves = [a for a in jax.tree.leaves(weights) if hasattr(a, "dtype")]
    return [a for a in leaves if a.size * a.dtype.itemsize >= MIN_BYTES]


def _as_rows(a: jax.Array, fraction: float, segments: int) -> tuple[jax.Array, tuple[int, int, int, int]]:
    """a -> (a viewed as [R, 256-byte rows], its plan: (segment rows, rows wanted per segment, box rows,
    boxes per segment)).

    The array's bytes are cut into `segments` equal contiguous parts and the first `fraction` of each part
    is prefetched: with segments = the product's programs along the array's leading dimension, each program
    finds its first steps in the L2 (a whole array: fraction 1)."""
    nbytes = a.size * a.dtype.itemsize
    if nbytes % ROW_BYTES:
        raise ValueError(f"prefetch_l2 takes arrays of whole {ROW_BYTES}-byte rows, got {a.shape} {a.dtype}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    rows = nbytes // ROW_BYTES
    if segments < 1 or rows % segments:
        raise ValueError(f"segments {segments} does not cut the {rows} rows of {ROW_BYTES} bytes of a "
                         f"{a.shape} {a.dtype} array into equal parts")
    seg_rows = rows // segments
    want = max(1, math.ceil(seg_rows * fraction))  # rows to prefetch per segment
    box = min(BOX_ROWS, want)
    return a.reshape(rows, ROW_BYTES // a.dtype.itemsize), (seg_rows, want, box, math.ceil(want / box))


def box_row(i, plan: tuple[int, int, int, int], minimum=min):
    """The first row of box `i` of a plan (`i` and `minimum` Python ints and `min`, or traced values and
    `jnp.minimum` in the kernel): boxes of `box` rows from each segment's start, the last one of a segment
    ending at its wanted rows' end (it may overlap the one before; a row prefetched twice costs nothing more)."""
    seg_rows, want, box, per_segment = plan
    s, r = i // per_segment, i % per_segment
    return s * seg_rows + minimum(r * box, want - box)


def box_starts(plan: tuple[int, int, int, int], segments: int) -> list[int]:
    """The first row of every box a plan prefetches, in issue order (`box_row` of each)."""
    return [box_row(i, plan) for i in range(segments * plan[3])]


TOKEN = 128  # int32 zeros the kernel writes (one warpgroup's lanes)


def _kernel(after_ref, *refs, plans, segments):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    del after_ref  # an input only to order this kernel after its producer
    w_refs, token_ref, zeros = refs[:len(plans)], refs[len(plans)], refs[len(plans) + 1]
    pid = jax.lax.axis_index("p")

    @pl.when(pid == 0)
    def _():
        zeros[...] = jnp.zeros((TOKEN,), jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(zeros, token_ref)
        plgpu.wait_smem_to_gmem(0)

    for w_ref, plan in zip(w_refs, plans):
        for j in range(BOXES_PER_PROGRAM):
            i = pid * BOXES_PER_PROGRAM + j  # the box's place in `box_starts`' order

            @pl.when(i < segments * plan[3])
            def _():
                plgpu.async_prefetch(w_ref.at[pl.ds(box_row(i, plan, jnp.minimum), plan[2])])


def prefetch_l2(weights, after: jax.Array, *, fraction: float = 1.0, segments: int = 1,
                platform: str | None = None) -> jax.Array:
    """Issue L2 prefetches of `weights`' large arrays (see the module's docstring); returns `after`, whose
    readers then run after the prefetches were issued. `fraction` / `segments`: prefetch the first
    `fraction` of each of `segments` equal contiguous parts of every array (default: all of it).
    `platform` defaults to the default device's; anything but "gpu" returns `after` as it is."""
    platform = platform or jax.devices()[0].platform
    leaves = _leaves(weights)
    if platform != "gpu" or not leaves:
        return after
    from jax.experimental.pallas import mosaic_gpu as plgpu

    views, plans = zip(*(_as_rows(a, fraction, segments) for a in leaves))
    programs = max(math.ceil(segments * plan[3] / BOXES_PER_PROGRAM) for plan in plans)
    call = plgpu.kernel(functools.partial(_kernel, plans=plans, segments=segments),
                        out_type=jax.ShapeDtypeStruct((TOKEN,), jnp.int32), grid=(programs,), grid_names=("p",),
                        scratch_types=[plgpu.SMEM((TOKEN,), jnp.int32)],
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    token = call(after, *views)
    return jnp.where(token[0] == 0, after, jnp.asarray(jnp.nan, after.dtype))
