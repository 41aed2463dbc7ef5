"""Continuous batching: requests arrive and leave between steps, over S slots of one preallocated state.

Design choices:
- The host owns the schedule, the device the numbers. `Engine.step()` admits waiting requests into
  free slots (FIFO; one `reset_slots` call for all of them), feeds every prefilling slot its next
  `prefill_chunk` prompt tokens (one forward for all of them, so a long prompt never stalls the
  decoding rows for more than a chunk per step), then runs one decode step for the decoding slots
  (AR: one token; chain: draft, verify, accept). Each executable is compiled ahead of time for the
  engine's fixed shapes (`warm_up` compiles every one): which slots take part, their budgets, stop
  tokens and sampling settings are arrays, so nothing compiles in steady state.
- One deliberate host sync per step: the step's first tokens and emitted tokens come back together,
  which streaming needs anyway; budgets and stop tokens are applied there (a chain step may accept
  past either: the extra tokens are dropped and the row leaves), and a finished row's slot is free for
  the next admissions. `batching.dispatch="pipelined"` (the default) enqueues step n+1 before reading
  step n's tokens: the device always holds a row's newest token, so the host needs nothing from step
  n to launch n+1, and its work (launching the step's kernels, reading tokens, bookkeeping: measured
  on the H200 at 2-4 ms a step, `device_step_ms`) overlaps the device's. A row whose prompt ends in a
  step decodes from the next; a row that finished in step n runs in n+1 too, its tokens dropped (the
  results are routed to the handles a step was dispatched for, so a finished or cancelled request never
  receives them); a freed slot is admitted into one step later. `sync` reads every step's tokens before
  the next is enqueued.
- A request is checked when submitted (`request.check_request`): a bad one raises `RequestError`
  naming its field and never takes a slot, so the others go on.
- `stream(handle)` yields a request's tokens as they commit, driving `step()` itself (the engine is
  single-threaded); `cancel(handle)` frees its slot at once, between steps.
- Replaying drafters (`ReplayDrafter`, `OracleDrafter`: oracle acceptance) read a per-row reference
  from their params; the engine keeps that table `[S, max_len]` and writes a newcomer's row from its
  `Request.draft_reference` at admission.
- Attention reads each row's own committed length: every forward's mask is built from the rows'
  `lengths` (`state.causal_mask`, `state.prompt_mask`), so a row never sees another request's K/V or
  its own stale slots. That is masking by length over the preallocated cache, the reference of
  `pallas_kernels/ragged_attention.py`, whose kernel reads only a row's own blocks.
- Batching (`plan.Batching`, read by `from_plan`): `policy="static"` admits a new wave only into an
  empty batch; `draft_budget="confidence"` lets each row verify a draft count chosen per step from the
  drafter's confidence under `token_budget` and the step cost (`budget.StepCost`, from the cost
  model); `verify="packed"` sends only the kept candidates through the target (`packed`);
  `overlap="halves"` verifies one half of the slots per step while drafting the other (`overlap`).
  Stats count the tokens rows sent to verification, the tokens the verify forward computed, the rows
  each decode verified and drafted, and (halves) the decodes that had both halves busy.
- A row whose prompt ends in a step decodes from the next (its first token is already on the device);
  the host applies its budget and stop token to that first token when it reads the step.
- Tree plans (`tree=` a `plan.TreeShape`; `from_plan` passes a tree plan's) decode with
  `tree_slots.decode_tree`: each step drafts a token tree per row, verifies its nodes in one forward,
  and emits up to depth + 1 tokens per row. The batching mechanisms above are chain-only: a tree engine
  refuses them (NotImplementedError naming the field); two_level plans are refused.
- Sharded targets (a plan's mesh) need nothing of their own here: the slot state is a batch like any
  other, so its rows spread over the mesh's data axis and heads over its tensor axis by the target's state
  specs (`specpilot.sharding`), and the AOT cache compiles each step for those shardings. The slots must
  divide over the data axis.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import sharding
from specpilot.decoding.sampling import RequestSampling
from specpilot.decoding.tree import check_depth
from specpilot.models.drafter import ReplayDrafter
from specpilot.models.oracle import OracleDrafter
from specpilot.plan import Batching, TreeShape
from specpilot.serving import overlap as ov
from specpilot.serving import slots as sl
from specpilot.serving import tree_slots
from specpilot.serving.budget import StepCost
from specpilot.serving.packed import check_packable
from specpilot.serving.request import Request, RequestError, check_request

WAITING, PREFILL, DECODING, DONE = "waiting", "prefill", "decoding", "done"


@dataclasses.dataclass(eq=False)
class Handle:
    """One submitted request: its tokens so far, status and timestamps (time.perf_counter seconds)."""

    id: int
    request: Request
    submitted_s: float
    status: str = WAITING
    slot: int | None = None
    tokens: list = dataclasses.field(default_factory=list)
    token_s: list = dataclasses.field(default_factory=list)  # when each token reached the host
    finish_reason: str | None = None  # "length", "stop" or "cancelled"
    prefilled: int = 0  # prompt tokens fed so far
    admitted_s: float | None = None
    finished_s: float | None = None
    unread: collections.deque = dataclasses.field(default_factory=collections.deque, repr=False)

    @property
    def done(self) -> bool:
        return self.status == DONE

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.submitted_s if self.token_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_s) < 2:
            return None
        return (self.token_s[-1] - self.token_s[0]) / (len(self.token_s) - 1)


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A dispatched step: the handles it serves and its device outputs (None where it ran no such call)."""

    final: list  # handles whose prompt ended in this step's prefill (their first token is `first`)
    decoding: list  # handles this step's decode verified
    first: Any
    emitted: Any
    n_new: Any
    verified: Any

    @property
    def live(self) -> bool:
        """Some request it serves is still open (else its tokens would all be dropped)."""
        return any(not h.done for h in self.final + self.decoding)


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    decode_row_steps: int = 0  # (active row, decode step) pairs
    decode_tokens: int = 0  # tokens those row-steps emitted (kept or not)
    verify_tokens: int = 0  # tokens those row-steps sent to verification (last token + kept drafts; tree: nodes)
    forward_tokens: int = 0  # tokens the decode calls' verify forwards computed (padded: slots x block; tree:
    # slots x nodes)
    rows_drafted: int = 0  # (row, decode call) pairs drafted (overlap none: the verified rows themselves)
    both_halves_busy: int = 0  # overlap halves: decode calls that verified one half and drafted the other

    @property
    def tokens_per_row_step(self) -> float:
        """Mean tokens a decoding row gains per step (AR: 1; chain: the acceptance length tau)."""
        return self.decode_tokens / self.decode_row_steps if self.decode_row_steps else float("nan")

    @property
    def tokens_per_decode(self) -> float:
        """Mean tokens one decode call emits over the batch."""
        return self.decode_tokens / self.decode_calls if self.decode_calls else float("nan")

    @property
    def rows_verified_per_decode(self) -> float:
        return self.decode_row_steps / self.decode_calls if self.decode_calls else float("nan")

    @property
    def rows_drafted_per_decode(self) -> float:
        return self.rows_drafted / self.decode_calls if self.decode_calls else float("nan")

    @property
    def both_halves_busy_fraction(self) -> float:
        """The share of decode calls in which both halves had work (halves; 0 under overlap none)."""
        return self.both_halves_busy / self.decode_calls if self.decode_calls else float("nan")

    @property
    def verify_tokens_per_decode(self) -> float:
        """Mean tokens one decode call sends to verification over the batch."""
        return self.verify_tokens / self.decode_calls if self.decode_calls else float("nan")


