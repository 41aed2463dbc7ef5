"""Temporary compatibility: what `specpilot.models.dense` and the harness (`deploy.py`) still read from the
format modules, now served by `pallas_kernels.dispatch`. Imported only on use, so `specpilot.formats`
itself imports no kernel. Goes once those callers use `dispatch.matmul` / `dispatch.prepare_params`:

- `w12.W12NK`, `w12.TwinNK`, `w12.ENCODED`: the kernel layouts' types (`dense._projections`, `lm_head`);
- `w12.linear(x, w, b, out_dtype=)`: `dispatch.matmul` with no choice;
- `w12.twin_params(params)`: `dispatch.prepare_params(params, choice("matmul", "mosaic"))` of bf16 params;
- `formats.encode_params(params, fmt, kernel=, rows=)`: the format, then `prepare_params` for the
  implementation `kernel` names ("pallas": triton, "xla", "mosaic").
"""

from __future__ import annotations

KERNEL_IMPLEMENTATIONS = {"pallas": ("triton", "xla"), "xla": ("xla",), "mosaic": ("mosaic", "xla")}


def attribute(name: str):
    from pallas_kernels import dispatch
    from pallas_kernels.w12_mosaic import TwinNK, W12NK
    from specpilot.formats.w12 import W12

    def linear(x, w, b=None, *, out_dtype=None):
        return dispatch.matmul(x, w, b, out_dtype=out_dtype)

    def twin_params(params: dict, names=None, lm_head: bool = True, extra: tuple[str, ...] = ()) -> dict:
        kw = {} if names is None else {"names": names}
        return dispatch.prepare_params(params, dispatch.choice("matmul", "mosaic"), 1, extra, lm_head=lm_head, **kw)

    table = {"W12NK": W12NK, "TwinNK": TwinNK, "ENCODED": (W12, W12NK, TwinNK), "linear": linear,
             "twin_params": twin_params}
    if name not in table:
        raise AttributeError(f"module 'specpilot.formats.w12' has no attribute {name!r}")
    return table[name]


def prepare(params: dict, kernel: str, rows: int, extra: tuple[str, ...]) -> dict:
    """Encoded params with their W12 matrices in the layout of the implementation `kernel` names (the old
    `encode_params(kernel=)`); matrices the encoder kept bf16 stay as they are, multiplied by XLA."""
    from pallas_kernels import dispatch

    if kernel not in KERNEL_IMPLEMENTATIONS:
        raise ValueError(f"W12 kernel must be one of {tuple(KERNEL_IMPLEMENTATIONS)}, got {kernel!r}")
    return dispatch.prepare_params(params, dispatch.choice("matmul", KERNEL_IMPLEMENTATIONS[kernel]), rows, extra,
                                   layout_bf16=False)
