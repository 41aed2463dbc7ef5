"""Weight formats by name. A deployment's plan names one ("bf16", "w12") and `encode_params` applies it
to a dense model's params after loading; each format encodes once, offline, and keeps an exact decode
reference beside its encoder (see w12.py). Formats import no kernel: the layouts kernels multiply come
from `pallas_kernels.dispatch.prepare_params`, applied to the encoded params."""

from __future__ import annotations

from specpilot.formats import w12, w12_cache


def _bf16(params: dict, **_) -> dict:
    return params


ENCODERS = {"bf16": _bf16, "w12": w12_cache.encode_params}  # w12: cached under cache_dir= if given


def encode_params(params: dict, fmt: str = "bf16", **kw) -> dict:
    """params with their linear weights in format `fmt` (keyword arguments go to that format's encoder)."""
    if fmt not in ENCODERS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(sorted(ENCODERS))}")
    return ENCODERS[fmt](params, **kw)