def check_plan(plan) -> None:
    """Plans the engine cannot run yet are refused, naming the plan and field."""
    if plan.verify == "two_level":
        raise NotImplementedError(f"decoding.plans.{plan.name}.verify: two_level plans do not run through the "
                                  f"engine yet; use an ar, chain or tree plan")


TREE_BATCHING = (("draft_budget", "fixed"), ("verify", "padded"), ("overlap", "none"))  # what a tree step runs


def check_tree_batching(b: Batching, where: str = "the engine's") -> None:
    """A tree engine verifies every row's whole tree each step: the chain-only mechanisms are refused
    (a tree plan's own batching cannot hold them, `Plan`; an engine's batching argument may)."""
    for field, plain in TREE_BATCHING:
        if getattr(b, field) != plain:
            raise NotImplementedError(f"{where}.batching.{field}: {getattr(b, field)!r} is not implemented for "
                                      f"tree plans (every row verifies its whole tree); use {field}: {plain}")


def _token_budget(b: Batching, slots: int, bs: int, target) -> int:
    """The verification tokens one decode may check over the batch; a batching the engine cannot run
    raises ValueError (NotImplementedError for packed hybrid or sharded targets) naming the field."""
    if not isinstance(b, Batching):
        raise ValueError(f"batching must be a plan.Batching, got {type(b).__name__}")
    if bs == 1:
        for field, plain in (("draft_budget", "fixed"), ("verify", "padded")):
            if getattr(b, field) != plain:
                raise ValueError(f"batching.{field}: {getattr(b, field)!r} needs a drafter (block_size >= 2)")
        return slots
    full = slots * bs
    budget = full if b.token_budget is None else int(b.token_budget)
    if b.draft_budget == "fixed" and budget < full:
        raise ValueError(f"batching.token_budget: {budget} is less than the {slots} slots x block {bs} = {full} "
                         f"tokens fixed draft counts verify; give >= {full} or draft_budget: confidence")
    if budget < 2 * slots:
        raise ValueError(f"batching.token_budget: {budget} leaves some of the {slots} slots without a draft "
                         f"(each verifies its last token and >= 1 draft: >= {2 * slots})")
    if b.verify == "packed":
        check_packable(target)
    return min(budget, full)


