"""The pieces every decoding step is counted from: the `Kernel` and `StepCounts` records, the `Shape` a
step's cost depends on, and `StepCounter` with the bytes and FLOPs of a target forward, the block
drafter and acceptance. `counts` (AR, chain) and `tree_counts` (tree, two-level) assemble whole steps
from them; docs/design/costmodel.md explains what is counted and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels.dispatch import rows_before_xla
from specpilot.models import draft_vocab
from specpilot.models.oracle import OracleDrafter

STAGES = ("draft", "verify", "accept")
CLASSES = ("matmul", "lm_head", "attention", "recurrence", "embedding", "elementwise", "cache_write",
           "bookkeeping")
F32 = 4  # logits, the recurrent state and scores are float32
W12_NAMES = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")  # formats.w12.LINEAR_NAMES


@dataclasses.dataclass(frozen=True)
class Kernel:
    stage: str
    cls: str
    name: str  # "target.qkv", "drafter.attention", ...
    count: int = 1  # launches per step (layers running it)
    flops: float = 0.0  # our implementation's, all launches
    bytes: float = 0.0
    floor_flops: float = 0.0  # what the step must compute / move
    floor_bytes: float = 0.0
    weight_bytes: float = 0.0  # the part of `bytes` that is weights
    dot: bool = False  # flops are products on the matmul unit
    m: int = 0  # matmul shape of one launch: [M, K] @ [K, N]
    k: int = 0
    n: int = 0
    impl: str = ""  # matmul: "<implementation>/<weight storage>", e.g. "xla/bf16", "mosaic/w12"

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"kernel {self.name!r}: stage {self.stage!r} is not one of {STAGES}")
        if self.cls not in CLASSES:
            raise ValueError(f"kernel {self.name!r}: class {self.cls!r} is not one of {CLASSES}")


@dataclasses.dataclass(frozen=True)
class StepCounts:
    kernels: tuple[Kernel, ...]

    def select(self, stage: str | None = None, cls: str | tuple[str, ...] | None = None) -> "StepCounts":
        classes = (cls,) if isinstance(cls, str) else cls
        return StepCounts(tuple(k for k in self.kernels if (stage is None or k.stage == stage)
                                and (classes is None or k.cls in classes)))

    def total(self, field: str) -> float:
        return float(sum(getattr(k, field) for k in self.kernels))

    @property
    def dot_flops(self) -> float:
        return float(sum(k.flops for k in self.kernels if k.dot))

    def by(self, key: str, field: str) -> dict[str, float]:
        """{stage or class: sum of field}."""
        out: dict[str, float] = {}
        for k in self.kernels:
            out[getattr(k, key)] = out.get(getattr(k, key), 0.0) + getattr(k, field)
        return out


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a step's cost depends on besides the plan."""

    target: Any  # ModelConfig or HybridConfig
    drafter: Any = None  # DrafterConfig of the block drafter (an oracle's inner one), or None
    batch: int = 1
    context: int = 0  # committed tokens per sequence (the mean over the decode)
    cache_len: int = 0  # slots each attention state holds (0: context + 16)
    dtype_bytes: int = 2  # activations, K/V and plain weights
    oracle: bool = False  # the drafter is wrapped by an oracle (extra one-hot logits)
    greedy: bool = True
    fused: bool = True  # a dense target's q/k/v and gate/up are single matrices (target.layout=fused)
    max_block: int = 16  # hybrid targets: per-token snapshots each recurrent layer keeps
    draft_vocab: int = 0  # ids a reduced draft vocabulary scores (0: the target's whole head)
    draft_width: int = 0  # rows the drafter drafts a block over (BlockDrafter.draft_width; 0: the plan's block)

    def __post_init__(self):
        for name in ("batch", "dtype_bytes", "max_block"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Shape.{name} must be positive, got {getattr(self, name)!r}")
        if self.context < 0 or self.cache_len < 0:
            raise ValueError(f"Shape.context and cache_len must be >= 0, got {self.context}, {self.cache_len}")

    @property
    def slots(self) -> int:
        return self.cache_len or self.context + 16

    @property
    def hybrid(self) -> bool:
        return hasattr(self.target, "layer_types")

    @classmethod
    def from_deployment(cls, dep, context: int | None = None) -> "Shape":
        """The shape of a harness `deploy.Deployment`; context defaults to the mean committed length
        over the decode (mean prompt + half the new tokens)."""
        dcfg, oracle, width = None, False, 0
        if dep.drafter is not None:
            d = dep.drafter[0]
            oracle, inner = isinstance(d, OracleDrafter), getattr(d, "inner", d)
            dcfg, width = getattr(inner, "cfg", None), getattr(inner, "draft_width", None) or 0
        if context is None:
            context = int(sum(len(p) for p in dep.prompts) / len(dep.prompts) + dep.new_tokens / 2)
        layer0 = dep.params["layers"][0]
        dparams = dep.drafter[1] if dep.drafter is not None else None
        return cls(target=dep.cfg, drafter=dcfg, batch=dep.batch_size, context=context,
                   cache_len=dep.cache_len, dtype_bytes=dep.params["embed"].dtype.itemsize, oracle=oracle,
                   greedy=dep.sampling.greedy, fused="qkv" in layer0 or "gate_up" in layer0,
                   draft_vocab=int(dparams["draft_ids"].shape[0]) if draft_vocab.has_draft_vocab(dparams) else 0,
                   draft_width=int(width))


# --------------------------------------------------------------------------------------------------
# Counting


class StepCounter:
    """Accumulates the kernels of one step."""

    def __init__(self, plan, shape: Shape):
        self.plan, self.s = plan, shape
        self.e = shape.dtype_bytes
        self.kernels: list[Kernel] = []
        impls = tuple(plan.kernels.matmul.implementation)
        self.impls = impls
        self.tree = False  # counting a tree forward (`tree_counts`): per-node recurrence, tree attention

    # storage and implementation of one weight matrix
    def _storage(self, name: str) -> tuple[float, str]:
        plain = {2: "bf16", 4: "f32"}.get(self.e, f"{8 * self.e}bit")
        if self.plan.weights == "w12" and name in W12_NAMES + ("lm_head", "fc"):
            names, head, fc = self.plan.w12_params()
            if name in names or (name == "lm_head" and head) or (name == "fc" and fc):
                return 1.5, "w12"
        return float(self.e), plain

    def _impl(self, storage: str, tied: bool, name: str = "") -> str:
        if tied:
            if name == "lm_head" and storage == "f32" and rows_before_xla(self.plan.kernels.matmul):
                return "cpu_rows/f32"  # the embedding's transpose in panels (dispatch.prepare_params' tied_head)
            return f"xla-tied/{storage}"  # the tied head: an einsum against the embedding [V, H]
        for impl in self.impls:  # the first implementation that takes this weight (dispatch.matmul)
            if impl == "triton" and storage != "w12":
                continue
            if impl == "mosaic" and storage not in ("w12", "bf16"):
                continue
            if impl == "mosaic" and storage == "bf16" and self.plan.weights == "w12":
                continue  # a W12 plan leaves the matrices it kept bf16 to XLA (layout_bf16=False)
            return f"{impl}/{storage}"
        return f"xla/{storage}"

    def add(self, **kw):
        self.kernels.append(Kernel(**kw))

    def matmul(self, stage, who, role, count, m, k, n, cls="matmul", out_bytes=None, tied=False, bias=False,
               param=None):
        """`count` launches of [m, k] @ [k, n]; `param`: the weight's name in the params (default role)."""
        if count == 0 or m == 0:
            return
        wb, storage = (float(self.e), {2: "bf16", 4: "f32"}.get(self.e, "plain")) if tied else \
            self._storage(param or role)
        weights = count * (k * n * wb + (n * self.e if bias else 0))
        out_bytes = self.e if out_bytes is None else out_bytes
        act = count * (m * k * self.e + m * n * out_bytes)
        self.add(stage=stage, cls=cls, name=f"{who}.{role}", count=count, flops=2.0 * count * m * k * n,
                 bytes=weights + act, floor_flops=2.0 * count * m * k * n, floor_bytes=weights,
                 weight_bytes=weights, dot=True, m=m, k=k, n=n, impl=self._impl(storage, tied, param or role))

    def elementwise(self, stage, name, count, nbytes, weight_bytes=0.0, flops=0.0):
        if count and nbytes:
            self.add(stage=stage, cls="elementwise", name=name, count=count, bytes=count * (nbytes + weight_bytes),
                     weight_bytes=count * weight_bytes, floor_bytes=count * weight_bytes, flops=flops)

    # ---- pieces -----------------------------------------------------------------------------------

    def norm(self, stage, name, count, rows, width, weight=None):
        """RMSNorm over rows x width activations: read x, write the normed x, read the weight (`weight`
        elements, default width; q/k norms share one head_dim weight across heads)."""
        self.elementwise(stage, name, count, 2 * rows * width * self.e, (width if weight is None else weight) * self.e)

    def rope(self, stage, name, count, rows, heads, dim):
        """RoPE: read x, cos, sin (float32 tables cast), write x."""
        self.elementwise(stage, name, count, 2 * rows * heads * dim * self.e + 2 * rows * dim * F32)

    def attention(self, stage, who, count, t, heads, kv_heads, dim, committed, slots):
        """T queries per sequence over `slots` cached keys (ours: every slot, masked, its scores and mask
        through memory; the floor: the committed context plus the block). A tree forward whose plan puts the
        tree attention on the Triton kernel reads only the committed prefix and the block
        (`pallas_kernels.tree_attention`); a target's other forwards whose plan puts the attention on a
        Pallas kernel (`pallas_kernels.ragged_attention`, `attention_block`) read each row's keys alone and
        keep the scores on chip."""
        b, e = self.s.batch, self.e
        if count == 0:
            return
        on_chip = False
        if self.tree and tuple(self.plan.kernels.tree_attention.implementation)[:1] == ("triton",):
            slots = min(slots, committed + t)
        elif not self.tree and who == "target" and \
                tuple(self.plan.kernels.attention.implementation)[:1] in (("triton",), ("triton_block",)):
            slots, on_chip = min(slots, committed + t), True
        kv_read = 2 * b * slots * kv_heads * dim * e
        scores = 0 if on_chip else b * heads * t * slots
        qo = 2 * b * t * heads * dim * e
        self.add(stage=stage, cls="attention", name=f"{who}.attention", count=count,
                 flops=count * 4.0 * b * t * heads * dim * slots,
                 bytes=count * (kv_read + qo + scores * (2 * F32 + 2 * e) + (0 if on_chip else b * t * slots)),
                 floor_flops=count * 4.0 * b * t * heads * dim * (committed + t),
                 floor_bytes=count * 2 * b * committed * kv_heads * dim * e, dot=True)

    def cache_write(self, stage, who, count, t, kv_heads, dim):
        n = count * 2 * self.s.batch * t * kv_heads * dim * self.e
        if n:
            self.add(stage=stage, cls="cache_write", name=f"{who}.kv_write", count=count, bytes=n, floor_bytes=n)

    def embedding(self, stage, who, rows, hidden):
        n = rows * hidden * self.e
        self.add(stage=stage, cls="embedding", name=f"{who}.embedding", bytes=2 * n, floor_bytes=n, weight_bytes=n)

    def logits_pass(self, stage, name, passes, rows):
        """Passes over float32 logits [rows, V] (argmax, softmax, one-hot): read (or write) each once."""
        n = passes * rows * self.s.target.vocab_size * F32
        if n:
            self.add(stage=stage, cls="bookkeeping", name=name, bytes=n)


# ---- the target forward -----------------------------------------------------------------------------

def _dense_layers(st: StepCounter, stage: str, cfg, t: int, count: int, fused: bool, who: str = "target",
                  written: int | None = None):
    """`written`: rows whose K/V go to the cache (default t); the other t - written rows' K/V are extra keys
    every row attends to (a drafter drafting wider than the plan's block)."""
    b, e, h, i = st.s.batch, st.e, cfg.hidden_size, cfg.intermediate_size
    written = t if written is None else written
    m = b * t
    st.norm(stage, f"{who}.attn_norm", count, m, h)
    ab, mb = cfg.attention_bias, getattr(cfg, "mlp_bias", False)
    if fused:
        st.matmul(stage, who, "qkv", count, m, h, cfg.q_size + 2 * cfg.kv_size, bias=ab)
    else:
        for role, n in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
            st.matmul(stage, who, role, count, m, h, n, bias=ab)
    if cfg.qk_norm:
        st.norm(stage, f"{who}.qk_norm", count, m, cfg.q_size + cfg.kv_size, 2 * cfg.head_dim)
    st.rope(stage, f"{who}.rope", count, m, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    st.cache_write(stage, who, count, written, cfg.num_kv_heads, cfg.head_dim)
    st.attention(stage, who, count, t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, st.s.context,
                 st.s.slots + t - written)
    st.matmul(stage, who, "o", count, m, cfg.q_size, h, bias=ab)
    st.elementwise(stage, f"{who}.residual", count, 2 * 3 * m * h * e)
    st.norm(stage, f"{who}.mlp_norm", count, m, h)
    if fused:
        st.matmul(stage, who, "gate_up", count, m, h, 2 * i, bias=mb)
    else:
        st.matmul(stage, who, "gate", count, m, h, i, bias=mb)
        st.matmul(stage, who, "up", count, m, h, i, bias=mb)
    st.elementwise(stage, f"{who}.silu_mul", count, 3 * m * i * e)
    st.matmul(stage, who, "down", count, m, i, h, bias=mb)


def _linear_attention_layers(st: StepCounter, stage: str, cfg, t: int, count: int, who: str = "target"):
    """Gated DeltaNet layers (recurrent form: decode and verification). In a tree forward (`st.tree`)
    each node's conv window is gathered along its ancestors and each node's state is read from its
    parent's (`gated_deltanet._tree_conv`, `tree_gated_delta_rule`): one more state read per node."""
    b, e, h = st.s.batch, st.e, cfg.hidden_size
    m, nv, dk, dv, w, c = b * t, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.conv_dim
    st.norm(stage, f"{who}.attn_norm", count, m, h)
    st.matmul(stage, who, "in_proj_qkv", count, m, h, c, param="qkv")
    st.matmul(stage, who, "z", count, m, h, cfg.value_dim)
    st.matmul(stage, who, "b", count, m, h, nv)
    st.matmul(stage, who, "a", count, m, h, nv)
    conv_state = b * (w - 1) * c * e
    windows = m * w * c * e if st.tree else 0  # each node's gathered window [B, T, W, C]
    st.add(stage=stage, cls="recurrence", name=f"{who}.conv", count=count, flops=count * 2.0 * w * m * c,
           bytes=count * (conv_state + 2 * m * c * e + b * (w - 1 + t) * c * e + windows + w * c * e),
           floor_bytes=count * (2 * conv_state + w * c * e), weight_bytes=count * w * c * e)
    # q, k repeated to the value heads, l2-normalised in float32; v cast; beta, g per head
    qk = 2 * m * nv * dk * F32
    st.elementwise(stage, f"{who}.qk_l2norm", count, 3 * qk + m * dv * nv * F32 + 6 * m * nv * F32,
                   2 * nv * e)  # A_log, dt_bias
    state = b * nv * dk * dv * F32
    reads = (2 if st.tree else 1) * t * state  # the per-token states written (and, in a tree, each parent's read)
    st.add(stage=stage, cls="recurrence", name=f"{who}.delta_rule", count=count,
           flops=count * 6.0 * m * nv * dk * dv, bytes=count * (state + reads + qk + 2 * m * nv * dv * F32),
           floor_flops=count * 6.0 * m * nv * dk * dv, floor_bytes=count * 2 * state, dot=True)
    conv_snap = t * conv_state
    st.add(stage=stage, cls="recurrence", name=f"{who}.conv_snapshots", count=count,
           bytes=count * conv_snap)
    st.elementwise(stage, f"{who}.gated_norm", count, 3 * m * cfg.value_dim * e + m * cfg.value_dim * F32,
                   dv * e)
    st.matmul(stage, who, "out", count, m, cfg.value_dim, h)
    _mlp(st, stage, cfg, m, count, who)


def _gated_attention_layers(st: StepCounter, stage: str, cfg, t: int, count: int, who: str = "target"):
    b, e, h = st.s.batch, st.e, cfg.hidden_size
    m = b * t
    st.norm(stage, f"{who}.attn_norm", count, m, h)
    ab = cfg.attention_bias
    st.matmul(stage, who, "q", count, m, h, 2 * cfg.q_size, bias=ab)
    st.matmul(stage, who, "k", count, m, h, cfg.kv_size, bias=ab)
    st.matmul(stage, who, "v", count, m, h, cfg.kv_size, bias=ab)
    st.norm(stage, f"{who}.qk_norm", count, m, cfg.q_size + cfg.kv_size, 2 * cfg.head_dim)
    st.rope(stage, f"{who}.rope", count, m, cfg.num_heads + cfg.num_kv_heads, cfg.rotary_dim)
    st.cache_write(stage, who, count, t, cfg.num_kv_heads, cfg.head_dim)
    st.attention(stage, who, count, t, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, st.s.context,
                 st.s.slots)
    st.elementwise(stage, f"{who}.output_gate", count, 3 * m * cfg.q_size * e)
    st.matmul(stage, who, "o", count, m, cfg.q_size, h, bias=ab)
    _mlp(st, stage, cfg, m, count, who)


def _mlp(st: StepCounter, stage, cfg, m, count, who="target"):
    h, i, e = cfg.hidden_size, cfg.intermediate_size, st.e
    st.elementwise(stage, f"{who}.residual", count, 2 * 3 * m * h * e)
    st.norm(stage, f"{who}.mlp_norm", count, m, h)
    st.matmul(stage, who, "gate", count, m, h, i)
    st.matmul(stage, who, "up", count, m, h, i)
    st.elementwise(stage, f"{who}.silu_mul", count, 3 * m * i * e)
    st.matmul(stage, who, "down", count, m, i, h)


def _lm_head(st: StepCounter, stage, who, rows):
    cfg = st.s.target
    st.norm(stage, f"{who}.final_norm", 1, rows, cfg.hidden_size)
    st.matmul(stage, who, "lm_head", 1, rows, cfg.hidden_size, cfg.vocab_size, cls="lm_head", out_bytes=F32,
              tied=cfg.tie_word_embeddings)


def target_forward(st: StepCounter, stage: str, t: int, layers: int | None = None, who: str = "target"):
    """The target's forward over t positions per sequence; `layers`: only the first that many (an early
    exit, `forward(..., exit_layer=)`), then the final norm and head."""
    cfg, b = st.s.target, st.s.batch
    layers = cfg.num_layers if layers is None else layers
    st.embedding(stage, who, b * t, cfg.hidden_size)
    if st.s.hybrid:
        n_lin = sum(cfg.is_linear(i) for i in range(layers))
        _linear_attention_layers(st, stage, cfg, t, n_lin, who)
        _gated_attention_layers(st, stage, cfg, t, layers - n_lin, who)
    else:
        _dense_layers(st, stage, cfg, t, layers, st.s.fused, who)
    taps = sum(i < layers for i in cfg.tap_layers)
    if taps:
        st.elementwise(stage, f"{who}.taps", 1, 2 * b * t * taps * cfg.hidden_size * st.e)
    _lm_head(st, stage, who, b * t)


# ---- the drafter --------------------------------------------------------------------------------------

def drafter_propose(st: StepCounter, bs: int, choose_passes: int | None = None):
    """The block forward: embed [last, MASK x (Bs-1)], the draft layers over the block (K/V of the block
    written after the committed context, attention over every slot), the target's head on Bs-1 rows,
    then `choose_passes` passes over those logits (default: the chain's argmax or sampling)."""
    d, b = st.s.drafter, st.s.batch
    lc = d.layer_config
    plan_width = getattr(st.plan, "draft_width", None)  # a plan's own width replaces the drafter's
    width = max(bs, st.s.draft_width if plan_width is None else plan_width)  # drafted this wide, bs rows kept
    st.embedding("draft", "drafter", b * width, d.hidden_size)
    _dense_layers(st, "draft", lc, width, d.num_layers, fused=False, who="drafter", written=bs)
    if st.s.draft_vocab:  # its own gathered rows, then the scores put into full-vocabulary logits
        rows, cfg = b * (bs - 1), st.s.target
        st.norm("draft", "drafter.final_norm", 1, rows, cfg.hidden_size)
        st.matmul("draft", "drafter", "draft_head", 1, rows, cfg.hidden_size, st.s.draft_vocab, cls="lm_head",
                  out_bytes=F32, tied=True)  # an einsum against [K, H], like the tied head
        st.logits_pass("draft", "drafter.draft_vocab_fill", 1, rows)
    else:
        _lm_head(st, "draft", "drafter", b * (bs - 1))
    passes = (1 if st.s.greedy else 6) if choose_passes is None else choose_passes  # argmax, or sampling's
    if st.s.oracle:
        passes += 4  # the oracle's one-hot logits, the max that keeps the real forward alive, the sum
        ref = b * (bs - 1) * 4 + 8  # its params: the reference tokens it gathers, its PRNG key
        st.add(stage="draft", cls="bookkeeping", name="drafter.oracle_reference", bytes=ref, weight_bytes=ref)
    st.logits_pass("draft", "drafter.choose_drafts", passes, b * (bs - 1))


def drafter_extend(st: StepCounter, bs: int):
    """The accepted block's context rows: fc over the taps, hidden norm, each draft layer's k/v."""
    d, b, e = st.s.drafter, st.s.batch, st.e
    m, h = b * bs, d.hidden_size
    st.matmul("accept", "drafter", "fc", 1, m, d.num_taps * h, h)
    st.norm("accept", "drafter.hidden_norm", 1, m, h)
    lc = d.layer_config
    kv = lc.kv_size
    st.matmul("accept", "drafter", "k", d.num_layers, m, h, kv, bias=d.attention_bias)
    st.matmul("accept", "drafter", "v", d.num_layers, m, h, kv, bias=d.attention_bias)
    st.norm("accept", "drafter.k_norm", d.num_layers, m, kv, lc.head_dim)
    st.rope("accept", "drafter.rope", d.num_layers, m, lc.num_kv_heads, lc.head_dim)
    st.cache_write("accept", "drafter", d.num_layers, bs, lc.num_kv_heads, lc.head_dim)
    del e


def accept(st: StepCounter, t: int):
    """Verification of the block against the target's logits, output writes, commits."""
    passes = 1 if st.s.greedy else 6 + (1 if t > 1 else 0)  # argmax; or probabilities of p (and q)
    st.logits_pass("accept", "accept.verify_logits", passes, st.s.batch * t)
    commit_snapshots(st)


def commit_snapshots(st: StepCounter):
    """A hybrid target's commit: each recurrent layer's chosen snapshot becomes its state."""
    cfg = st.s.target
    if st.s.hybrid:
        n_lin = sum(cfg.is_linear(i) for i in range(cfg.num_layers))
        b = st.s.batch
        state = b * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * F32
        conv = b * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * st.e
        st.add(stage="accept", cls="recurrence", name="target.select_snapshot", count=n_lin,
               bytes=n_lin * 3 * (state + conv))
