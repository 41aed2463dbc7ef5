"""The serving engine: continuous batching of requests that arrive and leave between steps, over the rows (slots)
of one preallocated target state. The host loop here admits, prefills a chunk and decodes one step per
`step()`, reading each step's tokens once; the compiled step programs are `slots` (AR and chain), `tree_slots`
and `overlap`.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import sharding
from specpilot.decoding.sampling import RequestSampling
from specpilot.models.drafter import ReplayDrafter
from specpilot.models.oracle import OracleDrafter
from specpilot.models.oracle_trace import OracleTraceDrafter
from specpilot.plan import Batching, TreeShape
from specpilot.serving import compact as cp
from specpilot.serving import overlap as ov
from specpilot.serving import pages as pg
from specpilot.serving import slots as sl
from specpilot.serving import tree_slots
from specpilot.serving.budget import StepCost
from specpilot.serving.engine_checks import (check_plan, check_tree_batching, stream_sizes, token_budget,
                                             tree_block_size)
from specpilot.serving.handles import DECODING, DONE, PREFILL, WAITING, EngineStats, Handle, PendingStep
from specpilot.serving.request import Request, RequestError, check_request
from specpilot.serving.step_timing import device_step_ms, measure_step_cost


def _replays(drafter) -> bool:
    return isinstance(drafter, (ReplayDrafter, OracleDrafter, OracleTraceDrafter))


def _with_reference(drafter, params, reference):
    if isinstance(drafter, ReplayDrafter):
        return reference
    return dict(params, reference=reference)


class Engine:
    """Continuous batching over `slots` rows of one target state (and drafter context)."""

    def __init__(self, target, target_params, drafter=None, draft_params=None, *, block_size: int | None = None,
                 slots: int = 4, context_len: int = 256, prefill_chunk: int = 32, top_k: int = 0,
                 sampling: bool = True, batching: Batching | None = None, step_cost: StepCost | None = None,
                 tree: TreeShape | None = None, compact: bool | None = None):
        bs = 1 if drafter is None else (block_size or drafter.block_size)
        if tree is not None:
            bs = tree_block_size(tree, drafter, block_size)
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
        budget = token_budget(self.batching, rows, int(bs) if tree is None else tree.nodes, target)
        args = (target, drafter if bs > 1 else None, int(bs), int(context_len),
                int(prefill_chunk), int(top_k), self.batching.draft_budget, self.batching.verify, budget,
                step_cost or StepCost(), self.batching.overlap, stream_sizes(self.batching, budget))
        self.setup = sl.EngineSetup(*args) if tree is None else tree_slots.TreeEngineSetup(
            *args, nodes=tree.nodes, depth=tree.depth, branching=tree.branching)
        self.rows_per_verify = rows
        # decode only the decoding rows over the cache slots they use (`compact`) where the step allows it;
        # by default on the CPU, where it is measured (its attention reads every slot of every row)
        compact = jax.default_backend() == "cpu" if compact is None else bool(compact)
        self.paged = pg.PagedKV.of(self.batching, self.setup, int(slots), tree) if self.batching.kv == "paged" else None
        self.compact = compact and tree is None and not self.paged and cp.supported(self.setup, target, self.setup.drafter)
        self.slots, self.sampling = int(slots), bool(sampling)
        self.target_params = target_params
        self._base_draft_params = draft_params
        self.draft_params = draft_params
        self.reference = None
        if self.setup.uses_drafter and _replays(drafter):
            self.reference = jnp.zeros((self.slots, self.setup.max_len), jnp.int32)
            self.draft_params = _with_reference(drafter, draft_params, self.reference)
        if step_cost is None and self.batching.pricing == "measured":  # the chooser's prices, timed here
            self.setup = dataclasses.replace(self.setup, cost=measure_step_cost(
                self.setup, target_params, self.draft_params, self.slots, int(context_len) // 2))
        self.state = sl.init_slots(self.setup, self.draft_params, self.slots, self.paged and self.paged.layout)
        self._state_shape = jax.eval_shape(lambda: self.state)  # fixed; read by compiles in any thread
        self._extras_ready: set | None = None  # compact decodes, page windows a step may take (None: any)
        halves = self.batching.overlap == "halves"
        self.overlap = ov.Overlap(self.slots) if halves else None
        self.prepared = ov.init_prepared(self.setup, self.slots) if halves else None
        self.table: list[Handle | None] = [None] * self.slots
        self.waiting: collections.deque[Handle] = collections.deque()
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._exes: dict = {}
        self._pending: PendingStep | None = None  # pipelined dispatch: the step whose tokens are unread
        self.last_window = ""  # paged K/V: the page-table window of the last prefill or decode ("": all)

    @classmethod
    def from_plan(cls, deployment, plan, **kwargs) -> "Engine":
        """The engine of one of a deployment's plans (its target, weights, drafter and batching; a
        `batching` argument replaces the plan's)."""
        check_plan(plan)
        if plan.verify == "tree":
            check_tree_batching(kwargs.get("batching") or plan.batching, f"decoding.plans.{plan.name}")
        drafter, dparams = deployment.drafter_for(plan) if plan.uses_drafter else (None, None)
        if isinstance(drafter, (OracleDrafter, OracleTraceDrafter)):  # a deployment keeps the inner drafter's
            # params; the oracle's own (a reference the engine fills per slot, a key or trace starts) wrap them
            dparams = type(drafter).make_params(dparams, np.zeros((int(kwargs.get("slots", 4)), 1), np.int32))
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
        state = self._state_shape
        if "@" in which:  # paged K/V over the first `window` columns of the page table
            which, window = which.split("@")
            state = dataclasses.replace(state, pages=i32(s, int(window)))
        tp, dp, setup = self.target_params, self.draft_params, self.setup
        if which == "reset":
            return sl.compiled(sl.reset_jit, setup, state, flag, i32(s))
        if which == "reference":
            return sl.compiled(sl.set_rows_jit, None, self.reference, flag, self.reference)
        if which == "prefill":
            return sl.compiled(sl.prefill_jit, setup, tp, dp, state, i32(s, setup.prefill_chunk), i32(s), flag,
                               self._sampling_shape(greedy))
        if which.startswith("compact"):  # compact{rows}x{window}: the decode, then its put-back
            rows, window = (int(x) for x in which.removeprefix("compact").split("x"))
            args = (tp, dp, state, i32(rows), jax.ShapeDtypeStruct((rows,), jnp.bool_), self._sampling_shape(greedy))
            shape = cp.CompactShape(setup, rows, window)
            written = sl.CACHE.out_shapes(cp.decode_compact, shape, args)[0]
            return (sl.compiled(cp.decode_compact_jit, shape, *args),
                    sl.compiled(cp.put_back_jit, None, state, written, i32(rows)))
        if which.startswith("halves"):  # halves0, halves1: the parity of the verified half
            return sl.compiled(ov.decode_halves_jit, (setup, int(which[-1])), tp, dp, state,
                               jax.eval_shape(lambda: self.prepared), flag, flag, self._sampling_shape(greedy))
        if isinstance(setup, tree_slots.TreeEngineSetup):
            decode = tree_slots.decode_tree_jit
        else:
            decode = sl.decode_chain_jit if setup.uses_drafter else sl.decode_ar_jit
        return sl.compiled(decode, setup, tp, dp, state, flag, self._sampling_shape(greedy))

    def warm_up(self, compact_in_background: bool = False) -> None:
        """Compile every executable a step may call (both sampling variants where the engine samples).
        `compact_in_background`: the compact decodes (many on a long context) and the paged engine's
        page-table windows compile in a daemon thread, fewest rows and smallest windows first; until one
        is ready, a step that would take it runs the plain decode (the whole table), so no step waits."""
        self._exe("reset")
        if self.reference is not None:
            self._exe("reference")
        modes = (True, False) if self.sampling else (True,)
        for greedy in modes:
            self._exe("prefill", greedy)
            for which in ("halves0", "halves1") if self.overlap is not None else ("decode",):
                self._exe(which, greedy)
        extras = [(f"compact{rows}x{window}", greedy) for rows, window in
                  cp.shapes(self.slots, self.setup.max_len) for greedy in modes] if self.compact else []
        if self.paged is not None:
            extras += [(f"{which}@{w}", greedy) for w in self.paged.stage_windows()
                       for which in ("prefill", "decode") for greedy in modes]
        if not compact_in_background:
            for key in extras:
                self._exe(*key)
            return
        self._extras_ready = set()
        threading.Thread(target=self._compile_extras, args=(extras,), name="engine-compile", daemon=True).start()

    def _compile_extras(self, keys: list) -> None:
        """The background compiles of `warm_up`: each executable is published once built."""
        for key in keys:
            if key not in self._exes:
                self._exes[key] = self._build(*key)
            self._extras_ready.add(key)

    # ----------------------------------------------------------------------------------------------
    # Requests

    def submit(self, request: Request) -> Handle:
        """Queue a request; a bad one raises RequestError naming its field (nothing else is touched)."""
        reason = ("the oracle drafter drafts one-hot tokens (greedy only)"
                  if isinstance(self.setup.drafter, (OracleDrafter, OracleTraceDrafter))
                  else "the engine was built without sampling")
        request = check_request(request, vocab_size=self.setup.target.vocab_size,
                                context_len=self.setup.context_len, sampling=self.sampling,
                                greedy_only_reason=reason)
        if self.reference is not None and request.draft_reference is None:
            raise RequestError("draft_reference", "this engine's drafter replays a reference; give the prompt "
                               "and its continuation")
        if self.reference is None and request.draft_reference is not None:
            raise RequestError("draft_reference", "this engine's drafter does not replay a reference")
        if self.paged is not None:
            self.paged.check(request)
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
            if self.paged is not None:  # a step still in flight may write them: it runs before any later step
                self.paged.release(handle.slot)
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
            if not self.waiting or (self.paged is not None and not self.paged.admit(slot, self.waiting[0].request)):
                break  # FIFO: a request waits for pages as it waits for a slot
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

    def _dispatch(self) -> "PendingStep | None":
        """Enqueue one step's prefill and decode on the device; nothing waits for them here."""
        c = self.setup.prefill_chunk
        prefilling = [h for h in self.table if h is not None and h.status == PREFILL]
        decoding = [h for h in self.table if h is not None and h.status == DECODING]
        first = emitted = n_new = verified = overflow = None
        final = []
        if self.paged is not None:
            self._grow_pages(prefilling, decoding)
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
            first, = self._call("prefill", sampling.greedy, tokens, counts, is_final, sampling)
            self.stats.prefill_calls += 1
        if self.overlap is not None:
            if decoding or final:
                emitted, n_new, verified, decoding = self._decode_halves(decoding, final)
        elif decoding and (shape := self._compact_shape(decoding)) is not None:  # the decoding rows only
            emitted, n_new, verified, overflow = self._decode_compact(decoding, *shape)
        elif decoding:
            active = np.zeros(self.slots, bool)
            active[[h.slot for h in decoding]] = True
            sampling = self._sampling(decoding)
            emitted, n_new, verified = self._call("decode", sampling.greedy, active, sampling)
            self.stats.decode_calls += 1
            self.stats.rows_drafted += len(decoding) if self.setup.uses_drafter else 0
            self.stats.forward_tokens += self._forward_tokens()
        self.stats.steps += 1
        for h in final:  # the device holds its first token: the next step decodes it
            h.status = DECODING
        if first is None and emitted is None:
            return None
        return PendingStep(final, decoding, first, emitted, n_new, verified, overflow)

    def _call(self, which: str, greedy: bool, *args) -> tuple:
        """Run executable `which` (prefill, decode) on the params, the state and `args`, keep the state it
        returns -> its other outputs. Paged K/V: over the narrowest page-table window (`PagedKV.window`)."""
        state = self.state
        if self.paged is not None:
            window = self.paged.window()
            ready = self._extras_ready is None or (f"{which}@{window}", greedy) in self._extras_ready
            if window < self.paged.layout.pages_per_row and ready:
                state, which = dataclasses.replace(state, pages=self.paged.table_window(window)), f"{which}@{window}"
            self.last_window = which.partition("@")[2]
        new, *out = self._exe(which, greedy)(self.target_params, self.draft_params, state, *args)
        self.state = new if state is self.state else dataclasses.replace(new, pages=self.state.pages)
        return tuple(out)

    def _grow_pages(self, prefilling: list[Handle], decoding: list[Handle]) -> None:
        """Paged K/V: pages for what this step writes, and the page table onto the device if it changed."""
        self.stats.add_pages(*self.paged.grow(prefilling, decoding, self.setup.prefill_chunk))
        table = self.paged.table_if_changed()
        if table is not None:
            self.state = dataclasses.replace(self.state, pages=jnp.asarray(table))

    def _collect(self, pending: "PendingStep | None") -> list[Handle]:
        """Read a dispatched step's tokens (the step's one host sync) and hand them to their requests;
        a request that ended meanwhile (finished by an earlier step, cancelled) drops them."""
        if pending is None or not pending.live:
            return []
        first, emitted, n_new, verified, overflow = jax.device_get(
            (pending.first, pending.emitted, pending.n_new, pending.verified, pending.overflow))
        if overflow:
            raise RuntimeError("a compact decode wrote past its window: the host's bound on a row's length is wrong")
        now = time.perf_counter()
        if verified is not None and len(self.setup.stream_sizes) > 1:  # the stream size the step ran
            total = int(np.sum(verified))
            self.stats.forward_tokens += next(n for n in self.setup.stream_sizes if n >= total)
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
        if self.setup.verify == "packed":  # several stream sizes: counted as each step's tokens are read
            return self.setup.token_budget if len(self.setup.stream_sizes) <= 1 else 0
        return self.rows_per_verify * self.setup.block_size

    def _compact_shape(self, decoding: list[Handle]) -> tuple[int, int] | None:
        """(rows, window) of the compact decode for these rows, None for the plain decode. A row's
        committed length is at most what the host read plus one step in flight; the step writes one block."""
        if not self.compact:
            return None
        bs = self.setup.block_size
        need = max(h.prefilled + max(len(h.tokens) - 1, 0) for h in decoding) + 2 * bs
        shape = cp.choose(len(decoding), need, self.slots, self.setup.max_len)
        greedy = all(h.request.temperature == 0 for h in decoding)
        if shape is not None and self._extras_ready is not None and \
                (f"compact{shape[0]}x{shape[1]}", greedy) not in self._extras_ready:
            return None  # still compiling in the background
        return shape

    def _decode_compact(self, decoding: list[Handle], rows: int, window: int):
        """One compact decode of the decoding rows (padding entries repeat the first; all slots: in order)
        -> (emitted, n_new, verified, overflow)."""
        slots = [h.slot for h in decoding]
        if rows == self.slots:  # every row, in order: nothing to gather
            index, valid = np.arange(rows, dtype=np.int32), np.isin(np.arange(rows), slots)
        else:
            index = np.array(slots + [slots[0]] * (rows - len(slots)), np.int32)
            valid = np.arange(rows) < len(slots)
        sampling = self._sampling(decoding)
        decode, put_back = self._exe(f"compact{rows}x{window}", sampling.greedy)
        written, emitted, n_new, verified, overflow = decode(self.target_params, self.draft_params, self.state,
                                                             index, valid, sampling)
        self.state = put_back(self.state, written, index)
        self.stats.decode_calls += 1
        self.stats.compact_calls += 1
        self.stats.rows_drafted += len(decoding) if self.setup.uses_drafter else 0
        self.stats.forward_tokens += rows * self.setup.block_size
        return emitted, n_new, verified, overflow

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
        """Milliseconds one decode call takes with no host work between calls (`step_timing.device_step_ms`)."""
        return device_step_ms(self, calls)
