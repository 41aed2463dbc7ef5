"""Measured rates of one device, the cost model's only inputs besides the counts: stored with the gpu config.
Design notes: docs/design/costmodel.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from pathlib import Path

import yaml

from specpilot import atomic_io

RATES_DIR = Path(__file__).resolve().parents[2] / "conf" / "gpu" / "rates"


@dataclasses.dataclass(frozen=True)
class MatmulTable:
    """Seconds per launch of [M, K] @ [K, N] for one implementation and weight storage."""

    impl: str  # "xla/f32", "mosaic/w12", ...
    ms: tuple[int, ...]  # the M grid, increasing
    shapes: tuple[tuple[int, int], ...]  # (K, N)
    seconds: tuple[tuple[float, ...], ...]  # [shape][m]
    weight_bytes_per_value: float = 2.0
    act_bytes: int = 2
    grids: tuple[tuple[int, ...], ...] | None = None  # a shape's own M grid where they differ (else `ms`)

    def __post_init__(self):
        grids = self.grids if self.grids is not None else (self.ms,) * len(self.shapes)
        if len(grids) != len(self.shapes):
            raise ValueError(f"matmul table {self.impl}: one M grid per shape")
        for g in (self.ms, *grids):
            if list(g) != sorted(set(g)) or not g:
                raise ValueError(f"matmul table {self.impl}: the M grid must be increasing, got {g}")
        if len(self.seconds) != len(self.shapes) or any(len(r) != len(g) for r, g in zip(self.seconds, grids)):
            raise ValueError(f"matmul table {self.impl}: seconds must be [shapes][ms]")

    def grid(self, i: int) -> tuple[int, ...]:
        return self.ms if self.grids is None else self.grids[i]

    def _bytes(self, m: int, k: int, n: int) -> float:
        return k * n * self.weight_bytes_per_value + (m * k + m * n) * self.act_bytes

    def _interp(self, row, m: int, ms: tuple[int, ...]) -> float:
        if m <= ms[0]:
            return row[0]
        if m >= ms[-1]:
            return row[-1] * m / ms[-1] if len(ms) == 1 else row[-1] + (row[-1] - row[-2]) / (ms[-1] - ms[-2]) * (m - ms[-1])
        j = bisect.bisect_left(ms, m)
        if ms[j] == m:
            return row[j]
        f = (m - ms[j - 1]) / (ms[j] - ms[j - 1])
        return row[j - 1] + f * (row[j] - row[j - 1])

    def bandwidth(self, m: int) -> float:
        """Effective bytes per second at M (the median over the table's shapes)."""
        bws = [self._bytes(m, k, n) / self._interp(row, m, self.grid(i))
               for i, ((k, n), row) in enumerate(zip(self.shapes, self.seconds))]
        return statistics.median(bws)

    def time_s(self, m: int, k: int, n: int) -> tuple[float, bool]:
        """(seconds of one launch, whether the shape was measured)."""
        if (k, n) in self.shapes:
            i = self.shapes.index((k, n))
            return self._interp(self.seconds[i], m, self.grid(i)), True
        return self._bytes(m, k, n) / self.bandwidth(m), False

    def to_dict(self) -> dict:
        d = {"ms": list(self.ms), "weight_bytes_per_value": self.weight_bytes_per_value,
             "act_bytes": self.act_bytes,
             "shapes": {f"{k}x{n}": [float(f"{s:.4g}") for s in row]
                        for (k, n), row in zip(self.shapes, self.seconds)}}
        if self.grids is not None and any(g != self.ms for g in self.grids):
            d["grids"] = {f"{k}x{n}": list(g) for (k, n), g in zip(self.shapes, self.grids) if g != self.ms}
        return d

    @classmethod
    def from_dict(cls, impl: str, d: dict) -> "MatmulTable":
        shapes = tuple(tuple(int(x) for x in key.split("x")) for key in d["shapes"])
        ms = tuple(int(m) for m in d["ms"])
        own = d.get("grids") or {}
        grids = tuple(tuple(int(m) for m in own.get(key, ms)) for key in d["shapes"]) if own else None
        return cls(impl, ms, shapes, tuple(tuple(float(s) for s in row) for row in d["shapes"].values()),
                   float(d.get("weight_bytes_per_value", 2.0)), int(d.get("act_bytes", 2)), grids)

    def merged(self, other: "MatmulTable") -> "MatmulTable":
        """This table with `other`'s shapes added (other wins on a shape both hold). Each shape keeps the M
        grid it was measured on (calibrating the 4B shape after the 8B one, with another grid, once
        replaced the 8B shapes)."""
        rows = {s: (self.grid(i), r) for i, (s, r) in enumerate(zip(self.shapes, self.seconds))}
        rows.update({s: (other.grid(i), r) for i, (s, r) in enumerate(zip(other.shapes, other.seconds))})
        grids = tuple(g for g, _ in rows.values())
        return dataclasses.replace(other, shapes=tuple(rows), seconds=tuple(r for _, r in rows.values()),
                                   grids=None if all(g == other.ms for g in grids) else grids)


@dataclasses.dataclass(frozen=True)
class Rates:
    device: str
    copy_gbs: float  # read + write bytes per second / 1e9 of a large elementwise pass
    launch_us: float  # one more kernel in a jitted program
    host_step_us: float  # one iteration of an on-device while loop (a decode step's loop overhead)
    dispatch_us: float  # one jitted call dispatched and synced from Python (the profiled split's phases)
    matmul_tflops: float  # peak matmul rate, for the shapes no table covers and FLOP-bound kernels
    matmul: dict = dataclasses.field(default_factory=dict)  # impl -> MatmulTable
    source: str = ""  # how they were measured (date, jax, device)
    calibrated: bool = True

    def matmul_time_s(self, impl: str, m: int, k: int, n: int, nbytes: float, flops: float) -> tuple[float, str]:
        """(seconds of one launch, how it was found: "table", "bandwidth" of the table, or "roofline")."""
        table = self.matmul.get(impl)
        if table is not None:
            t, exact = table.time_s(m, k, n)
            return t, "table" if exact else "bandwidth"
        return self.roofline_s(nbytes, flops) + 1e-6 * self.launch_us, "roofline"

    def roofline_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.copy_gbs * 1e9), flops / (self.matmul_tflops * 1e12))

    def to_dict(self) -> dict:
        return {"device": self.device, "source": self.source, "copy_gbs": float(f"{self.copy_gbs:.4g}"),
                "launch_us": float(f"{self.launch_us:.4g}"), "host_step_us": float(f"{self.host_step_us:.4g}"),
                "dispatch_us": float(f"{self.dispatch_us:.4g}"), "matmul_tflops": self.matmul_tflops,
                "matmul": {impl: t.to_dict() for impl, t in sorted(self.matmul.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "Rates":
        missing = [k for k in ("device", "copy_gbs", "launch_us", "host_step_us", "dispatch_us", "matmul_tflops")
                   if k not in d]
        if missing:
            raise ValueError(f"rates record lacks {', '.join(missing)}")
        return cls(str(d["device"]), float(d["copy_gbs"]), float(d["launch_us"]), float(d["host_step_us"]),
                   float(d["dispatch_us"]), float(d["matmul_tflops"]),
                   {impl: MatmulTable.from_dict(impl, t) for impl, t in (d.get("matmul") or {}).items()},
                   str(d.get("source", "")))

    def save(self, path: str | Path) -> None:
        atomic_io.write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False, width=120))

    @classmethod
    def load(cls, path: str | Path) -> "Rates":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no rates file at {path}; measure it with experiments/bench/calibrate.py")
        return cls.from_dict(yaml.safe_load(path.read_text()))

    @classmethod
    def for_gpu(cls, gpu, directory: str | Path = RATES_DIR) -> "Rates":
        """The calibrated rates of the gpu config `gpu` (its name's file), else its datasheet numbers."""
        path = Path(directory) / f"{gpu.name}.yaml"
        if path.is_file():
            return cls.load(path)
        return cls.datasheet(gpu)

    @classmethod
    def datasheet(cls, gpu) -> "Rates":
        return cls(str(gpu.name), float(gpu.memory_bandwidth_gbs), 0.0, 0.0, 0.0, float(gpu.matmul_tflops_bf16),
                   source="gpu config datasheet numbers (not calibrated)", calibrated=False)
