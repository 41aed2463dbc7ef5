"""Proposers that write kernel variants: template expansion of the Pallas kernels (`template`, on GPUs),
and any OpenAI-compatible endpoint (`llm`, off by default; every ask is recorded in the run folder and a
recorded run replays offline). Both aim at the kernel classes where the cost model says time is lost and
put the variant first in the op's implementation list, XLA after it. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from specpilot import atomic_io
from specpilot.agent import space as sp
from specpilot.agent import templates
from specpilot.harness import kernel_variants as va
from specpilot.agent.proposers import Context, GuidedProposer, Proposal, Proposer, register
from specpilot.costmodel.prediction import format_attribution

OP_OF_CLASS = {"recurrence": "gated_delta_rule", "matmul": "matmul", "lm_head": "matmul"}
PALLAS = ("triton", "mosaic")


def _impl_choice(space: sp.Space, op: str):
    return space.choice(f"kernels.{op}.implementation")


def target_ops(ctx: Context, pallas_only: bool = False) -> list[str]:
    """The ops to write variants of, the largest lost time first (both, matmul first, without attribution)."""
    ordered = [OP_OF_CLASS[name] for name, _ in GuidedProposer.targets(ctx.attribution) if name in OP_OF_CLASS]
    out = []
    for op in ordered + ["matmul", "gated_delta_rule"]:
        choice = _impl_choice(ctx.space, op)
        if op in out or choice is None:
            continue
        if pallas_only and not any(list(v)[0] in PALLAS for v in choice.values):
            continue
        out.append(op)
    return out


def variant_rewrite(v: va.Variant) -> dict:
    return {f"kernels.{v.op}.implementation": [v.name, "xla"]}


@register("template")
class TemplateProposer(Proposer):
    """The Pallas kernels' templates over their knobs, on the ops that lose the most time."""

    name = "template"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        out, taken = [], set()
        for op in target_ops(ctx, pallas_only=True):
            for knobs, v in templates.expansions(op):
                rw = variant_rewrite(v)
                key = sp.rewrite_key(rw)
                if len(out) < n and key not in ctx.tried and key not in taken:
                    taken.add(key)
                    out.append(Proposal(rw, self.name, f"{op} template: {json.dumps(knobs)}", variant=v))
        return out


@dataclasses.dataclass
class LLMConf:
    url: str = ""  # the endpoint's base URL (".../v1"); POST <url>/chat/completions
    model: str = ""
    api_key_env: str | None = None  # the environment variable holding the API key (None: no key)
    timeout_s: float = 120.0
    temperature: float = 0.2
    max_tokens: int | None = None  # the reply's token limit (None: the endpoint's default, which may cut it)
    replay: str | None = None  # a recorded run's llm/ folder: its replies answer, in order, offline

    def __post_init__(self):
        if self.replay:  # the recorded endpoint and model stand unless given
            first = next(iter(read_transcript(self.replay)), {})
            self.url, self.model = self.url or first.get("url", ""), self.model or first.get("model", "")


REFERENCES = {  # op -> (module, function) of its pure-jnp reference, by weight format for matmul
    "matmul": {"bf16": ("pallas_kernels.w12_matmul", "bf16_matmul_reference"),
               "w12": ("pallas_kernels.w12_matmul", "w12_matmul_reference")},
    "gated_delta_rule": {None: ("pallas_kernels.gated_delta_rule", "gated_delta_rule_reference")},
}
TOLERANCES = {
    "matmul": "rows of x that are one-hot must give W's rows exactly; other rows within 2 K 2^-24 (|x| @ |w|) "
              "of a float32-accumulated dot",
    "gated_delta_rule": "o and every state within 1e-5 absolute plus 1e-5 relative",
}
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def reference_source(op: str, weights: str = "bf16") -> str:
    table = REFERENCES[op]
    module, fn = table.get(weights) or next(iter(table.values()))
    return inspect.getsource(getattr(importlib.import_module(module), fn))


