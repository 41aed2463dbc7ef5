"""Weight formats by name. A deployment's plan names one ("bf16", "w12") and `encode_params` applies it
to a dense model's params after loading; each format encodes once, offline, and keeps an exact decode
reference beside its encoder (see w12.py). Formats import no kernel: the layouts kernels multiply come
from `pallas_kernels.dispatch.prepare_params`, applied to the encoded params."""

from __future__ import annotations

from specpilot.formats import w12


def _bf16(params: dict, **_) -> dict:
    return params


ENCODERS = {"bf16": _bf16, "w12": w12.encode_params}


def encode_params(params: dict, fmt: str = "bf16", *, kernel: str | None = None, rows: int = 1, **kw) -> dict:
    """params with their linear weights in format `fmt` (keyword arguments go to that format's encoder).
    `kernel` (temporary, for callers not yet on `dispatch.prepare_params`): also put them into the layout
    of that kernel ("pallas", "xla", "mosaic"), for products of up to `rows` rows per call."""
    if fmt not in ENCODERS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(sorted(ENCODERS))}")
    out = ENCODERS[fmt](params, **kw)
    if kernel is None or fmt == "bf16":
        return out
    from specpilot.formats import legacy

    return legacy.prepare(out, kernel, rows, kw.get("extra", ()))
