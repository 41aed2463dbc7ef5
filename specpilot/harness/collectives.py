"""What a sharded step sends between devices: its collectives and their bytes over the interconnect.

Design choices:
- Counted from the sharding layout (`specpilot.sharding`), not measured: a tensor-parallel forward of
  R = batch x tokens rows all-reduces R x H activations once after the vocabulary-split embedding
  gather and twice per layer (after the row-split o / out and down products); data parallelism alone
  sends nothing in a forward. The tests compile sharded forwards on simulated devices and read the
  collectives out of the HLO, so this count is checked against what XLA actually emits.
- The greedy choice over vocabulary-split logits reduces one (value, index) pair per row and device:
  counted, though tiny.
- Bytes over the interconnect per device use the ring algorithm's volume: an all-reduce of S bytes over
  n devices moves 2 (n - 1) / n x S into and out of each device; time is that over the link bandwidth
  plus a latency per collective (`gpu` config: `interconnect_gbs`, `collective_latency_us`).
"""

from __future__ import annotations

import dataclasses

from specpilot.sharding import MeshShape


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
