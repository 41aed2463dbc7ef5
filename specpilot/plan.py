"""The plan: every choice a deployment makes about how it decodes, one field each.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pallas_kernels import dispatch
from pallas_kernels.dispatch import OpChoice
from specpilot.sharding import MeshError, MeshShape

VERIFY_KINDS = ("ar", "chain", "tree", "two_level")
RESERVED_VERIFY_KINDS = ()
TREE_KINDS = ("tree", "two_level")  # verification kinds that draft a tree (`tree:` shape)
WEIGHT_FORMATS = ("bf16", "w12")
# the matrix classes a w12 plan may encode (`Plan.w12_matrices`), each with the param names it covers
W12_CLASSES = {"qkv": ("q", "k", "v", "qkv"), "o": ("o",), "gate_up": ("gate", "up", "gate_up"),
               "down": ("down",), "lm_head": ("lm_head",), "fc": ("fc",)}
BATCHING_POLICIES = ("continuous", "static")  # static: a new wave is admitted only into an empty batch
DRAFT_BUDGETS = ("fixed", "confidence")  # fixed: every row verifies block_size - 1 drafts
VERIFY_LAYOUTS = ("padded", "packed")  # packed: only kept candidates enter the verify forward
PRICINGS = ("flat", "measured")  # the confidence chooser's step cost: flat, or timed at each stream size
OVERLAPS = ("none", "halves")  # halves: verify one half of the slots while drafting the other
DISPATCHES = ("sync", "pipelined")  # pipelined: the next step is enqueued before this one's tokens are read
KV_LAYOUTS = ("contiguous", "paged")  # paged: K/V in pages of a shared pool, allocated as rows grow
FIRST_LEVELS = ("drafter_confidence", "early_exit")  # what scores a two_level plan's drafted nodes
KERNEL_OPS = ("matmul", "gated_delta_rule", "tree_gated_delta_rule", "tree_attention",
              "attention", "residual_norm")  # the fields of `Kernels`, each a `dispatch` op


class PlanError(ValueError):
    """A plan with an impossible or not yet available choice; the message names the field."""


def _fail(plan: str, field: str, msg: str):
    raise PlanError(f"decoding.plans.{plan}.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementation of each op (`pallas_kernels.dispatch.OpChoice`: names tried in order, falling
    through on NotImplementedError, and the first one's frozen config of block sizes and options):
    `matmul` for the linear layers, `gated_delta_rule` for a hybrid target's linear-attention recurrence
    in decode and chain verification (dense targets have none), `tree_gated_delta_rule` for it over a tree
    (node from parent), `tree_attention` for the attention layers of a tree verification forward,
    `attention` for them in every other forward (decode, chain verification, prefill chunks, the serving
    engine's steps: each row reads its committed slots and its own new tokens, `dispatch.attention`),
    `residual_norm` for a dense layer's residual adds with the RMSNorm that reads each
    (`dispatch.residual_norm`; only a choice naming "triton" first changes the forward)."""

    matmul: OpChoice = OpChoice(("xla",))
    gated_delta_rule: OpChoice = OpChoice(("xla",))
    tree_gated_delta_rule: OpChoice = OpChoice(("xla",))
    tree_attention: OpChoice = OpChoice(("xla",))
    attention: OpChoice = OpChoice(("xla",))
    residual_norm: OpChoice = OpChoice(("xla",))


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A tree plan's drafted tree: node budget (the root included), depth and branching (top-k)."""

    nodes: int
    depth: int
    branching: int

    @property
    def width(self) -> int:
        """Tokens one tree step writes past the committed length: the nodes, or the drafter's block."""
        return max(self.nodes, self.depth + 1)


@dataclasses.dataclass(frozen=True)
class TwoLevel:
    """A two_level plan's first level (`decoding.two_level`): what scores the drafted tree's nodes
    (`drafter_confidence` or `early_exit`), how many nodes the target verifies, for `early_exit` how
    many target layers score them and `exit_head`, a trained head's folder (`models.exit_head`; None: the
    target's own final norm and head)."""

    first: str
    keep: int
    exit_layer: int | None = None
    exit_head: str | None = None


def max_nodes(depth: int, branching: int) -> int:
    """Nodes of the full tree (root included): 1 + k + k^2 + ... + k^depth."""
    return 1 + sum(branching ** d for d in range(1, depth + 1))


