"""Predicted step time per stage from the counts and a device's measured rates, and gap attribution.
Design notes: docs/design/costmodel.md.
"""

from __future__ import annotations

import dataclasses

from specpilot.costmodel import collectives
from specpilot.costmodel.counts import STAGES, Shape, step_counts
from specpilot.costmodel.roofline import Hardware
from specpilot.costmodel.rates import Rates

SPLIT_NAMES = {"draft": "draft", "verify": "verify", "bookkeeping": "accept"}  # profiled split -> stage


@dataclasses.dataclass(frozen=True)
class Setting:
    shape: Shape
    rates: Rates
    hardware: Hardware

    @classmethod
    def from_deployment(cls, dep, gpu, rates: Rates | None = None) -> "Setting":
        """A harness deployment on the device of the gpu config `gpu` (its calibrated rates by default)."""
        return cls(Shape.from_deployment(dep), rates or Rates.for_gpu(gpu), Hardware.from_conf(gpu))


@dataclasses.dataclass(frozen=True)
class Prediction:
    plan: str
    tau: float
    stages: dict  # stage -> predicted seconds per step
    floors: dict  # stage -> floor seconds per step
    classes: dict  # stage -> {class: predicted seconds}
    class_floors: dict  # stage -> {class: floor seconds}
    lookups: dict  # how matmul times were found: {"table": n, "bandwidth": n, "roofline": n}
    calibrated: bool

    @property
    def step_s(self) -> float:
        return sum(self.stages.values())

    @property
    def per_token_s(self) -> float:
        return self.step_s / self.tau

    @property
    def floor_per_token_s(self) -> float:
        return sum(self.floors.values()) / self.tau

    def to_dict(self) -> dict:
        ms = lambda d: {k: 1e3 * v for k, v in d.items()}  # noqa: E731
        return {"plan": self.plan, "tau": self.tau, "ms_per_token": 1e3 * self.per_token_s,
                "ms_per_step": 1e3 * self.step_s, "stages_ms": ms(self.stages), "floors_ms": ms(self.floors),
                "classes_ms": {s: ms(c) for s, c in self.classes.items()}, "matmul_lookups": self.lookups,
                "calibrated": self.calibrated}


def _setting(deployment, gpu=None) -> Setting:
    if isinstance(deployment, Setting):
        return deployment
    if gpu is None:
        raise ValueError("a harness deployment needs its gpu config (predict(..., gpu=cfg.gpu)) for the rates")
    return Setting.from_deployment(deployment, gpu)


def kernel_seconds(kernel, rates: Rates) -> tuple[float, str | None]:
    """(predicted seconds of every launch of one kernel, how a matmul's time was found)."""
    if kernel.cls in ("matmul", "lm_head") and kernel.dot:
        per = kernel.bytes / kernel.count
        t, how = rates.matmul_time_s(kernel.impl, kernel.m, kernel.k, kernel.n, per, kernel.flops / kernel.count)
        return kernel.count * t, how
    flops = kernel.flops if kernel.dot else 0.0
    return kernel.count * 1e-6 * rates.launch_us + rates.roofline_s(kernel.bytes, flops), None