def build_prompt(ctx: Context, op: str) -> str:
    weights = str(ctx.incumbent.get("weights") or "bf16")
    att = ctx.attribution or {}
    rows = [f"- stage {r['stage']}: {r['lost_ms']:.3f} ms lost per step" for r in att.get("stages", [])]
    rows += [f"- {r['stage']} kernel class {r['class']}: {r['lost_ms']:.3f} ms lost per step"
             for r in att.get("classes", [])]
    if att.get("measured_ms_per_step") is not None:  # a full `prediction.attribute` report
        rows = format_attribution("incumbent", att, top=5) + rows
    memory = [f"- {json.dumps(rw, sort_keys=True)}" for rw in ctx.seeds[:8]]
    signature = f"def {op}({', '.join(va.SIGNATURES[op])})"
    weight_note = (f"`w` is the weight as the plan holds it ({weights}: "
                   + ("a bf16 [K, N] jax array" if weights == "bf16" else "a specpilot.formats.w12.W12") + "); "
                   "return float32 [..., N]." if op == "matmul" else
                   "shapes as in the reference; return (o, states).")
    return "\n".join([
        f"Write a faster implementation of the op `{op}` for a JAX speculative decoder on this deployment.",
        "", "Where the cost model says time is lost (measured against each part's floor):",
        *(rows or ["- (no attribution yet)"]),
        "", "Mechanisms validated at similar deployments (memory):", *(memory or ["- none yet"]),
        "", f"Already tried at this deployment: {len(ctx.tried)} rewrite(s).",
        "", f"Your module must define `{signature}`. {weight_note}",
        f"It is checked against the reference on fresh random inputs: {TOLERANCES[op]}.",
        f"Imports allowed: {', '.join(va.ALLOWED_IMPORTS)}. No file, network or process access. "
        "Raise NotImplementedError for inputs you do not handle (the reference then runs).",
        "", "The op's pure-jnp reference:", "```python", reference_source(op, weights).rstrip(), "```",
        "", "Reply with the complete module in one ```python code block.",
    ])


def read_transcript(folder: str | Path) -> list[dict]:
    """The asks recorded under a run's `llm/` folder (`round_<r>/ask_<n>.json`), in the order they were asked."""
    folder = Path(folder).expanduser()
    paths = sorted(folder.glob("round_*/ask_*.json"),
                   key=lambda path: (int(path.parent.name.split("_")[1]), int(path.stem.split("_")[1])))
    if not paths:
        raise ValueError(f"agent.llm.replay: no recorded asks (round_<r>/ask_<n>.json) under {folder}; "
                         "name the llm/ folder of a run made with the llm proposer")
    return [json.loads(p.read_text()) for p in paths]


@dataclasses.dataclass
class Ask:
    """One ask in the transcript: what was sent, what came back, what became of it; written to `path`."""

    path: Path | None
    entry: dict

    def update(self, **fields) -> None:
        self.entry.update(fields)
        if self.path is not None:
            atomic_io.write_json(self.path, self.entry, indent=1)


def extract_code(reply: str) -> str | None:
    m = CODE_BLOCK.search(reply or "")
    return m.group(1).strip() + "\n" if m and m.group(1).strip() else None