def check_first_level(first: str, keep: int, exit_layer, nodes: int, num_layers: int | None) -> None:
    """A clear error for a two-level first level that cannot run (`num_layers`: the target's, if known)."""
    if first not in FIRST_LEVELS:
        raise ValueError(f"two_level.first must be one of {FIRST_LEVELS}, got {first!r}")
    if not isinstance(keep, int) or isinstance(keep, bool) or not 2 <= keep < nodes:
        raise ValueError(f"two_level.keep must be an integer in 2..{nodes - 1} (fewer than the tree's "
                         f"{nodes} nodes, the root and >= 1 draft), got {keep!r}")
    if first == "early_exit":
        if not isinstance(exit_layer, int) or isinstance(exit_layer, bool) or exit_layer < 1:
            raise ValueError(f"two_level.exit_layer must be a positive integer for early_exit, got {exit_layer!r}")
        if num_layers is not None and exit_layer >= num_layers:
            raise ValueError(f"two_level.exit_layer {exit_layer} must be below the target's {num_layers} layers")
    elif exit_layer is not None:
        raise ValueError(f"two_level.exit_layer belongs to the early_exit first level, not {first!r}")


@dataclasses.dataclass(frozen=True)
class Batching:
    """How the serving engine batches a plan's requests (`specpilot.serving.engine`).

    `policy`: `continuous` admits a request into any free slot between steps, `static` admits a new
    wave only once every slot is free (requests decoded in lockstep). `draft_budget`: `fixed` verifies
    block_size - 1 drafts per row, `confidence` chooses each row's draft count per step from the
    drafter's confidence under `token_budget` (mechanism 1). `verify`: `padded` runs every row's full
    block, `packed` only the kept candidates, packed into one stream of `token_budget` tokens
    (mechanism 2). `token_budget`: verification tokens (candidates plus each row's last token) one step
    may check over the batch; None: slots x block_size (no limit). `streams`: packed verification
    compiles this many stream sizes, evenly spaced up to `token_budget`, and each step runs the smallest
    that holds its kept candidates, so the products see only what the step verifies (rounded up to a
    size); 1: always `token_budget`. `pricing`: what the confidence chooser takes a step to cost, `flat`
    (fill the budget) or `measured` (packed: the engine times its draft and each stream size's verify
    forward when it is built, `serving.step_timing`). `overlap`: `none` drafts and verifies
    every row in each step, `halves` verifies one half of the slots with the drafts prepared for it in
    the step before while drafting the other half in the same program (mechanism 3,
    `specpilot.serving.overlap`); a step then verifies half the slots, so `token_budget` counts those.
    `dispatch`: `sync` reads each step's tokens before enqueueing the next; `pipelined` enqueues the
    next step first, so the host's work (launching a step's kernels, reading tokens, bookkeeping) runs
    while the device computes the step before (a finished row may run one extra step, its tokens
    dropped; a freed slot is admitted into one step later). `kv`: `contiguous` preallocates every slot's
    K/V for the whole context, `paged` keeps it in a pool of `pages` pages of `page_size` slots, allocated
    as a row grows and freed when its request ends (`specpilot.serving.pages`; None: enough pages for
    every slot's whole context); dense AR and chain plans on one device, padded verification, no halves."""

    policy: str = "continuous"
    draft_budget: str = "fixed"
    verify: str = "padded"
    token_budget: int | None = None
    streams: int = 1
    pricing: str = "flat"
    overlap: str = "none"
    dispatch: str = "pipelined"
    kv: str = "contiguous"
    page_size: int = 16
    pages: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    verify: str = "chain"
    weights: str = "bf16"
    block_size: int = 1  # tokens one verification checks (last token + drafts); 1 for `ar`
    kernels: Kernels = Kernels()
    tree: TreeShape | None = None  # tree and two_level plans: the drafted tree's shape
    two_level: TwoLevel | None = None  # two_level plans: the first level
    batching: Batching = Batching()  # the serving engine's batching (harness runs decode one fixed batch)
    mesh: MeshShape = MeshShape()  # devices over batch rows (data) x heads and features (tensor)
    # a w12 plan's encoded matrix classes (W12_CLASSES; an untied LM head, a drafter's `fc`); the rest stay
    # bf16 and go to XLA's dot
    w12_matrices: tuple[str, ...] = tuple(W12_CLASSES)
    # rows a block drafter drafts each block over, the first block_size kept (a drafter trained at a wider
    # block drafts better as wide as it was trained); None: the drafter's own setting (`drafter.draft_width`)
    draft_width: int | None = None

    def __post_init__(self):
        if self.verify in RESERVED_VERIFY_KINDS:
            _fail(self.name, "verify", f"{self.verify!r} verification is not implemented yet; "
                  f"available: {', '.join(VERIFY_KINDS)}")
        if self.verify not in VERIFY_KINDS:
            _fail(self.name, "verify", f"{self.verify!r} is not one of {VERIFY_KINDS + RESERVED_VERIFY_KINDS}")
        if self.weights not in WEIGHT_FORMATS:
            _fail(self.name, "weights", f"{self.weights!r} is not one of {WEIGHT_FORMATS}")
        if self.verify == "ar" and self.block_size != 1:
            _fail(self.name, "block_size", f"an ar plan verifies one token per step, got {self.block_size}")
        if self.verify == "chain" and self.block_size < 2:
            _fail(self.name, "block_size", f"a chain verifies the last token and >= 1 draft, got {self.block_size}")
        if self.verify in TREE_KINDS:
            self._check_tree()
        elif self.tree is not None:
            _fail(self.name, "tree", f"tree shapes belong to tree verification (verify: tree), not {self.verify!r}")
        if self.verify == "two_level":
            self._check_two_level()
        elif self.two_level is not None:
            _fail(self.name, "two_level", f"a first level belongs to verify: two_level, not {self.verify!r}")
        self._check_batching()
        self._check_w12_matrices()
        if self.draft_width is not None:
            w = self.draft_width
            if not isinstance(w, int) or isinstance(w, bool) or w < 1:
                _fail(self.name, "draft_width", f"must be a positive number of rows or null, got {w!r}")
            if self.verify == "ar":
                _fail(self.name, "draft_width", "an ar plan drafts nothing; leave it unset")
        for op in KERNEL_OPS:
            if not getattr(self.kernels, op).implementation:
                _fail(self.name, f"kernels.{op}.implementation", "name at least one implementation")
        if not isinstance(self.mesh, MeshShape):
            _fail(self.name, "mesh", f"must be a MeshShape, got {type(self.mesh).__name__}")
        if not self.mesh.is_single and self.weights != "bf16":
            _fail(self.name, "mesh", f"tensor/data-parallel plans take bf16 weights (W12 layouts are not "
                  f"sharded), got weights={self.weights!r}")
        for op in KERNEL_OPS:  # Pallas kernels are not partitioned by the compiler
            impl = getattr(self.kernels, op).implementation
            if not self.mesh.is_single and any(i != "xla" for i in impl):
                _fail(self.name, "mesh", f"tensor/data-parallel plans compute through XLA (kernels.{op}."
                      f"implementation=[xla]), got {list(impl)}")

    def _check_batching(self):
        b = self.batching
        if not isinstance(b, Batching):
            _fail(self.name, "batching", f"must be a Batching, got {type(b).__name__}")
        for field, known in (("policy", BATCHING_POLICIES), ("draft_budget", DRAFT_BUDGETS),
                             ("verify", VERIFY_LAYOUTS), ("overlap", OVERLAPS), ("dispatch", DISPATCHES),
                             ("kv", KV_LAYOUTS), ("pricing", PRICINGS)):
            if getattr(b, field) not in known:
                _fail(self.name, f"batching.{field}", f"{getattr(b, field)!r} is not one of {known}")
        self._check_paged()
        if self.verify != "chain":
            for field, plain in (("draft_budget", "fixed"), ("verify", "padded"), ("overlap", "none")):
                if getattr(b, field) != plain:
                    _fail(self.name, f"batching.{field}", f"{getattr(b, field)!r} needs a chain plan "
                          f"(verify: chain), got verify={self.verify!r}")
        if not isinstance(b.streams, int) or isinstance(b.streams, bool) or b.streams < 1:
            _fail(self.name, "batching.streams", f"must be a positive integer, got {b.streams!r}")
        if b.streams > 1 and b.verify != "packed":
            _fail(self.name, "batching.streams", f"{b.streams} stream sizes need verify: packed (a padded step "
                  f"computes every row's whole block), got verify={b.verify!r}")
        if b.pricing == "measured" and (b.verify, b.draft_budget) != ("packed", "confidence"):
            _fail(self.name, "batching.pricing", f"measured prices packed steps for the confidence chooser: it "
                  f"needs verify: packed and draft_budget: confidence, got {b.verify!r}, {b.draft_budget!r}")
        t = b.token_budget
        if t is not None:
            if not isinstance(t, int) or isinstance(t, bool) or t < 2:
                _fail(self.name, "batching.token_budget", f"must be null or an integer >= 2 (a row's last "
                      f"token and one draft), got {t!r}")
            if self.verify != "chain":
                _fail(self.name, "batching.token_budget", f"budgets chain verification, got verify={self.verify!r}")

    def _check_w12_matrices(self):
        m = self.w12_matrices
        if not isinstance(m, tuple) or not m or len(set(m)) != len(m) or any(c not in W12_CLASSES for c in m):
            _fail(self.name, "w12_matrices", f"a non-empty list of distinct matrix classes from "
                  f"{', '.join(W12_CLASSES)}, got {m!r}")
        if self.weights != "w12" and set(m) != set(W12_CLASSES):
            _fail(self.name, "w12_matrices", f"chooses what a w12 plan encodes; this plan's weights are "
                  f"{self.weights!r}")

    def w12_params(self) -> tuple[tuple[str, ...], bool, bool]:
        """(per-layer param names, the LM head?, a drafter's fc?) this plan encodes in W12 (all for w12)."""
        names = tuple(n for c in self.w12_matrices if c not in ("lm_head", "fc") for n in W12_CLASSES[c])
        return names, "lm_head" in self.w12_matrices, "fc" in self.w12_matrices

    def _check_paged(self):
        b = self.batching
        for field, value in (("page_size", b.page_size), ("pages", b.pages)):
            if not (value is None and field == "pages") and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                _fail(self.name, f"batching.{field}", f"must be a positive integer{' or null' * (field == 'pages')}, "
                      f"got {value!r}")
        if b.kv != "paged":
            return
        if self.verify not in ("ar", "chain"):
            _fail(self.name, "batching.kv", f"paged K/V runs ar and chain plans, got verify={self.verify!r}; "
                  f"use kv: contiguous")
        for field, plain in (("verify", "padded"), ("overlap", "none")):
            if getattr(b, field) != plain:
                _fail(self.name, "batching.kv", f"paged K/V is not implemented with batching.{field}="
                      f"{getattr(b, field)!r}; use {field}: {plain} or kv: contiguous")
        if isinstance(self.mesh, MeshShape) and not self.mesh.is_single:
            _fail(self.name, "batching.kv", "paged K/V runs on one device; a sharded plan needs kv: contiguous")

    def _check_tree(self):
        if not isinstance(self.tree, TreeShape):
            _fail(self.name, "tree", "a tree plan needs tree: {nodes, depth, branching}")
        for field in ("nodes", "depth", "branching"):
            value = getattr(self.tree, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(self.name, f"tree.{field}", f"must be a positive integer, got {value!r}")
        if self.tree.nodes < 2:
            _fail(self.name, "tree.nodes", f"a tree verifies the last token and >= 1 drafted node, got {self.tree.nodes}")
        full = max_nodes(self.tree.depth, self.tree.branching)
        if self.tree.nodes > full:
            _fail(self.name, "tree.nodes", f"{self.tree.nodes} exceeds the {full} nodes of a full tree of depth "
                  f"{self.tree.depth} and branching {self.tree.branching}")
        if self.block_size != self.tree.width:
            _fail(self.name, "block_size", f"a tree plan's block size is its width max(nodes, depth + 1) = "
                  f"{self.tree.width}, got {self.block_size}")

    def _check_two_level(self):
        if not isinstance(self.two_level, TwoLevel):
            _fail(self.name, "two_level", "a two_level plan needs two_level: {first, keep[, exit_layer]}")
        t = self.two_level
        try:
            check_first_level(t.first, t.keep, t.exit_layer, self.tree.nodes, None)
        except ValueError as e:
            field = next((f for f in ("first", "keep", "exit_layer") if f"two_level.{f}" in str(e)), "first")
            _fail(self.name, f"two_level.{field}", str(e))
        if t.exit_head is not None:
            if not isinstance(t.exit_head, str) or not t.exit_head.strip():
                _fail(self.name, "two_level.exit_head", f"a trained exit head's folder (a path), got {t.exit_head!r}")
            if t.first != "early_exit":
                _fail(self.name, "two_level.exit_head", f"a trained exit head belongs to the early_exit first "
                      f"level, not {t.first!r}")

    @property
    def uses_drafter(self) -> bool:
        return self.verify != "ar"

    @property
    def bits_per_weight(self) -> float:
        return {"bf16": 16.0, "w12": 12.0}[self.weights]

    def describe(self) -> dict:
        """The plan as plain data (results records carry it)."""
        out = dataclasses.asdict(self)
        for op in KERNEL_OPS:
            c = getattr(self.kernels, op)
            config = dataclasses.asdict(c.config) if dataclasses.is_dataclass(c.config) else c.config
            out["kernels"][op] = {"implementation": list(c.implementation), "config": config}
        return out


def is_ar_baseline_candidate(plan: Plan) -> bool:
    """A plan that can be the AR baseline: one token per step, bf16 weights."""
    return plan.verify == "ar" and plan.weights == "bf16"


def _op_choice(name: str, kernels, op: str, default) -> OpChoice:
    """kernels.<op> of a plan's fields as an OpChoice: its implementation list (None: `default`, the gpu
    group's) and the first implementation's config mapping, typed by `dispatch.choice` (an unknown
    implementation or option fails naming the field)."""
    fields = (kernels.get(op) or {}) if isinstance(kernels, Mapping) else {}
    impl = fields.get("implementation")
    impl = default if impl is None else impl
    impl = tuple(str(i) for i in ([impl] if isinstance(impl, str) else impl))
    try:
        return dispatch.choice(op, impl, dict(fields.get("config") or {}) or None)
    except (ValueError, TypeError, KeyError) as e:
        _fail(name, f"kernels.{op}", str(e))


def build(name: str, fields: Mapping[str, Any], *, drafter_block_size: int | None,
          default_matmul: Mapping[str, Any], default_gated_delta_rule=("xla",),
          default_tree_gated_delta_rule=("xla",), default_tree_attention=("xla",),
          default_attention=("xla",), default_residual_norm=("xla",)) -> Plan:
    """A Plan from a config mapping (the YAML's fields), with the deployment's defaults filled in.

    `default_matmul`: weight format -> implementation list; `default_gated_delta_rule`,
    `default_tree_gated_delta_rule`, `default_tree_attention`, `default_attention`, `default_residual_norm`:
    implementation lists (the `gpu` group's defaults, `gpu.<op>`). Each kernel config mapping becomes its
    first implementation's typed config (`dispatch.choice`), so an unknown option fails here, naming the field.
    """
    verify = str(fields.get("verify", "chain"))
    weights = str(fields.get("weights", "bf16"))
    if weights not in WEIGHT_FORMATS:
        _fail(name, "weights", f"{weights!r} is not one of {WEIGHT_FORMATS}")
    block = fields.get("block_size")
    tree = _tree(name, fields.get("tree"))
    if verify in TREE_KINDS and tree is not None:
        if block is not None and block != tree.width:
            _fail(name, "block_size", f"a tree plan's block size is its width max(nodes, depth + 1) = "
                  f"{tree.width}, got {block} (leave it unset)")
        block = tree.width
    if verify == "ar":
        if block not in (None, 1):
            _fail(name, "block_size", f"an ar plan verifies one token per step, got {block}")
        block = 1
    elif block is None:
        if drafter_block_size is None:
            _fail(name, "block_size", f"a {verify} plan needs a drafter (its block size is the default)")
        block = drafter_block_size
    kernels = fields.get("kernels") or {}
    mesh = _mesh(name, fields.get("mesh"))
    if not mesh.is_single:  # sharded plans compute through XLA unless a plan says otherwise
        default_matmul = {weights: ["xla"]}
        default_gated_delta_rule = default_tree_gated_delta_rule = default_tree_attention = ["xla"]
        default_attention = default_residual_norm = ["xla"]
    matmul_fields = (kernels.get("matmul") or {}) if isinstance(kernels, Mapping) else {}
    if matmul_fields.get("implementation") is None and weights not in default_matmul:
        _fail(name, "kernels.matmul.implementation", f"the gpu config gives no default for {weights!r} weights")
    chosen = Kernels(matmul=_op_choice(name, kernels, "matmul", default_matmul.get(weights)),
                     gated_delta_rule=_op_choice(name, kernels, "gated_delta_rule", default_gated_delta_rule),
                     tree_gated_delta_rule=_op_choice(name, kernels, "tree_gated_delta_rule",
                                                      default_tree_gated_delta_rule),
                     tree_attention=_op_choice(name, kernels, "tree_attention", default_tree_attention),
                     attention=_op_choice(name, kernels, "attention", default_attention),
                     residual_norm=_op_choice(name, kernels, "residual_norm", default_residual_norm))
    w12 = fields.get("w12_matrices")
    w12 = tuple(W12_CLASSES) if w12 is None else (tuple(w12) if isinstance(w12, (list, tuple)) else w12)
    return Plan(name=name, verify=verify, weights=weights, block_size=int(block), kernels=chosen,
                tree=tree, two_level=_two_level(name, fields.get("two_level")),
                batching=_batching(name, fields.get("batching")), mesh=mesh, w12_matrices=w12,
                draft_width=fields.get("draft_width"))


def _batching(name: str, fields) -> Batching:
    """A plan's batching from its config mapping ({policy, draft_budget, verify, token_budget, overlap}; absent
    or null: the defaults)."""
    if fields is None:
        return Batching()
    if isinstance(fields, Batching):
        return fields
    if not isinstance(fields, Mapping):
        _fail(name, "batching", f"expected a mapping with policy, draft_budget, verify, token_budget and overlap, "
              f"got {fields!r}")
    known = [f.name for f in dataclasses.fields(Batching)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        _fail(name, "batching", f"unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return Batching(**{k: v for k, v in fields.items() if v is not None or k == "token_budget"})


def _tree(name: str, fields) -> TreeShape | None:
    """A plan's tree shape from its config mapping ({nodes, depth, branching}; absent or null: none)."""
    if fields is None:
        return None
    if not isinstance(fields, Mapping):
        _fail(name, "tree", f"expected a mapping with nodes, depth and branching, got {fields!r}")
    unknown = sorted(set(fields) - {"nodes", "depth", "branching"})
    if unknown:
        _fail(name, "tree", f"unknown key(s) {', '.join(map(repr, unknown))}; known: nodes, depth, branching")
    missing = [k for k in ("nodes", "depth", "branching") if fields.get(k) is None]
    if missing:
        _fail(name, f"tree.{missing[0]}", "missing (a tree plan gives nodes, depth and branching)")
    return TreeShape(**{k: fields[k] for k in ("nodes", "depth", "branching")})


def _two_level(name: str, fields) -> TwoLevel | None:
    """A plan's first level from its config mapping ({first, keep, exit_layer, exit_head}; absent or null:
    none)."""
    if fields is None:
        return None
    known = ("first", "keep", "exit_layer", "exit_head")
    if not isinstance(fields, Mapping):
        _fail(name, "two_level", f"expected a mapping with first, keep and exit_layer, got {fields!r}")
    unknown = sorted(set(fields) - set(known))
    if unknown:
        _fail(name, "two_level", f"unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    for k in ("first", "keep"):
        if fields.get(k) is None:
            _fail(name, f"two_level.{k}", "missing (a two_level plan gives first and keep)")
    return TwoLevel(str(fields["first"]), fields["keep"], fields.get("exit_layer"), fields.get("exit_head"))


def _mesh(name: str, fields) -> MeshShape:
    """A plan's mesh from its config mapping ({data, tensor}; absent or null: one device)."""
    if fields is None:
        return MeshShape()
    if not isinstance(fields, Mapping):
        _fail(name, "mesh", f"expected a mapping with data and tensor, got {fields!r}")
    unknown = sorted(set(fields) - {"data", "tensor"})
    if unknown:
        _fail(name, "mesh", f"unknown key(s) {', '.join(map(repr, unknown))}; known: data, tensor")
    try:
        return MeshShape(**dict(fields))
    except MeshError as e:
        _fail(name, "mesh", str(e))