def predict(plan, deployment, tau: float | None = None, gpu=None) -> Prediction:
    """Time per step of each stage of `plan` at `deployment` (a `Setting`, or a harness Deployment with
    `gpu`), and per output token at `tau` (AR: one token per step; other plans: tokens per step, in
    [1, block size], for a tree in [1, depth + 1])."""
    s = _setting(deployment, gpu)
    if plan.verify == "ar":
        tau = 1.0
    else:  # a tree step emits at most its deepest path plus the bonus token, whatever its node budget
        most = plan.tree.depth + 1 if plan.tree is not None else plan.block_size
        if tau is None or not 1.0 <= float(tau) <= most:
            raise ValueError(f"plan {plan.name!r}: tau must be in [1, {most}] (tokens one step emits), got {tau}")
    c = step_counts(plan, s.shape)
    sharded = not plan.mesh.is_single
    if sharded:  # one device's share, and the links between them (`collectives`)
        c = collectives.per_device(c, plan.mesh, s.shape.hybrid)
        links = collectives.step_collectives(plan, s.shape)
        if links and s.hardware.interconnect_gbs <= 0:
            raise ValueError(f"plan {plan.name!r} is sharded but the gpu config gives no interconnect_gbs")
    stages, floors, classes, class_floors = {}, {}, {}, {}
    lookups: dict[str, int] = {}
    for stage in STAGES:
        part = c.select(stage)
        if not part.kernels:
            continue
        per_class: dict[str, float] = {}
        for k in part.kernels:
            t, how = kernel_seconds(k, s.rates)
            per_class[k.cls] = per_class.get(k.cls, 0.0) + t
            if how:
                lookups[how] = lookups.get(how, 0) + 1
        if stage == "accept":
            per_class["host"] = 1e-6 * s.rates.host_step_us
        if sharded and links.get(stage):
            per_class["interconnect"] = collectives.interconnect_s(links[stage], s.hardware.interconnect_gbs,
                                                                   s.hardware.collective_latency_us)
        classes[stage] = per_class
        stages[stage] = sum(per_class.values())
        floors[stage] = s.hardware.floor_s(part.total("floor_bytes"), part.total("floor_flops"))
        class_floors[stage] = {cls: s.hardware.floor_s(part.select(cls=cls).total("floor_bytes"),
                                                       part.select(cls=cls).total("floor_flops"))
                               for cls in per_class if cls not in ("host", "interconnect")}
    return Prediction(plan.name, float(tau), stages, floors, classes, class_floors, lookups, s.rates.calibrated)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured run: time per output token, tau, and the profiled split's fractions (None: one stage)."""

    per_token_s: float
    tau: float = 1.0
    split: dict | None = None  # {"draft": f, "verify": f, "bookkeeping": f}

    @classmethod
    def from_run(cls, run) -> "Measurement":
        """From a `methods.MethodRun`."""
        st = run.stats or {}
        return cls(run.decode_time_per_token, float(st.get("tau") or 1.0), st.get("time_split"))


def attribute(plan, deployment, measurement: Measurement, gpu=None) -> dict:
    """Each stage's measured time per step against its floor and prediction, and each kernel class's
    predicted time against its floor, both sorted by lost time (measured or predicted minus floor)."""
    p = predict(plan, deployment, measurement.tau, gpu)
    step = measurement.per_token_s * (1.0 if plan.verify == "ar" else measurement.tau)
    if measurement.split:
        measured = {SPLIT_NAMES[k]: v * step for k, v in measurement.split.items()}
    else:  # AR: no split; its accept is fused into the step
        measured = {st: step * v / p.step_s for st, v in p.stages.items()}
    stages = [{"stage": st, "measured_ms": 1e3 * measured.get(st, 0.0), "predicted_ms": 1e3 * p.stages[st],
               "floor_ms": 1e3 * p.floors[st], "lost_ms": 1e3 * (measured.get(st, 0.0) - p.floors[st]),
               "unpredicted_ms": 1e3 * (measured.get(st, 0.0) - p.stages[st])} for st in p.stages]
    classes = [{"stage": st, "class": cls, "predicted_ms": 1e3 * t,
                "floor_ms": 1e3 * p.class_floors[st].get(cls, 0.0),
                "lost_ms": 1e3 * (t - p.class_floors[st].get(cls, 0.0))}
               for st, per in p.classes.items() for cls, t in per.items()]
    return {"measured_ms_per_step": 1e3 * step, "predicted_ms_per_step": 1e3 * p.step_s,
            "error": p.step_s / step - 1.0, "stages": sorted(stages, key=lambda r: -r["lost_ms"]),
            "classes": sorted(classes, key=lambda r: -r["lost_ms"]), "prediction": p.to_dict(),
            "split_measured": measurement.split is not None}


def format_attribution(plan_name: str, att: dict, top: int = 3) -> list[str]:
    """Console lines: the stages by lost time, then the top kernel classes."""
    st = ", ".join(f"{r['stage']} {r['measured_ms']:.2f} (pred {r['predicted_ms']:.2f}, floor {r['floor_ms']:.2f})"
                   for r in att["stages"])
    cl = ", ".join(f"{r['stage']}.{r['class']} {r['predicted_ms']:.2f} vs floor {r['floor_ms']:.2f}"
                   for r in att["classes"][:top])
    split = "" if att["split_measured"] else " (no profiled split: stages shared as predicted)"
    return [f"{plan_name}: ms per step measured {att['measured_ms_per_step']:.2f}, predicted "
            f"{att['predicted_ms_per_step']:.2f} ({100 * att['error']:+.0f}%); by stage{split}: {st}",
            f"{plan_name}: largest predicted gaps to the floor: {cl}"]