@register("llm")
class LLMProposer(Proposer):
    """Kernel variants from an OpenAI-compatible chat endpoint (`agent.llm`)."""

    name = "llm"
    system = "You write JAX and Pallas kernels. Reply with code."

    def __init__(self, seed: int = 0, llm: dict | LLMConf | None = None):
        conf = llm if isinstance(llm, LLMConf) else LLMConf(**(llm or {}))
        if not conf.url:
            raise ValueError("agent.proposers names 'llm' but agent.llm.url is not set (an OpenAI-compatible "
                             "endpoint, e.g. http://localhost:8000/v1)")
        if not conf.model:
            raise ValueError("agent.llm.model is not set")
        self.conf, self.seed = conf, seed
        self.record_dir: Path | None = None  # the loop sets <run>/llm/round_<r>: each ask is written there
        self.recorded = iter(read_transcript(conf.replay)) if conf.replay else None

    def ask(self, prompt: str) -> tuple[str, str | None]:
        """The reply's text and why it ended (`finish_reason`: "length" when cut at the token limit); raises
        OSError / ValueError when the endpoint fails or answers nonsense."""
        if self.recorded is not None:
            return self.replay()
        body = {"model": self.conf.model, "temperature": self.conf.temperature,
                "messages": [{"role": "system", "content": self.system}, {"role": "user", "content": prompt}]}
        if self.conf.max_tokens:
            body["max_tokens"] = int(self.conf.max_tokens)
        headers = {"Content-Type": "application/json"}
        if self.conf.api_key_env:
            key = os.environ.get(self.conf.api_key_env)
            if not key:
                raise ValueError(f"agent.llm.api_key_env: ${self.conf.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.conf.url.rstrip("/") + "/chat/completions",
                                     data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.conf.timeout_s) as resp:
            data = json.loads(resp.read().decode())
        try:
            return str(data["choices"][0]["message"]["content"]), data["choices"][0].get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ValueError(f"the endpoint's answer has no choices[0].message.content: {str(data)[:200]}") from None

    def replay(self) -> tuple[str, str | None]:
        """The next recorded reply and its finish reason (a recorded failure fails again)."""
        entry = next(self.recorded, None)
        if entry is None:
            raise ValueError(f"agent.llm.replay: {self.conf.replay} has no more recorded replies")
        if entry.get("reply") is None:
            raise OSError(f"recorded: {entry.get('error')}")
        return str(entry["reply"]), entry.get("finish_reason")

    def begin(self, op: str, prompt: str) -> Ask:
        """The transcript entry of an ask about to be sent (`record_dir/ask_<n>.json`, n after those there)."""
        path = None
        if self.record_dir is not None:
            self.record_dir.mkdir(parents=True, exist_ok=True)
            path = self.record_dir / f"ask_{len(list(self.record_dir.glob('ask_*.json')))}.json"
        return Ask(path, {"url": self.conf.url, "model": self.conf.model, "replay": self.conf.replay, "op": op,
                          "temperature": self.conf.temperature, "system": self.system, "prompt": prompt})

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        ops = target_ops(ctx)
        out, taken = [], set()
        for i in range(n if ops else 0):
            op = ops[i % len(ops)]
            why = f"{op} variant from {self.conf.model}"
            prompt = build_prompt(ctx, op)
            ask, start = self.begin(op, prompt), time.perf_counter()
            try:
                reply, finish = self.ask(prompt)
            except (OSError, ValueError, urllib.error.URLError) as e:
                error = f"{type(e).__name__}: {e}"
                ask.update(reply=None, error=error, elapsed_s=round(time.perf_counter() - start, 3),
                           dropped=f"the endpoint failed: {error}", variant=None, status="dropped")
                out.append(Proposal({}, self.name, why, handle=ask, dropped=f"the endpoint failed: {error}"))
                continue
            ask.entry.update(reply=reply, finish_reason=finish, elapsed_s=round(time.perf_counter() - start, 3))
            code = extract_code(reply)
            if code is None:
                cut = " (cut at its token limit: agent.llm.max_tokens)" if finish == "length" else ""
                dropped = f"the reply has no python code block{cut}: {reply.strip()[:120]!r}"
                ask.update(dropped=dropped, variant=None, status="dropped")
                out.append(Proposal({}, self.name, why, handle=ask, dropped=dropped))
                continue
            v = va.Variant(op, code)
            rw = variant_rewrite(v)
            key = sp.rewrite_key(rw)
            if key in ctx.tried or key in taken:  # the same module again
                ask.update(dropped="the same module as an earlier reply", variant=v.name, status="not proposed")
                continue
            taken.add(key)
            try:  # the loop checks it too; here the reason joins the transcript
                va.static_check(op, code)
            except va.VariantRejected as e:
                dropped = f"variant rejected: {e}"
                ask.update(dropped=dropped, variant=v.name, status="dropped")
                out.append(Proposal(rw, self.name, why, handle=ask, dropped=dropped))
                continue
            ask.update(dropped=None, variant=v.name, rewrite=rw, status="proposed")
            out.append(Proposal(rw, self.name, why, handle=ask, variant=v))
        return out

    def observe(self, proposal: Proposal, s_per_token: float | None, status: str,
                incumbent_s_per_token: float | None = None) -> None:
        """The loop's verdict joins the transcript (why a candidate failed or lost: the run's round_<r>.md)."""
        if isinstance(proposal.handle, Ask):
            proposal.handle.update(status=status, s_per_token=s_per_token)
