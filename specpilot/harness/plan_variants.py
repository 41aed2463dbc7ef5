"""Kernel variants a decoding config carries (`decoding.variants`), loaded and checked before a run.

Design choices:
- The optimization loop writes a winning plan that names a kernel variant (`variant:<hash>`) with the
  variant's source inline (`decoding.variants: [{op, source}]`), so the one file copied into
  conf/decoding/ is the whole plan. The name is the source's digest (`agent.variants.Variant`): a plan
  names exactly the source it carries, and an edited source is a different variant.
- `load` runs the same static check the loop's candidates pass (allowed imports, no dunder walks), writes
  the module under `cache_dir/variants/` and registers it with the dispatch; `check` compares every
  variant with its op's reference at the deployment's shapes (`agent.variants.check_shapes`: each plan
  that names it, at its batch, block and weight format) on fresh inputs from an unpredictable seed,
  before anything is timed. A variant that fails either stops the run with its name and the first bad
  value. The run's token forcing then checks the plan that runs it, as any plan.
- A plan that names a variant the config does not carry fails at dispatch with a LookupError naming it.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from omegaconf import DictConfig


class VariantError(ValueError):
    """A decoding config's kernel variant that cannot run: rejected by its static check, by its
    reference check, or named by no plan's implementation list."""


def _plan_variant_names(plan) -> set[str]:
    from pallas_kernels.dispatch import is_variant

    names = set()
    for field in dataclasses.fields(plan.kernels):
        for impl in getattr(plan.kernels, field.name).implementation:
            if is_variant(impl):
                names.add(impl)
    return names


def load(cfg: DictConfig) -> dict:
    """name -> (op, function) for every variant of `cfg.decoding.variants`, registered with the dispatch."""
    from specpilot.agent import variants as va

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
    from specpilot.agent import variants as va

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
