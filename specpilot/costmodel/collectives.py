"""What a sharded step sends between devices: its collectives and their bytes over the interconnect.
Design notes: docs/design/costmodel.md.
"""

from __future__ import annotations

import dataclasses

from specpilot.costmodel.counts import StepCounts
from specpilot.sharding import MeshShape

# matmul roles split over the tensor axis (`sharding.param_spec`): by output columns, by input rows
COLUMN_ROLES = frozenset({"q", "k", "v", "qkv", "gate", "up", "gate_up", "z", "b", "a", "lm_head"})
ROW_ROLES = frozenset({"o", "down", "out"})
SPLIT_BY_HEADS = frozenset({"attention", "cache_write"})  # K/V and their products split by KV heads
REPLICATED_RECURRENCE = ("conv",)  # the convolution and its snapshots are replicated over tensor


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str  # what it follows ("embed", "layer o/out", "layer down", "argmax")
    kind: str  # all-reduce, ...
    count: int  # per step
    bytes_each: int  # the reduced array's size
    group: int  # devices taking part (the tensor axis)

    @property
    def ring_bytes_per_device(self) -> float:
        """Bytes each device sends (and receives) for all `count` of them: 2 (n-1)/n x size each."""
        n = self.group
        return 0.0 if n <= 1 else self.count * 2.0 * (n - 1) / n * self.bytes_each


def forward_collectives(cfg, mesh: MeshShape, batch: int, tokens: int, act_bytes: int = 2,
                        argmax: bool = True) -> list[Collective]:
    """The collectives of one target (or drafter) forward over `tokens` new positions per row, for a
    dense or hybrid config (every layer: a mixer then an MLP), rows split over mesh.data."""
    if mesh.tensor <= 1:
        return []
    rows = batch // mesh.data * tokens  # rows one data shard computes
    act = rows * cfg.hidden_size * act_bytes
    n_layers = cfg.num_layers
    out = [Collective("embed", "all-reduce", 1, act, mesh.tensor),
           Collective("layer o/out", "all-reduce", n_layers, act, mesh.tensor),
           Collective("layer down", "all-reduce", n_layers, act, mesh.tensor)]
    if argmax:
        out.append(Collective("argmax", "all-reduce", 1, rows * 8, mesh.tensor))  # (float32 max, int32 index)
    return out


def interconnect_s(collectives: list[Collective], interconnect_gbs: float, latency_us: float) -> float:
    """Time on the links: ring bytes per device over the bandwidth, plus each collective's latency."""
    volume = sum(c.ring_bytes_per_device for c in collectives)
    return volume / (interconnect_gbs * 1e9) + sum(c.count for c in collectives) * latency_us * 1e-6


def _role(kernel) -> str:
    return kernel.name.rsplit(".", 1)[-1]


def per_device(counts: StepCounts, mesh: MeshShape, hybrid: bool = False) -> StepCounts:
    """One device's share of every kernel of a step sharded over `mesh`."""
    if mesh.is_single:
        return counts
    out = []
    for k in counts.kernels:
        t, n_out, k_in = 1, k.n, k.k
        if k.cls in ("matmul", "lm_head"):
            role = _role(k)
            if role in COLUMN_ROLES and not (hybrid and role == "qkv"):
                t, n_out = mesh.tensor, max(1, k.n // mesh.tensor)
            elif role in ROW_ROLES:
                t, k_in = mesh.tensor, max(1, k.k // mesh.tensor)
        elif k.cls in SPLIT_BY_HEADS or (k.cls == "recurrence" and not any(r in k.name for r in REPLICATED_RECURRENCE)):
            t = mesh.tensor
        d = mesh.data
        weights = k.weight_bytes / t
        rest = (k.bytes - k.weight_bytes) / (t * d)
        out.append(dataclasses.replace(
            k, flops=k.flops / (t * d), bytes=weights + rest, weight_bytes=weights,
            floor_flops=k.floor_flops / (t * d), floor_bytes=k.floor_bytes / (t * d) if not k.weight_bytes
            else k.weight_bytes / t + max(0.0, k.floor_bytes - k.weight_bytes) / (t * d),
            m=max(1, k.m // d) if k.m else k.m, k=k_in, n=n_out))
    return StepCounts(tuple(out))


def step_collectives(plan, shape) -> dict[str, list[Collective]]:
    """Per stage, the collectives of one step of `plan` at a `counts.Shape` (draft: the drafter's forward
    and the target's head it reads; verify: the target forward; none for one device)."""
    mesh = plan.mesh
    if mesh.tensor <= 1:
        return {}
    e = shape.dtype_bytes
    tokens = plan.block_size
    out = {"verify": forward_collectives(shape.target, mesh, shape.batch, tokens, e)}
    if plan.verify != "ar" and shape.drafter is not None:
        draft = forward_collectives(shape.drafter.layer_config, mesh, shape.batch, tokens, e)
        out["draft"] = [c for c in draft if c.name != "embed"] + [
            Collective("drafter lm_head argmax", "all-reduce", 1, shape.batch // mesh.data * tokens * 8, mesh.tensor)]
    return out
