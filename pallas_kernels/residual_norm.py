"""The residual add and the RMSNorm that reads it as one Pallas Triton-backend kernel: h = x + r and
y = weight * rmsnorm(h), both returned, so a dense layer's stream is read once for the add and the norm
(XLA runs them as separate kernels), and the pure-jnp reference that follows the model's own steps
(`layers.rms_norm` after a bf16 add). Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import largest_pow2_divisor, pow2


def residual_norm_reference(x: jax.Array, r: jax.Array, weight: jax.Array, eps: float):
    """x, r [..., D] (the stream and a layer's output), weight [D] -> (h = x + r, weight * rmsnorm(h)), the
    model's own steps: the add in the stream's dtype, the mean of squares in float32, the normalised row
    rounded to the stream's dtype before the weight multiplies it (`specpilot.models.layers.rms_norm`)."""
    h = x + r
    dtype = h.dtype
    hf = h.astype(jnp.float32)
    hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    return h, weight * hf.astype(dtype)


def check_shapes(x, r, weight) -> None:
    if x.shape != r.shape or x.dtype != r.dtype:
        raise ValueError(f"x {x.shape} {x.dtype} and the residual delta {r.shape} {r.dtype} must match")
    if x.ndim < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {weight.shape} must be [D] with D = x's last dim, x {x.shape}")


# ---- the kernel ----------------------------------------------------------------------------------------

def _kernel(x_ref, r_ref, w_ref, h_ref, y_ref, *, eps: float):
    # x_ref, r_ref: [BR, D] rows of the stream and of the layer's output; w_ref: [D]; h_ref, y_ref: [BR, D]
    dtype = x_ref.dtype
    # the float32 sum of two bf16 (or f16, f32) values rounds to the same value as their exact sum: this is
    # the reference's add in the stream's dtype
    h = (x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(dtype)
    hf = h.astype(jnp.float32)
    normed = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)).astype(dtype)
    # weight * normed rounded once: the float32 product of two bf16 (or f16) values is exact
    y = (w_ref[...].astype(jnp.float32)[None, :] * normed.astype(jnp.float32)).astype(y_ref.dtype)
    h_ref[...] = h
    y_ref[...] = y


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def residual_norm_pallas(x, r, weight, *, eps: float, block_rows: int, num_warps: int = 4,
                         interpret: bool = False):
    """The pallas_call on any backend the caller asks for: x, r [rows, D], weight [D] -> (h, y) [rows, D]
    (block_rows must divide rows; D a power of two)."""
    rows, d = x.shape
    block = pl.BlockSpec((block_rows, d), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps)),
        grid=(rows // block_rows,),
        in_specs=[block, block, pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=[block, block],
        out_shape=[jax.ShapeDtypeStruct((rows, d), x.dtype), jax.ShapeDtypeStruct((rows, d), x.dtype)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="residual_norm",
    )(x, r, weight)


# ---- public API ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ResidualNormConfig:
    """The kernel's settings: rows per program (the largest power of two dividing the row count up to this
    is used), the launch's warps, and interpret (Pallas' interpreter: CPU tests; False on a CPU backend
    raises NotImplementedError)."""

    block_rows: int = 1
    num_warps: int = 4
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_rows", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not pow2(value):
                raise ValueError(f"residual_norm {name} must be a power of two, got {value!r}")


def residual_norm(x: jax.Array, r: jax.Array, weight: jax.Array, eps: float,
                  config: ResidualNormConfig = ResidualNormConfig()):
    """(h, y) of `residual_norm_reference` through the kernel, any leading dims flattened into rows.
    Raises NotImplementedError where the kernel does not apply (width, dtypes or backend), so the caller
    runs the reference."""
    check_shapes(x, r, weight)
    d = x.shape[-1]
    if not pow2(d):
        raise NotImplementedError(f"the kernel holds whole rows as one power-of-two block, got width {d}")
    if weight.dtype != x.dtype:
        raise NotImplementedError(f"the kernel norms with a weight of the stream's dtype, got x {x.dtype} and "
                                  f"weight {weight.dtype}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    rows = x.size // d
    if rows == 0:
        raise NotImplementedError("no rows to norm")
    h, y = residual_norm_pallas(x.reshape(rows, d), r.reshape(rows, d), weight, eps=float(eps),
                                block_rows=largest_pow2_divisor(rows, config.block_rows),
                                num_warps=config.num_warps, interpret=config.interpret)
    return h.reshape(x.shape), y.reshape(x.shape)
