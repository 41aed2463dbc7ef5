"""Whether a deployment fits the device's memory, from shapes alone and before anything is built: the
target's weights, the copies its plans' weight formats and kernel layouts add, the drafter, the K/V and
recurrent state for batch x cache slots, and what building holds for a moment. A deployment that cannot
fit fails in one line naming the bytes needed, the bytes available and the fix."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
from omegaconf import DictConfig

from specpilot.harness import devices, shapes
from specpilot.harness.config_errors import ConfigValueError
from specpilot.models import dense, hybrid
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.plan import W12_CLASSES, Plan

try:
    import psutil
except ImportError:  # optional: psutil (installed with dask's distributed); /proc/meminfo serves on Linux
    psutil = None

W12_BYTES = 1.5  # bytes per weight of the 12-bit format (its rare exceptions left out)
FUSED = ("q", "k", "v", "gate", "up", "q_bias", "k_bias", "v_bias", "gate_bias", "up_bias")
RESIDUAL_WRITES = ("o", "out", "down")  # a hybrid wide-margin init rescales these (a second copy meanwhile)


class DoesNotFitError(ConfigValueError):
    """A deployment needs more memory than the device has."""


@dataclasses.dataclass(frozen=True)
class Needs:
    """Bytes a deployment holds on one device."""

    weights: int  # the target's params at target.dtype
    formats: int  # copies the plans' weight formats, kernel layouts and meshes add (made as plans run)
    drafter: int  # the drafter's own layers and `fc`, with their copies
    cache: int  # K/V and recurrent state of the target and the drafter's context, batch x slots
    building: int  # held only while building (both layouts of the fused projections, say)
    drafter_formats: int = 0  # the part of `drafter` that is the plans' copies

    @property
    def copies(self) -> int:
        """The plans' weight formats and layouts, the target's and the drafter's."""
        return self.formats + self.drafter_formats

    @property
    def total(self) -> int:
        """The larger of the build's peak and what the runs hold."""
        return max(self.weights + self.drafter + self.building,
                   self.weights + self.formats + self.drafter + self.cache)


def _leaves(shapes_tree, prefix: str = ""):
    """(name, shape) of every array in a `param_shapes` tree."""
    if isinstance(shapes_tree, dict):
        for k, v in shapes_tree.items():
            yield from _leaves(v, k)
    elif isinstance(shapes_tree, (tuple, list)) and shapes_tree and not isinstance(shapes_tree[0], int):
        for v in shapes_tree:
            yield from _leaves(v, prefix)
    else:
        yield prefix, tuple(shapes_tree)


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _matrices(tree, plan: Plan | None = None) -> int:
    """Weights of the matrices a weight format encodes: the layers' and the head (not the embedding);
    for a w12 `plan`, those of its encoded matrix classes."""
    if plan is None or plan.weights != "w12" or set(plan.w12_matrices) == set(W12_CLASSES):
        return sum(_size(s) for n, s in _leaves(tree) if len(s) == 2 and n != "embed")
    names, head, fc = plan.w12_params()
    chosen = set(names) | ({"lm_head"} if head else set()) | ({"fc"} if fc else set())
    return sum(_size(s) for n, s in _leaves(tree) if len(s) == 2 and n in chosen)


