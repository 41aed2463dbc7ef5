"""A candidate's workload through the serving engine (`agent.workload: engine`), so batching fields count:
the deployment's prompts run as requests over `bench.batch_size` slots, and a run returns what
`methods.run_plan` returns, so the gate checks the engine's tokens as it checks the harness's. Design
notes: docs/design/agent.md.
"""

from __future__ import annotations

import time

from specpilot.harness.methods import MethodRun
from specpilot.serving.engine import Engine
from specpilot.serving.request import Request

PREFILL_CHUNK = 64  # prompt tokens a prefilling row is fed per engine step (agent.prefill_chunk)


class EngineWorkload:
    """One plan's engine over a deployment; `run()` decodes the deployment's prompts as requests."""

    def __init__(self, dep, plan, *, prefill_chunk: int = PREFILL_CHUNK):
        if float(dep.sampling.temperature) != 0.0:
            raise ValueError("agent.workload=engine: the gate checks greedy outputs; give a greedy deployment "
                             f"(decoding.temperature: 0, got {dep.sampling.temperature})")
        self.dep, self.plan = dep, plan
        self.prompts = [list(p) for p in dep.prompts]
        longest = max(len(p) for p in self.prompts)
        self.engine = Engine.from_plan(dep, plan, slots=int(dep.batch_size), context_len=longest + dep.new_tokens,
                                       prefill_chunk=int(prefill_chunk), sampling=False)
        if self.engine.reference is not None and dep.reference_tokens is None:
            raise RuntimeError("an oracle drafter replays the AR reference's tokens: run the AR reference first")
        self.engine.warm_up()

    def requests(self) -> list:
        replay = self.engine.reference is not None
        out = []
        for i, prompt in enumerate(self.prompts):
            ref = None
            if replay:
                ref = prompt + [int(t) for t in self.dep.reference_tokens[i] if int(t) >= 0]
            out.append(Request(prompt, int(self.dep.new_tokens), stop_token=self.dep.stop_token,
                               draft_reference=ref))
        return out

    def run(self) -> MethodRun:
        engine = self.engine
        engine.stats = type(engine.stats)()
        t0 = time.perf_counter()
        handles = [engine.submit(r) for r in self.requests()]
        engine.run()
        wall = time.perf_counter() - t0
        new = int(self.dep.new_tokens)
        tokens = [list(h.tokens) + [-1] * (new - len(h.tokens)) for h in handles]
        first = max(h.token_s[0] for h in handles if h.token_s) - t0 if any(h.token_s for h in handles) else 0.0
        waves = -(-len(handles) // engine.slots)
        longest = max((len(h.tokens) for h in handles), default=1)
        s = engine.stats
        stats = {"tau": s.tokens_per_row_step, "engine_decode_calls": s.decode_calls,
                 "verify_tokens_per_decode": s.verify_tokens / s.decode_calls if s.decode_calls else None,
                 "forward_tokens_per_decode": s.forward_tokens / s.decode_calls if s.decode_calls else None,
                 "workload": "engine"}
        return MethodRun(tokens, first, max(wall - first, 0.0), waves * max(longest - 1, 0), stats)

