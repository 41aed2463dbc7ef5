"""Roofline ceilings for decode, draft and verify steps, and the gap between a measurement and them.
Design notes: docs/design/costmodel.md.
"""

from __future__ import annotations

import dataclasses

from specpilot.costmodel import counts
from specpilot.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Hardware:
    memory_bandwidth_gbs: float
    matmul_tflops: float
    interconnect_gbs: float = 0.0  # per direction between two devices (0: not known)
    collective_latency_us: float = 0.0

    @classmethod
    def from_conf(cls, gpu) -> "Hardware":
        return cls(float(gpu.memory_bandwidth_gbs), float(gpu.matmul_tflops_bf16),
                   float(gpu.get("interconnect_gbs") or 0.0), float(gpu.get("collective_latency_us") or 0.0))

    def floor_s(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.memory_bandwidth_gbs * 1e9), flops / (self.matmul_tflops * 1e12))


@dataclasses.dataclass(frozen=True)
class StepCost:
    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.weight_bytes + other.weight_bytes, self.kv_bytes + other.kv_bytes,
                        self.flops + other.flops)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters read as matrices in one step (layers + LM head; embedding rows are gathered)."""
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def _weights(bits_per_weight: float) -> str:
    if bits_per_weight not in (12.0, 16.0):
        raise ValueError(f"bits_per_weight must be 16 (bf16) or 12 (w12), got {bits_per_weight}")
    return "w12" if bits_per_weight == 12.0 else "bf16"


def _floor(c: counts.StepCounts) -> StepCost:
    """The floor of a step's kernels: matrices and gathered rows, committed K/V, all floor FLOPs."""
    weights = c.select(cls=("matmul", "lm_head", "embedding")).total("floor_bytes")
    kv = c.select(cls="attention").total("floor_bytes")
    return StepCost(weights, kv, c.total("floor_flops"))


def target_step(cfg, batch: int, tokens: int, context: int,
                bits_per_weight: float = 16.0, kv_bytes_per_value: int = 2) -> StepCost:
    """One target forward of `tokens` new positions per sequence over `context` committed ones."""
    shape = counts.Shape(cfg, batch=batch, context=context, cache_len=context + tokens,
                         dtype_bytes=kv_bytes_per_value)
    return _floor(counts.forward_counts(shape, tokens, _weights(bits_per_weight)))


def drafter_step(target: ModelConfig, num_layers: int, num_taps: int, batch: int, block: int,
                 context: int, bits_per_weight: float = 16.0) -> StepCost:
    """One DFlash-style block draft: fc (n*H -> H), `num_layers` target-shaped layers, the LM head."""
    h = target.hidden_size
    per_layer = h * (target.q_size + 2 * target.kv_size) + target.q_size * h + 3 * h * target.intermediate_size
    params = num_taps * h * h + num_layers * per_layer + target.vocab_size * h
    n = batch * block
    kv_bytes = num_layers * 2 * batch * context * target.kv_size * 2
    attn_flops = num_layers * 4 * n * (context + block) * target.q_size
    return StepCost(params * bits_per_weight / 8, kv_bytes, 2 * n * params + attn_flops)


def ar_ceiling_s(hw: Hardware, cfg: ModelConfig, batch: int, context: int,
                 bits_per_weight: float = 16.0) -> float:
    """Floor of AR decode time per step (each sequence gains one token per step)."""
    c = target_step(cfg, batch, 1, context, bits_per_weight)
    return hw.floor_s(c.bytes, c.flops)


def spec_ceiling_s(hw: Hardware, cfg: ModelConfig, batch: int, context: int, block: int, tau: float,
                   draft_layers: int, num_taps: int, bits_per_weight: float = 16.0) -> dict:
    """Floor of speculative decode time per output token, split into draft and verify."""
    d = drafter_step(cfg, draft_layers, num_taps, batch, block, context, bits_per_weight)
    v = target_step(cfg, batch, block, context, bits_per_weight)
    draft_s, verify_s = hw.floor_s(d.bytes, d.flops), hw.floor_s(v.bytes, v.flops)
    return {"draft_s": draft_s, "verify_s": verify_s, "per_token_s": (draft_s + verify_s) / tau}


def gaps(measured: dict[str, float], ceiling: dict[str, float]) -> list[tuple[str, float]]:
    """Measured minus ceiling per component, largest first — where the agent loop should look."""
    out = [(k, measured[k] - ceiling.get(k, 0.0)) for k in measured]
    return sorted(out, key=lambda kv: -kv[1])
