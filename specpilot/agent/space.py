"""The rewrite space: typed choices over a plan's fields, and rewrites applied to an incumbent plan.

A plan is handled as its config mapping (`decoding.plans.<name>`), so a found plan is a YAML file any run
can use; the choices derive from the deployment (block sizes, the kernels the device runs, their config
fields, meshes, the engine's batching fields under `workload=engine`), and every rewrite is checked by
the harness's own validation. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from pallas_kernels import dispatch
from specpilot import plan as plan_mod
from specpilot.harness import shapes
from specpilot.harness.config_schema import ConfigValueError, build_plans, plan_defaults, typed, validate
from specpilot.models.checkpoint import HYBRID_ARCHITECTURES

BLOCK_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32)
# drafters whose acceptance replays a profile or trace, whatever their forward computes: no draft width
REPLAYING_SOURCES = ("oracle", "oracle_trace")
# tree plans: node budgets (the root included), depths (drafted positions, below the drafter's block) and
# branchings; switching a chain to a tree starts from DEFAULT_TREE, clipped to the drafter's block
TREE_NODES = (4, 6, 8, 12, 16, 32, 64)
TREE_DEPTHS = (2, 3, 5, 7, 11, 15)
TREE_BRANCHINGS = (1, 2, 4)
DEFAULT_TREE = {"nodes": 8, "depth": 3, "branching": 2}
# two-level plans: how many of the drafted tree's nodes the first level keeps for the target to verify
TWO_LEVEL_KEEP = (4, 6, 8, 12, 16, 32)
DEFAULT_TWO_LEVEL = {"two_level.first": "drafter_confidence", "two_level.keep": 4}
PALLAS_ON_GPU = {"matmul": ("triton", "mosaic"), "gated_delta_rule": ("triton",),
                 "attention": ("triton", "triton_block"), "residual_norm": ("triton",)}
# w12 plans: which matrix classes are encoded (all; the large products; the MLP; all but the head)
W12_SUBSETS = (tuple(plan_mod.W12_CLASSES), ("gate_up", "down", "lm_head", "fc"), ("gate_up", "down"),
               ("qkv", "o", "gate_up", "down", "fc"))
OP_TARGETS = {"matmul": ("matmul", "lm_head"), "attention": ("attention",),
              "residual_norm": ("elementwise",)}  # others: the recurrence


@dataclasses.dataclass(frozen=True)
class Choice:
    """One plan field and the values it may take (`kind`: the field's type, for the search proposer)."""

    field: str  # dotted: "block_size", "kernels.matmul.implementation", "kernels.matmul.config.num_warps"
    values: tuple
    kind: str  # "categorical" | "int"
    targets: tuple[str, ...] = ()  # stages / kernel classes of the cost model this field acts on
    # a kernel config field applies only under one implementation: (its implementation field, the name)
    when: tuple[str, str | tuple[str, ...]] | None = None

    def applies(self, fields: Mapping) -> bool:
        """Whether this choice means anything for plan `fields` (a config field: its implementation first;
        the block size: a drafting plan, since an AR plan verifies one token whatever it is set to)."""
        if self.field == "block_size" and fields.get("verify") in ("ar", *plan_mod.TREE_KINDS):
            return False  # AR verifies one token; a tree's block is its width
        if self.field.startswith("batching.") and fields.get("verify", "chain") != "chain":
            return False
        return self.when is None or self.when_holds(current_value(fields, self.when[0]))

    def when_holds(self, value) -> bool:
        """Whether `value` of the field this choice depends on (`when`) lets it apply (`when[1]`: one
        implementation, or a tuple of those sharing the config field)."""
        if isinstance(value, (list, tuple)):  # an implementation list: its first entry
            value = value[0] if value else None
        allowed = self.when[1]
        return value in allowed if isinstance(allowed, tuple) else value == allowed

    def __post_init__(self):
        if not self.values:
            raise ValueError(f"choice {self.field!r} has no values")


@dataclasses.dataclass(frozen=True)
class Dropped:
    rewrite: dict
    reason: str


def rewrite_key(rewrite: Mapping[str, Any]) -> str:
    """A canonical string of a rewrite (memory and de-duplication key)."""
    return json.dumps({k: rewrite[k] for k in sorted(rewrite)}, sort_keys=True, default=list)


def get_field(fields: Mapping, dotted: str, default=None):
    node: Any = fields
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node or node[part] is None:
            return default
        node = node[part]
    return node


def current_value(fields: Mapping, dotted: str):
    """A plan mapping's value of a dotted field; a batching field it leaves out has the engine's default."""
    value = get_field(fields, dotted)
    if value is None and dotted.startswith("batching."):
        value = getattr(plan_mod.Batching(), dotted.split(".", 1)[1], None)
    return value


def apply(fields: Mapping, rewrite: Mapping[str, Any]) -> dict:
    """The plan mapping `fields` with each dotted field of `rewrite` set. Changing an op's implementation
    resets its config (a config belongs to the first implementation); `verify=ar` drops the block size;
    changing the weight format without naming matmul kernels takes the device's kernels for that format."""
    out = copy.deepcopy(dict(fields))
    for dotted, value in rewrite.items():
        parts = dotted.split(".")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = list(value) if isinstance(value, tuple) else value
        sets_config = any(k.startswith(f"kernels.{parts[1]}.config.") for k in rewrite) if len(parts) > 1 else False
        if len(parts) == 3 and parts[0] == "kernels" and parts[2] == "implementation" and not sets_config:
            node["config"] = {}
    changes_weights = "weights" in rewrite and rewrite["weights"] != fields.get("weights")
    if changes_weights and not any(k.startswith("kernels.matmul.") for k in rewrite):
        # a weight format's kernels are the device's for that format (gpu.matmul.<format>): w12 kept on
        # bf16's XLA dot would decode its weights in jnp and be judged by the wrong kernel
        out.setdefault("kernels", {})["matmul"] = {"implementation": None, "config": {}}
    if out.get("weights") != "w12":
        out.pop("w12_matrices", None)  # the encoded classes belong to w12 plans only
    if out.get("verify") != "two_level":
        out.pop("two_level", None)
    elif (out.get("two_level") or {}).get("first") != "early_exit":
        (out.get("two_level") or {}).pop("exit_layer", None)  # an exit layer belongs to early_exit only
    if out.get("verify") not in plan_mod.TREE_KINDS:
        out.pop("tree", None)  # a shape belongs to tree verification only
    elif "block_size" not in rewrite:
        out["block_size"] = None  # a tree's block is its width
    if out.get("verify") == "ar":
        out["block_size"] = None
    elif out.get("verify") == "chain" and rewrite.get("verify") == "chain" and "block_size" not in rewrite:
        out.setdefault("block_size", None)
    return out


def _config_values(cls: type) -> list[Choice]:
    """Typed choices over an implementation config's scalar fields: ints that are powers of two halved
    and doubled, booleans both ways (tuples, nested configs and strings are left at their defaults)."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default
        if isinstance(default, bool):
            out.append(Choice(f.name, (default, not default), "categorical"))
        elif isinstance(default, int) and default >= 1 and default & (default - 1) == 0 and f.name != "large_n":
            values = tuple(v for v in (default // 2, default, default * 2) if v >= 1)
            out.append(Choice(f.name, values, "int"))
    return [c for c in out if c.field != "interpret"]


@dataclasses.dataclass(frozen=True)
class Space:
    """The choices of one deployment, and the checks that turn a rewrite into a plan or a reason."""

    choices: tuple[Choice, ...]
    base_cfg: Any = dataclasses.field(compare=False, repr=False)  # the composed config (DictConfig)

    def choice(self, dotted: str) -> Choice | None:
        return next((c for c in self.choices if c.field == dotted), None)

    def targeting(self, target: str) -> list[Choice]:
        """The choices aimed at a cost-model stage or kernel class ("verify", "matmul", ...)."""
        return [c for c in self.choices if target in c.targets]

    def check(self, name: str, fields: Mapping) -> plan_mod.Plan | str:
        """The plan of `fields` if the deployment can run it, else the reason it cannot."""
        cfg = OmegaConf.create(OmegaConf.to_container(self.base_cfg, resolve=True))
        cfg.decoding.plans = {name: dict(fields)}
        try:
            cfg = typed(cfg)
            validate(cfg)
            return next(p for p in build_plans(cfg) if p.name == name)
        except (ConfigValueError, plan_mod.PlanError, ValueError, TypeError, KeyError) as e:
            return f"{type(e).__name__}: {e}"

    @functools.cached_property
    def _plan_defaults(self) -> dict:
        return plan_defaults(self.base_cfg)

    def quick_plan(self, name: str, fields: Mapping) -> plan_mod.Plan | None:
        """The plan of `fields` with the deployment's defaults, without `check`'s validation against the
        deployment (a fast estimate for ranking; a proposal still passes `rewrite`), None if it is no plan."""
        try:
            return plan_mod.build(name, dict(fields), **self._plan_defaults)
        except (plan_mod.PlanError, ValueError, TypeError, KeyError):
            return None

    def feasible(self, incumbent: Mapping) -> tuple["Space", list[Dropped]]:
        """The space without the values that fail on their own at this deployment (each one-field rewrite of
        `incumbent` the harness refuses, e.g. w12 weights on a float32 target), and those values with why."""
        removed, kept = [], []
        for c in self.choices:
            bad = []
            for rw in single_field_rewrites(self, incumbent, c):
                res = self.rewrite("probe", incumbent, rw)
                if isinstance(res, Dropped) and not res.reason.startswith("changes nothing"):
                    bad.append(rw[c.field])
                    removed.append(res)
            values = tuple(v for v in c.values if (list(v) if isinstance(v, tuple) else v) not in bad)
            kept.append(dataclasses.replace(c, values=values) if values else c)
        return dataclasses.replace(self, choices=tuple(kept)), removed

    def rewrite(self, name: str, incumbent: Mapping,
                rewrite: Mapping[str, Any]) -> tuple[dict, plan_mod.Plan] | Dropped:
        """(fields, plan) of `rewrite` applied to `incumbent`, or Dropped with the reason."""
        unknown = [k for k in rewrite if self.choice(k) is None and not _is_config_field(k)]
        if unknown:
            return Dropped(dict(rewrite), f"not in the rewrite space: {', '.join(unknown)}")
        for k, v in rewrite.items():  # e.g. a mechanism memory brings from a deployment whose space had it
            c = self.choice(k)
            if c is not None and c.kind == "categorical" and not _names_a_variant(v) and \
                    _canonical(v) not in map(_canonical, c.values):
                return Dropped(dict(rewrite), f"not offered here: {k}={json.dumps(v)} (this space offers "
                                              f"{', '.join(json.dumps(x) for x in c.values)})")
        fields = apply(incumbent, rewrite)
        result = self.check(name, fields)
        if isinstance(result, str):
            return Dropped(dict(rewrite), result)
        base = self.check(name, incumbent)
        if not isinstance(base, str) and base == result:
            return Dropped(dict(rewrite), "changes nothing (the incumbent's plan)")
        fields = plan_fields(result)
        return fields, result


def _names_a_variant(v) -> bool:
    """An implementation list naming a proposed program ("variant:<digest>"), which no space lists."""
    return isinstance(v, (list, tuple)) and any(isinstance(x, str) and x.startswith("variant:") for x in v)


def _canonical(v) -> str:
    """A field value as a comparable key (lists and tuples alike, mappings by sorted keys)."""
    return json.dumps(v, sort_keys=True, default=list)


def plan_fields(plan: plan_mod.Plan) -> dict:
    """A built plan as the full config mapping of its fields (defaults resolved), YAML-ready."""
    d = plan.describe()
    out = {"verify": plan.verify, "weights": plan.weights,
           "block_size": None if plan.verify == "ar" else plan.block_size,
           "kernels": {op: {"implementation": list(d["kernels"][op]["implementation"]),
                            "config": {k: list(v) if isinstance(v, tuple) else v
                                       for k, v in (d["kernels"][op]["config"] or {}).items()}}
                       for op in plan_mod.KERNEL_OPS}}
    for name in ("tree", "two_level"):  # tree and two_level plans' shapes
        if getattr(plan, name) is not None:
            out[name] = dataclasses.asdict(getattr(plan, name))
    if plan.batching != plan_mod.Batching():
        out["batching"] = dataclasses.asdict(plan.batching)
    if not plan.mesh.is_single:
        out["mesh"] = {"data": plan.mesh.data, "tensor": plan.mesh.tensor}
    if plan.weights == "w12":
        out["w12_matrices"] = list(plan.w12_matrices)
    if plan.draft_width is not None:
        out["draft_width"] = plan.draft_width
    return out


def default_tree(space: Space) -> dict:
    """`tree.*` fields of the tree a chain switches to: DEFAULT_TREE within the space's depths."""
    depths = space.choice("tree.depth")
    depth = min(DEFAULT_TREE["depth"], max(depths.values)) if depths else DEFAULT_TREE["depth"]
    return {"tree.nodes": DEFAULT_TREE["nodes"], "tree.depth": depth, "tree.branching": DEFAULT_TREE["branching"]}


def _is_config_field(dotted: str) -> bool:
    parts = dotted.split(".")
    return len(parts) == 4 and parts[0] == "kernels" and parts[1] in plan_mod.KERNEL_OPS and parts[2] == "config"


def kernel_config_choices(op: str, implementation: str) -> list[Choice]:
    """`kernels.<op>.config.<field>` choices of one implementation (its config dataclass's fields)."""
    cls = dispatch.CONFIGS[op][implementation]
    targets = OP_TARGETS.get(op, ("recurrence",))
    return [dataclasses.replace(c, field=f"kernels.{op}.config.{c.field}", targets=targets,
                                when=(f"kernels.{op}.implementation", implementation))
            for c in _config_values(cls)]


WORKLOADS = ("harness", "engine")


def batching_choices(cfg: DictConfig) -> list[Choice]:
    """The engine's batching fields as choices (chain plans; `workload="engine"` only)."""
    slots, block = int(cfg.bench.batch_size), int(cfg.drafter.block_size)
    full = slots * block
    budgets = tuple(sorted({max(2 * slots, full * k // 4) for k in (1, 2, 3)}))
    b = plan_mod.Batching()
    return [Choice("batching.policy", _first(b.policy, plan_mod.BATCHING_POLICIES), "categorical",
                   targets=("host",)),
            Choice("batching.draft_budget", _first(b.draft_budget, plan_mod.DRAFT_BUDGETS), "categorical",
                   targets=("verify", "accept")),
            Choice("batching.token_budget", budgets, "int", targets=("verify", "matmul"),
                   when=("batching.draft_budget", "confidence")),
            Choice("batching.verify", _first(b.verify, plan_mod.VERIFY_LAYOUTS), "categorical",
                   targets=("verify", "matmul", "attention")),
            Choice("batching.streams", (b.streams, 2, 4), "int", targets=("verify", "matmul"),
                   when=("batching.verify", "packed")),
            Choice("batching.pricing", _first(b.pricing, plan_mod.PRICINGS), "categorical",
                   targets=("verify", "matmul"), when=("batching.draft_budget", "confidence")),
            Choice("batching.overlap", _first(b.overlap, plan_mod.OVERLAPS), "categorical", targets=("draft",)),
            Choice("batching.dispatch", _first(b.dispatch, plan_mod.DISPATCHES), "categorical",
                   targets=("host", "accept")),
            Choice("batching.kv", _first(b.kv, plan_mod.KV_LAYOUTS), "categorical", targets=("attention",)),
            Choice("batching.page_size", tuple(sorted({b.page_size, 16, 32, 64})), "int", targets=("attention",),
                   when=("batching.kv", "paged"))]


def _first(default: str, known) -> tuple:
    return (default,) + tuple(v for v in known if v != default)


def build_space(cfg: DictConfig, *, platform: str = "cpu", devices: int = 1, workload: str = "harness") -> Space:
    """The rewrite space of a composed run config on a device `platform` ("cpu", "gpu") with `devices`,
    its candidates timed by the run harness or through the serving engine (`workload`)."""
    if workload not in WORKLOADS:
        raise ValueError(f"agent.workload: {workload!r} is not one of {', '.join(WORKLOADS)}")
    d = cfg.drafter
    kinds = ("ar", "chain", "tree") if workload == "engine" else ("ar", "chain", "tree", "two_level")
    choices = [Choice("verify", kinds if d.source != "none" else ("ar",),  # the engine runs no two_level plan
                      "categorical", targets=("draft", "verify", "accept"))]
    if d.source != "none":
        top = int(d.block_size)
        sizes = tuple(b for b in BLOCK_SIZES if b <= top) or (top,)
        choices.append(Choice("block_size", sizes, "int", targets=("verify", "draft", "attention")))
        tree, two = ("verify", plan_mod.TREE_KINDS), ("verify", "two_level")
        layers = _target_layers(cfg)  # an early exit needs a layer to exit after: none offered where unknown
        firsts = plan_mod.FIRST_LEVELS if layers and layers > 1 else ("drafter_confidence",)
        choices += [Choice("tree.nodes", TREE_NODES, "int", targets=("verify", "attention"), when=tree),
                    Choice("tree.depth", tuple(x for x in TREE_DEPTHS if x < top) or (top - 1,), "int",
                           targets=("verify", "draft"), when=tree),
                    Choice("tree.branching", TREE_BRANCHINGS, "int", targets=("verify", "draft"), when=tree),
                    Choice("two_level.first", firsts, "categorical", targets=("verify",), when=two),
                    Choice("two_level.keep", TWO_LEVEL_KEEP, "int", targets=("verify", "attention"), when=two)]
        if d.source not in REPLAYING_SOURCES and top > 4:  # as wide as trained, or nearer the plan's block
            widths = tuple(sorted({w for w in (4, 8) if w < top} | {top}))
            choices.append(Choice("draft_width", widths, "int", targets=("draft",), when=("verify", "chain")))
        if layers and layers > 1:  # early exits after a quarter or half of the target's layers, or its first
            exits = tuple(sorted({max(1, layers // 4), max(1, layers // 2), 1}))
            choices.append(Choice("two_level.exit_layer", exits, "int", targets=("verify",),
                                  when=("two_level.first", "early_exit")))
    choices.append(Choice("weights", plan_mod.WEIGHT_FORMATS, "categorical", targets=("matmul", "lm_head")))
    choices.append(Choice("w12_matrices", W12_SUBSETS, "categorical", targets=("matmul", "lm_head"),
                          when=("weights", "w12")))
    hybrid = _is_hybrid(cfg.target)
    for op in plan_mod.KERNEL_OPS:
        if op == "gated_delta_rule" and not hybrid or op.startswith("tree_"):
            continue  # no recurrence in a dense target; the tree ops keep their defaults here
        if op in ("attention", "residual_norm") and platform != "gpu":
            continue  # these kernels run on GPUs only: elsewhere the op has XLA alone
        lists = [("xla",)]
        if platform == "gpu":
            lists += [(impl, "xla") for impl in PALLAS_ON_GPU[op]]
        elif op == "matmul":
            lists.append(("cpu_rows", "xla"))  # float32 products that stay near one row's cost at 4-16 rows
        targets = OP_TARGETS.get(op, ("recurrence",))
        choices.append(Choice(f"kernels.{op}.implementation", tuple(lists), "categorical", targets=targets))
        if platform == "gpu":
            for impl in PALLAS_ON_GPU[op]:
                choices.extend(kernel_config_choices(op, impl))
    if workload == "engine" and d.source != "none":
        choices.extend(c if c.field != "batching.verify" or not hybrid else  # packed: dense targets only
                       dataclasses.replace(c, values=("padded",)) for c in batching_choices(cfg))
    if devices > 1:
        meshes = tuple((dd, devices // dd) for dd in range(1, devices + 1) if devices % dd == 0)
        choices.append(Choice("mesh", tuple({"data": a, "tensor": b} for a, b in meshes), "categorical",
                              targets=("matmul", "attention", "interconnect")))
    return Space(tuple(_dedupe(choices)), cfg)


def _hf_config(tconf) -> dict:
    """The target's model config: a random target's shape, or a checkpoint's config.json ({} if neither)."""
    hf = OmegaConf.to_container(tconf.model, resolve=True) if tconf.get("model") else {}
    if tconf.source == "hf" and tconf.path and (Path(str(tconf.path)).expanduser() / "config.json").is_file():
        hf = json.loads((Path(str(tconf.path)).expanduser() / "config.json").read_text())
    return hf


def _num_layers(tconf) -> int | None:
    n = _hf_config(tconf).get("num_hidden_layers")
    return int(n) if n else None


def _target_layers(cfg: DictConfig) -> int | None:
    """The target's layer count: from its model config, else from its converted checkpoint (a GGUF target's
    header, converted on first use); None where it is not known before the target is built."""
    n = _num_layers(cfg.target)
    if n:
        return n
    try:
        return getattr(shapes.target_config(cfg), "num_layers", None)
    except ConfigValueError:
        return None


def _is_hybrid(tconf) -> bool:
    """Whether the target has linear-attention layers."""
    hf = _hf_config(tconf)
    return (hf.get("architectures") or [None])[0] in HYBRID_ARCHITECTURES or hf.get("model_type") == "qwen3_5_text"


def _dedupe(choices: list[Choice]) -> list[Choice]:
    """One choice per field; a config field two implementations share (same values) applies under either."""
    out: dict[str, Choice] = {}
    for c in choices:
        first = out.get(c.field)
        if first is None:
            out[c.field] = c
        elif first.when and c.when and first.when[0] == c.when[0] and first.values == c.values:
            names = first.when[1] if isinstance(first.when[1], tuple) else (first.when[1],)
            out[c.field] = dataclasses.replace(first, when=(first.when[0], names + (c.when[1],)))
    return list(out.values())


def single_field_rewrites(space: Space, incumbent: Mapping, choice: Choice) -> list[dict]:
    """Every value of `choice` other than the incumbent's, as one-field rewrites. Switching to the confidence
    draft budget without a token budget also sets the middle one of the space's token budgets: with none,
    every row keeps its whole block and the budget changes nothing."""
    if not choice.applies(incumbent):
        return []
    current = current_value(incumbent, choice.field)
    budgets = space.choice("batching.token_budget")
    out = []
    for v in choice.values:
        value = list(v) if isinstance(v, tuple) else v
        if value != current and not (isinstance(current, list) and list(current) == value):
            out.append({choice.field: value})
            if (choice.field, value) in (("verify", "tree"), ("verify", "two_level")) and not incumbent.get("tree"):
                out[-1].update(default_tree(space))
            if (choice.field, value) == ("verify", "two_level"):
                out[-1].update(DEFAULT_TWO_LEVEL)
            exits = space.choice("two_level.exit_layer")
            if (choice.field, value) == ("two_level.first", "early_exit") and exits is not None:
                out[-1]["two_level.exit_layer"] = exits.values[len(exits.values) // 2]
            if (choice.field, value) == ("batching.draft_budget", "confidence") and budgets is not None \
                    and current_value(incumbent, "batching.token_budget") is None:
                out[-1]["batching.token_budget"] = budgets.values[len(budgets.values) // 2]
    return out