def _tree_block_size(tree: TreeShape, drafter, block_size: int | None) -> int:
    """A tree engine's drafter block, depth + 1; `block_size` may be left out or be the plan's (the tree's
    width max(nodes, depth + 1))."""
    if drafter is None:
        raise ValueError("a tree engine needs a drafter")
    if block_size not in (None, tree.width):
        raise ValueError(f"block_size {block_size}: a tree engine's is its width max(nodes, depth + 1) = "
                         f"{tree.width} (or leave it out)")
    check_depth(drafter, tree.depth)
    return tree.depth + 1


def _replays(drafter) -> bool:
    return isinstance(drafter, (ReplayDrafter, OracleDrafter))


def _with_reference(drafter, params, reference):
    if isinstance(drafter, ReplayDrafter):
        return reference
    return dict(params, reference=reference)


class Engine:
    """Continuous batching over `slots` rows of one target state (and drafter context)."""

    def __init__(self, target, target_params, drafter=None, draft_params=None, *, block_size: int | None = None,
                 slots: int = 4, context_len: int = 256, prefill_chunk: int = 32, top_k: int = 0,
                 sampling: bool = True, batching: Batching | None = None, step_cost: StepCost | None = None,
                 tree: TreeShape | None = None):
        bs = 1 if drafter is None else (block_size or drafter.block_size)
        if tree is not None:
            bs = _tree_block_size(tree, drafter, block_size)
        for name, value, low in (("slots", slots, 1), ("context_len", context_len, 2),
                                 ("prefill_chunk", prefill_chunk, 1), ("block_size", bs, 1)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if bs > 1 and drafter is None:
            raise ValueError("block_size > 1 needs a drafter")
        if context_len > target.max_positions:
            raise ValueError(f"context_len {context_len} is past the model's max_position_embeddings "
                             f"({target.max_positions})")
        limit = getattr(target, "max_block_size", None)  # recurrent targets keep <= limit token states
        if limit is not None and bs > limit:
            raise ValueError(f"block size {bs} exceeds the target's max_block_size {limit}")
        if limit is not None and tree is not None and tree.width > limit:
            raise ValueError(f"a tree of {tree.nodes} nodes exceeds the target's max_block_size {limit} (the "
                             f"per-node recurrent states one verification keeps)")
        if _replays(drafter) and sampling:
            sampling = isinstance(drafter, ReplayDrafter)  # the oracle drafter's one-hot drafts: greedy only
        mesh = getattr(target, "mesh", None)
        if mesh is not None and slots % int(mesh.shape["data"]):  # slots spread over the data axis
            raise sharding.MeshError(f"mesh.data={int(mesh.shape['data'])} does not divide the engine's "
                                     f"slots ({slots})")
        target.check_params(target_params)
        self.batching = batching or Batching()
        if tree is not None:
            check_tree_batching(self.batching)
        rows = ov.check_overlap(self.batching.overlap, int(slots), int(bs), target)  # verified per decode
        budget = _token_budget(self.batching, rows, int(bs) if tree is None else tree.nodes, target)
        args = (target, drafter if bs > 1 else None, int(bs), int(context_len),
                int(prefill_chunk), int(top_k), self.batching.draft_budget, self.batching.verify, budget,
                step_cost or StepCost(), self.batching.overlap)
        self.setup = sl.EngineSetup(*args) if tree is None else tree_slots.TreeEngineSetup(
            *args, nodes=tree.nodes, depth=tree.depth, branching=tree.branching)
        self.rows_per_verify = rows
        self.slots, self.sampling = int(slots), bool(sampling)
        self.target_params = target_params
        self._base_draft_params = draft_params
        self.draft_params = draft_params
        self.reference = None
        if self.setup.uses_drafter and _replays(drafter):
            self.reference = jnp.zeros((self.slots, self.setup.max_len), jnp.int32)
            self.draft_params = _with_reference(drafter, draft_params, self.reference)
        self.state = sl.init_slots(self.setup, self.draft_params, self.slots)
        halves = self.batching.overlap == "halves"
        self.overlap = ov.Overlap(self.slots) if halves else None
        self.prepared = ov.init_prepared(self.setup, self.slots) if halves else None
        self.table: list[Handle | None] = [None] * self.slots
        self.waiting: collections.deque[Handle] = collections.deque()
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._exes: dict = {}
        self._pending: _Pending | None = None  # pipelined dispatch: the step whose tokens are unread

    @classmethod
    def from_plan(cls, deployment, plan, **kwargs) -> "Engine":
        """The engine of one of a deployment's plans (its target, weights, drafter and batching; a
        `batching` argument replaces the plan's)."""
        check_plan(plan)
        if plan.verify == "tree":
            check_tree_batching(kwargs.get("batching") or plan.batching, f"decoding.plans.{plan.name}")
        drafter, dparams = deployment.drafter_for(plan) if plan.uses_drafter else (None, None)
        if isinstance(drafter, OracleDrafter):  # a deployment keeps the inner drafter's params; the
            # oracle's own (a reference the engine fills per slot, a key) wrap them
            dparams = OracleDrafter.make_params(dparams, np.zeros((int(kwargs.get("slots", 4)), 1), np.int32))
        kwargs.setdefault("batching", plan.batching)
        if plan.verify == "tree":
            kwargs["tree"] = plan.tree
        return cls(deployment.target_for(plan), deployment.params_for(plan), drafter, dparams,
                   block_size=plan.block_size if plan.uses_drafter else None, **kwargs)

    # ----------------------------------------------------------------------------------------------
    # Executables

    def _sampling_shape(self, greedy: bool) -> RequestSampling:
        row = jax.ShapeDtypeStruct((self.slots,), jnp.float32)
        return RequestSampling(row, row, greedy=greedy, top_k=self.setup.top_k)

    def _exe(self, which: str, greedy: bool = True):
        """The executable `which` for this engine's shapes, looked up once per engine."""
        if (which, greedy) not in self._exes:
            self._exes[which, greedy] = self._build(which, greedy)
        return self._exes[which, greedy]

    def _build(self, which: str, greedy: bool):
        s = self.slots
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        flag = jax.ShapeDtypeStruct((s,), jnp.bool_)
        state = jax.eval_shape(lambda: self.state)
        tp, dp, setup = self.target_params, self.draft_params, self.setup
        if which == "reset":
            return sl.compiled(sl.reset_jit, setup, state, flag, i32(s))
        if which == "reference":
            return sl.compiled(sl.set_rows_jit, None, self.reference, flag, self.reference)
        if which == "prefill":
            return sl.compiled(sl.prefill_jit, setup, tp, dp, state, i32(s, setup.prefill_chunk), i32(s), flag,
                               self._sampling_shape(greedy))
        if which.startswith("halves"):  # halves0, halves1: the parity of the verified half
            return sl.compiled(ov.decode_halves_jit, (setup, int(which[-1])), tp, dp, state,
                               jax.eval_shape(lambda: self.prepared), flag, flag, self._sampling_shape(greedy))
        if isinstance(setup, tree_slots.TreeEngineSetup):
            decode = tree_slots.decode_tree_jit
        else:
            decode = sl.decode_chain_jit if setup.uses_drafter else sl.decode_ar_jit
        return sl.compiled(decode, setup, tp, dp, state, flag, self._sampling_shape(greedy))

    def warm_up(self) -> None:
        """Compile every executable a step may call (both sampling variants where the engine samples)."""
        self._exe("reset")
        if self.reference is not None:
            self._exe("reference")
        for greedy in (True, False) if self.sampling else (True,):
            self._exe("prefill", greedy)
            for which in ("halves0", "halves1") if self.overlap is not None else ("decode",):
                self._exe(which, greedy)

    # ----------------------------------------------------------------------------------------------
    # Requests

    def submit(self, request: Request) -> Handle:
        """Queue a request; a bad one raises RequestError naming its field (nothing else is touched)."""
        reason = ("the oracle drafter drafts one-hot tokens (greedy only)"
                  if isinstance(self.setup.drafter, OracleDrafter) else "the engine was built without sampling")
        request = check_request(request, vocab_size=self.setup.target.vocab_size,
                                context_len=self.setup.context_len, sampling=self.sampling,
                                greedy_only_reason=reason)
        if self.reference is not None and request.draft_reference is None:
            raise RequestError("draft_reference", "this engine's drafter replays a reference; give the prompt "
                               "and its continuation")
        if self.reference is None and request.draft_reference is not None:
            raise RequestError("draft_reference", "this engine's drafter does not replay a reference")
        handle = Handle(next(self._ids), request, time.perf_counter())
        self.waiting.append(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """End a request now (between steps): its slot is free for the next admission."""
        if handle.done:
            return
        if handle.status == WAITING:
            self.waiting.remove(handle)
        self._finish(handle, "cancelled")

    def _finish(self, handle: Handle, reason: str) -> None:
        if handle.slot is not None:
            self.table[handle.slot] = None
        handle.status, handle.finish_reason, handle.finished_s = DONE, reason, time.perf_counter()

    @property
    def busy(self) -> bool:
        """Requests wait, hold a slot, or a dispatched step's tokens are still to be read."""
        return (bool(self.waiting) or any(h is not None for h in self.table)
                or (self._pending is not None and self._pending.live))

    @property
    def slots_in_use(self) -> int:
        return sum(h is not None for h in self.table)

    def committed_tokens(self) -> int:
        """Positions held by the requests in the slots (prompt fed + tokens emitted): KV in use."""
        return sum(h.prefilled + max(len(h.tokens) - 1, 0) for h in self.table if h is not None)

    def stream(self, handle: Handle) -> Iterator[int]:
        """The request's tokens as they commit (steps the engine while it waits for them)."""
        while True:
            while handle.unread:
                yield handle.unread.popleft()
            if handle.done:
                return
            self.step()

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.busy:
            self.step()

    # ----------------------------------------------------------------------------------------------
    # One engine step

    def _admit(self) -> None:
        free = [i for i, h in enumerate(self.table) if h is None]
        if self.batching.policy == "static" and len(free) < self.slots:
            return  # lockstep waves: the next one waits for the whole batch to finish
        mask = np.zeros(self.slots, bool)
        seeds = np.zeros(self.slots, np.int32)
        rows = None if self.reference is None else np.zeros((self.slots, self.setup.max_len), np.int32)
        for slot in free:
            if not self.waiting:
                break
            handle = self.waiting.popleft()
            handle.slot, handle.status, handle.admitted_s = slot, PREFILL, time.perf_counter()
            self.table[slot] = handle
            mask[slot], seeds[slot] = True, handle.request.seed
            if rows is not None:
                ref = handle.request.draft_reference[: self.setup.max_len]
                rows[slot, : len(ref)] = ref
        if mask.any():
            self.state = self._exe("reset")(self.state, mask, seeds)
            if self.overlap is not None:
                self.overlap.reset(mask)
            if rows is not None:
                self.reference = self._exe("reference")(self.reference, mask, rows)
                self.draft_params = _with_reference(self.setup.drafter, self._base_draft_params, self.reference)

    def _sampling(self, rows: list[Handle]) -> RequestSampling:
        temp = np.zeros(self.slots, np.float32)
        top_p = np.ones(self.slots, np.float32)
        for h in self.table:
            if h is not None:
                temp[h.slot], top_p[h.slot] = h.request.temperature, h.request.top_p
        greedy = all(h.request.temperature == 0 for h in rows)
        return RequestSampling(temp, top_p, greedy=greedy, top_k=self.setup.top_k)

    def step(self) -> list[Handle]:
        """Admit, prefill one chunk, decode one step; -> the handles that received tokens. Under
        `dispatch="pipelined"` the tokens are those of the step dispatched by the call before (this
        call's step runs on the device meanwhile); a call with nothing to dispatch collects the last."""
        self._admit()
        dispatched = self._dispatch()
        if self.batching.dispatch == "sync":
            return self._collect(dispatched)
        previous, self._pending = self._pending, dispatched
        return self._collect(previous)

    def _dispatch(self) -> "_Pending | None":
        """Enqueue one step's prefill and decode on the device; nothing waits for them here."""
        c = self.setup.prefill_chunk
        prefilling = [h for h in self.table if h is not None and h.status == PREFILL]
        decoding = [h for h in self.table if h is not None and h.status == DECODING]
        first = emitted = n_new = verified = None
        final = []
        if prefilling:
            tokens = np.zeros((self.slots, c), np.int32)
            counts = np.zeros(self.slots, np.int32)
            is_final = np.zeros(self.slots, bool)
            for h in prefilling:
                prompt = h.request.prompt_ids
                n = min(c, len(prompt) - h.prefilled)
                tokens[h.slot, :n] = prompt[h.prefilled: h.prefilled + n]
                counts[h.slot] = n
                h.prefilled += n
                if h.prefilled == len(prompt):
                    is_final[h.slot] = True
                    final.append(h)
            sampling = self._sampling(final)
            self.state, first = self._exe("prefill", sampling.greedy)(
                self.target_params, self.draft_params, self.state, tokens, counts, is_final, sampling)
            self.stats.prefill_calls += 1
        if self.overlap is not None:
            if decoding or final:
                emitted, n_new, verified, decoding = self._decode_halves(decoding, final)
        elif decoding:
            active = np.zeros(self.slots, bool)
            active[[h.slot for h in decoding]] = True
            sampling = self._sampling(decoding)
            self.state, emitted, n_new, verified = self._exe("decode", sampling.greedy)(
                self.target_params, self.draft_params, self.state, active, sampling)
            self.stats.decode_calls += 1
            self.stats.rows_drafted += len(decoding) if self.setup.uses_drafter else 0
            self.stats.forward_tokens += self._forward_tokens()
        self.stats.steps += 1
        for h in final:  # the device holds its first token: the next step decodes it
            h.status = DECODING
        if first is None and emitted is None:
            return None
        return _Pending(final, decoding, first, emitted, n_new, verified)

    def _collect(self, pending: "_Pending | None") -> list[Handle]:
        """Read a dispatched step's tokens (the step's one host sync) and hand them to their requests;
        a request that ended meanwhile (finished by an earlier step, cancelled) drops them."""
        if pending is None or not pending.live:
            return []
        first, emitted, n_new, verified = jax.device_get((pending.first, pending.emitted, pending.n_new,
                                                          pending.verified))
        now = time.perf_counter()
        got = []
        for h in pending.final:
            if not h.done:
                self._emit(h, [int(first[h.slot])], now)
                got.append(h)
        for h in pending.decoding:
            if h.done:
                continue
            n = int(n_new[h.slot])
            self.stats.decode_row_steps += 1
            self.stats.decode_tokens += n
            self.stats.verify_tokens += int(verified[h.slot])
            self._emit(h, [int(t) for t in emitted[h.slot, :n]], now)
            got.append(h)
        return got

    def _forward_tokens(self) -> int:
        """Tokens one decode's verify forward computes."""
        if isinstance(self.setup, tree_slots.TreeEngineSetup):
            return self.rows_per_verify * self.setup.nodes
        if self.setup.verify == "packed":
            return self.setup.token_budget
        return self.rows_per_verify * self.setup.block_size

    def _decode_halves(self, decoding: list[Handle], final: list[Handle]):
        """One `overlap.decode_halves` call: verify this call's half, draft the other (the rows whose
        prompt ended this step included) -> (emitted, n_new, verified, the handles verified)."""
        parity, verify, draft = self.overlap.plan_call([h.slot for h in decoding],
                                                       [h.slot for h in decoding + final])
        sampling = self._sampling(decoding + final)
        self.state, self.prepared, emitted, n_new, verified = self._exe(f"halves{parity}", sampling.greedy)(
            self.target_params, self.draft_params, self.state, self.prepared, verify, draft, sampling)
        self.overlap.called(verify, draft)
        self.stats.decode_calls += 1
        self.stats.rows_drafted += int(draft.sum())
        self.stats.both_halves_busy += int(verify.any() and draft.any())
        self.stats.forward_tokens += self._forward_tokens()
        return emitted, n_new, verified, [h for h in decoding if verify[h.slot]]

    def _emit(self, h: Handle, new: list[int], now: float) -> None:
        req = h.request
        for t in new:
            h.tokens.append(t)
            h.token_s.append(now)
            h.unread.append(t)
            if t == req.stop_token:
                self._finish(h, "stop")
                return
            if len(h.tokens) == req.max_new_tokens:
                self._finish(h, "length")
                return

    # ----------------------------------------------------------------------------------------------
    # Measurement

    def device_step_ms(self, calls: int = 20) -> float:
        """Milliseconds one decode call takes when `calls` of them run back to back with no host work
        between them (greedy, every row computed, none committed): the device's share of a step, against
        which `step()`'s wall time shows the host's. Call it between workloads (it leaves every row's
        committed length as it was; halves engines time their first half's call)."""
        if calls < 1:
            raise ValueError(f"calls must be >= 1, got {calls}")
        which = "halves0" if self.overlap is not None else "decode"
        exe, idle = self._exe(which, True), np.zeros(self.slots, bool)
        sampling = RequestSampling(np.zeros(self.slots, np.float32), np.ones(self.slots, np.float32), greedy=True,
                                   top_k=self.setup.top_k)

        def call():
            if self.overlap is not None:
                self.state, self.prepared, *_ = exe(self.target_params, self.draft_params, self.state,
                                                    self.prepared, idle, idle, sampling)
            else:
                self.state, *_ = exe(self.target_params, self.draft_params, self.state, idle, sampling)

        call()  # the first call after host work may include transfers
        jax.block_until_ready(self.state)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        jax.block_until_ready(self.state)
        return 1e3 * (time.perf_counter() - t0) / calls