def _state_bytes(fn) -> int:
    return sum(_size(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(jax.eval_shape(fn)))


def needs(cfg: DictConfig, plans: list[Plan], batch: int, slots: int, on_cpu: bool) -> Needs | None:
    """What the deployment of `cfg` running `plans` holds with `batch` rows of `slots` cache slots, or None
    where its shapes are known only once built. `on_cpu`: simulated devices share the host's memory."""
    target, dcfg = shapes.check_drafter_fits(cfg)
    if target is None:
        return None
    dtype = shapes.DTYPES[cfg.target.dtype]
    e = np.dtype(dtype).itemsize
    is_hybrid = not isinstance(target, ModelConfig)
    tree = (hybrid if is_hybrid else dense).param_shapes(target)
    weights = sum(_size(s) for _, s in _leaves(tree)) * e
    draft_tree = dr.param_shapes(dcfg) if dcfg is not None else {}
    draft = sum(_size(s) for _, s in _leaves(draft_tree)) * e
    formats, draft_formats, seen = 0, 0, set()
    for plan in plans:
        if not plan.mesh.is_single:
            if ("mesh", plan.mesh) not in seen:  # one sharded copy per mesh shape
                seen.add(("mesh", plan.mesh))
                share = plan.mesh.data if on_cpu else 1 / plan.mesh.tensor
                formats += int(weights * share)
                draft_formats += int(draft * share) if plan.uses_drafter else 0
            continue
        key = (plan.weights, plan.w12_matrices, plan.kernels.matmul, batch * plan.block_size)  # as Deployment caches them
        if key in seen:
            continue
        seen.add(key)
        per_weight = W12_BYTES if plan.weights == "w12" else e if plan.kernels.matmul.implementation[0] == "mosaic" \
            else 0  # bf16 through XLA or Triton multiplies the params as they are
        formats += int(_matrices(tree, plan) * per_weight)
        draft_formats += int(_matrices(draft_tree, plan) * per_weight) if plan.uses_drafter else 0
    block = max(p.block_size for p in plans)
    if is_hybrid:
        state = functools.partial(hybrid.init_state, target, batch, slots, dtype, max_block_size=max(16, block))
    else:
        state = functools.partial(dense.init_state, target, batch, slots, dtype)
    cache = _state_bytes(state)
    if dcfg is not None:
        cache += _state_bytes(functools.partial(dr.init_context_cache, dcfg, batch, slots, dtype))
    if is_hybrid:
        transient = sum(_size(s) for n, s in _leaves(tree) if n in RESIDUAL_WRITES) * e \
            if cfg.target.source == "random" and cfg.target.init == "wide_margin" else 0
    else:
        transient = sum(_size(s) for n, s in _leaves(tree) if n in FUSED) * e if cfg.target.layout == "fused" else 0
    return Needs(weights=weights, formats=formats, drafter=draft + draft_formats, cache=cache, building=transient,
                 drafter_formats=draft_formats)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available(device) -> tuple[int, str] | None:
    """(bytes free for a deployment, what they are) on `device`, or None where the device does not say:
    the host's available RAM on the CPU, the allocator's limit less what is in use on an accelerator."""
    if device.platform == "cpu":
        free = psutil.virtual_memory().available if psutil is not None else _meminfo_available()
        return None if free is None else (int(free), "available RAM on this machine")
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics (jax raises its own error types)
        return None
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"memory on the {device.device_kind}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check(cfg: DictConfig, plans: list[Plan], batch: int | None = None, slots: int | None = None,
          held: list[Plan] | None = None) -> Needs | None:
    """Raise DoesNotFitError (one line) when the deployment cannot fit the first device's memory. `batch`
    and `slots` default to the bench's (batch size; prompt + new tokens + one block, rounded up).

    `held`: this process holds the deployment already (a warm worker), with the weight formats of the
    `held` plans made; its weights are in the device's use, so only what `plans` add counts: the formats
    no held plan made, and a cache."""
    b = cfg.bench
    batch = int(batch or b.batch_size)
    slots = int(slots or shapes.cache_len(int(b.prompt_len), int(b.new_tokens),
                                          max(p.block_size for p in plans), b.cache_len))
    device = jax.devices()[0]
    need = needs(cfg, plans, batch, slots, on_cpu=device.platform == "cpu")
    have = available(device)
    if need is None or have is None:
        return need
    if held is not None:
        on_cpu = device.platform == "cpu"
        new = needs(cfg, held + plans, batch, slots, on_cpu).copies - needs(cfg, held, batch, slots, on_cpu).copies \
            if held else need.copies
        added = new + need.cache
        if added <= have[0]:
            return need
        raise DoesNotFitError(
            f"the plan needs {_gb(added)} more than this process holds but there is {_gb(have[0])} of "
            f"{have[1]} left (weight formats and layouts {_gb(new)}, cache {_gb(need.cache)} for "
            f"{batch} x {slots} slots); use fewer slots or a shorter context (bench.batch_size, "
            f"bench.prompt_len, bench.new_tokens), or a device with more memory (gpu=...)")
    if need.total <= have[0]:
        return need
    parts = [f"target={cfg.target.name} {cfg.target.dtype} weights {_gb(need.weights)}"]
    if need.formats:
        parts.append(f"plans' weight formats and layouts {_gb(need.formats)}")
    if need.drafter:
        parts.append(f"drafter {_gb(need.drafter)}")
    parts.append(f"cache {_gb(need.cache)} for {batch} x {slots} slots")
    if need.building and need.total == need.weights + need.drafter + need.building:
        parts.append(f"{_gb(need.building)} more while building")
    raise DoesNotFitError(
        f"the deployment needs at least {_gb(need.total)} but there is {_gb(have[0])} of {have[1]} "
        f"({', '.join(parts)}); "
        f"use a smaller target, fewer slots or a shorter context (bench.batch_size, bench.prompt_len, "
        f"bench.new_tokens), or a device with more memory (gpu=...)")


def preflight(cfg: DictConfig, plans: list[Plan], batch: int | None = None, slots: int | None = None,
              held: list[Plan] | None = None) -> list[str]:
    """The checks before a deployment is built: the `gpu` config names the device jax sees (or allows a
    mismatch: -> the note records carry) and the deployment fits its memory (`check`; `held`: what a
    process that holds it already has made)."""
    note = devices.check_gpu(cfg)
    check(cfg, plans, batch, slots, held)
    return [note] if note else []
