"""Kernel variants a decoding config carries (`decoding.variants`, the optimization loop's winning plan
with its variants' sources inline), loaded and checked against their ops' references at the deployment's
shapes before a run times anything. Design notes: docs/design/harness.md.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from omegaconf import DictConfig

from pallas_kernels.dispatch import is_variant
from specpilot.harness import kernel_variants as va


class VariantError(ValueError):
    """A decoding config's kernel variant that cannot run: rejected by its static check, by its
    reference check, or named by no plan's implementation list."""


def _plan_variant_names(plan) -> set[str]:
    names = set()
    for field in dataclasses.fields(plan.kernels):
        for impl in getattr(plan.kernels, field.name).implementation:
            if is_variant(impl):
                names.add(impl)
    return names


def load(cfg: DictConfig) -> dict:
    """name -> (op, function) for every variant of `cfg.decoding.variants`, registered with the dispatch."""
    out = {}
    for i, entry in enumerate(cfg.decoding.get("variants") or ()):
        try:
            v = va.Variant(str(entry.op), str(entry.source))
            path = v.write(Path(str(cfg.cache_dir)).expanduser() / "variants")
            out[v.name] = (v.op, va.load(v.op, v.name, path))
        except (ValueError, va.VariantRejected) as e:
            raise VariantError(f"decoding.variants.{i}: {e}") from None
    return out


def check(loaded: dict, plans, model_cfg, batch_size: int) -> list[str]:
    """Every loaded variant against its op's reference at the shapes of the plans that name it; returns
    one note per variant. A variant no plan names is refused (a config that carries dead code)."""
    notes = []
    for name, (op, fn) in loaded.items():
        users = [p for p in plans if name in _plan_variant_names(p)]
        if not users:
            raise VariantError(f"decoding.variants: {name} ({op}) is named by no plan's kernels")
        calls = 0
        for p in users:
            block = 1 if p.verify == "ar" else int(p.block_size)
            shapes = va.check_shapes(model_cfg, batch_size, block, p.weights)
            try:
                calls += va.check(op, fn, shapes, secrets.randbits(63))["calls"]
            except va.VariantRejected as e:
                raise VariantError(f"kernel variant {name} ({op}) in plan {p.name!r}: {e}") from None
        notes.append(f"kernel variant {name} ({op}) matched its reference in {calls} checked calls")
    return notes
