"""Kernel variants a decoding config carries (`decoding.variants`, the optimization loop's winning plan
with its variants' sources inline): the checks a sandboxed process runs before the run starts
(`sandbox_checks`), then loaded and checked again against their ops' references at the deployment's
shapes before a run times anything. Design notes: docs/design/harness.md.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from omegaconf import DictConfig

from pallas_kernels.dispatch import is_variant
from specpilot.harness import kernel_variants as va
from specpilot.harness import shapes as harness_shapes


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


def carried(cfg: DictConfig) -> dict:
    """name -> Variant for every variant of `cfg.decoding.variants`, statically checked; no code of theirs runs."""
    out = {}
    for i, entry in enumerate(cfg.decoding.get("variants") or ()):
        try:
            v = va.Variant(str(entry.op), str(entry.source))
            va.static_check(v.op, v.source)
        except (ValueError, va.VariantRejected) as e:
            raise VariantError(f"decoding.variants.{i}: {e}") from None
        out[v.name] = v
    return out


def sandbox_checks(cfg: DictConfig, plans) -> list[dict]:
    """The "check" specs (`agent.candidate`'s check stage) of every carried variant in every plan that
    names it, at that plan's shapes: what a sandboxed process runs before the run's own process loads any
    of them. A variant no plan names is refused here, before any of its code runs."""
    variants = carried(cfg)
    users = {name: [p for p in plans if name in _plan_variant_names(p)] for name in variants}
    for name, used in users.items():
        if not used:
            raise VariantError(f"decoding.variants: {name} ({variants[name].op}) is named by no plan's kernels")
    if not variants:
        return []
    model_cfg = harness_shapes.target_config(cfg)
    if model_cfg is None:
        raise VariantError(f"decoding.variants: the shape of target {cfg.target.name!r} ({cfg.target.source}) is "
                           f"known only once it is built, so its kernel variants cannot be checked before the "
                           f"run; run it once without them (a GGUF file is converted then) or use a target with "
                           f"a shape (random, hf)")
    folder = Path(str(cfg.cache_dir)).expanduser() / "variants"
    specs = []
    for name, v in variants.items():
        for p in users[name]:
            block = 1 if p.verify == "ar" else int(p.block_size)
            specs.append({"name": f"check-{v.digest}", "stage": "check", "plan": p.name, "op": v.op, "variant": name,
                          "variants": [v.spec_entry(folder)],
                          "variant_check": {"shapes": va.check_shapes(model_cfg, int(cfg.bench.batch_size), block,
                                                                      p.weights)}})
    return specs


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
