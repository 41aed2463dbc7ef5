"""Proposers of kernel variants: template expansion of the Pallas kernels (each expansion checked against
the op's reference, interpreted on the CPU) and the LLM plugin against a local server replaying recorded
replies (a malformed reply and a wrong kernel are rejected with their reasons; a correct kernel passes),
with the transcript each run leaves and its offline replay."""

import http.server
import json
import os
import subprocess
import sys
import threading
import types

import pytest
from agent_helpers import ROOT, TOY, toy_cfg

from specpilot.agent import kernel_proposers as kp
from specpilot.agent import proposers as props
from specpilot.agent import space as sp
from specpilot.agent import templates
from specpilot.agent import loop as loop_mod
from specpilot.agent.gate import Verdict
from specpilot.harness import kernel_variants as va

INCUMBENT = {"verify": "chain", "weights": "bf16", "block_size": 4}
SHAPES = {"weights": "bf16", "matmul": [[4, 64, 128]], "gated_delta_rule": [[2, 3, 2, 16, 32]]}


def _attribution(classes):
    return {"stages": [{"stage": "verify", "lost_ms": 1.0}],
            "classes": [{"stage": "verify", "class": c, "lost_ms": v} for c, v in classes]}


@pytest.fixture(scope="module")
def hybrid_gpu_space():
    return sp.build_space(toy_cfg("target=tiny_hybrid", "target.dtype=bfloat16"), platform="gpu")


def _loaded(v: va.Variant, tmp_path):
    e = v.spec_entry(tmp_path)
    return va.load(v.op, e["name"], e["path"])


def test_gated_delta_rule_expansions_pass_the_reference_check(tmp_path):
    got = list(templates.expansions("gated_delta_rule"))
    assert len({v.name for _, v in got}) == len(got) > 10
    knobs = [k for k, _ in got]
    assert knobs[:2] == [{"block_v": 16}, {"block_v": 64}] and {"unroll": 4} in knobs
    for k in ({"block_v": 16}, {"unroll": 2}, {"block_v": 64, "num_warps": 2}):
        v = next(v for kk, v in got if kk == k)
        assert f"block_v={k.get('block_v', 32)}," in v.source
        va.static_check("gated_delta_rule", v.source)
        assert va.check("gated_delta_rule", _loaded(v, tmp_path), SHAPES, seed=2)["calls"] == 3


def test_matmul_expansions_pass_the_reference_check(tmp_path):
    got = dict((json.dumps(k), v) for k, v in templates.expansions("matmul"))
    for k in ({"block_n": 64}, {"swapped": True}):
        fn = _loaded(got[json.dumps(k)], tmp_path)
        for weights in ("bf16", "w12"):
            assert va.check("matmul", fn, {**SHAPES, "weights": weights}, seed=4)["calls"] == 3
    # a tiling that cannot cover the shape declines it (the plan falls through to XLA); the check says so
    fn = _loaded(got[json.dumps({"block_n": 256})], tmp_path)
    with pytest.raises(va.VariantRejected, match="declines"):
        va.check("matmul", fn, SHAPES, seed=4)
    with pytest.raises(ValueError, match="unknown knob"):
        templates.source("matmul", {"block_q": 4})


def test_template_proposer_follows_the_gap_and_skips_what_was_tried(hybrid_gpu_space):
    ctx = props.Context(hybrid_gpu_space, INCUMBENT, _attribution([("recurrence", 5.0), ("matmul", 1.0)]), set())
    got = kp.TemplateProposer().propose(ctx, 2)
    assert [list(p.rewrite) for p in got] == [["kernels.gated_delta_rule.implementation"]] * 2
    assert all(p.rewrite[list(p.rewrite)[0]] == [p.variant.name, "xla"] for p in got)
    for p in got:  # the space takes the rewrite: a plan naming the variant first
        fields, plan = hybrid_gpu_space.rewrite("c", INCUMBENT, p.rewrite)
        assert plan.kernels.gated_delta_rule.implementation == (p.variant.name, "xla")
    ctx.tried |= {sp.rewrite_key(p.rewrite) for p in got}
    again = kp.TemplateProposer().propose(ctx, 1)
    assert again[0].variant.name not in {p.variant.name for p in got}
    matmul_first = kp.TemplateProposer().propose(
        props.Context(hybrid_gpu_space, INCUMBENT, _attribution([("matmul", 9.0)]), set()), 1)
    assert matmul_first[0].variant.op == "matmul"
    # on a CPU space (no Pallas kernels offered) the template proposes nothing
    cpu = sp.build_space(toy_cfg(), platform="cpu")
    assert kp.TemplateProposer().propose(props.Context(cpu, INCUMBENT, None, set()), 3) == []


GOOD = """Here is a kernel.

```python
import jax.numpy as jnp
from specpilot.formats.w12 import W12, decode_jnp


def matmul(x, w):
    if isinstance(w, W12):
        w = decode_jnp(w)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
```
"""
WRONG = """```python
import jax.numpy as jnp


def matmul(x, w):
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)[..., ::-1]
```"""
MALFORMED = "I would tile the matmul 128 wide and prefetch the weights."


class _Replay(http.server.BaseHTTPRequestHandler):
    replies: list = []
    seen: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        status, text, *finish = type(self).replies.pop(0)
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                        "finish_reason": finish[0] if finish else "stop"}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def replay_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Replay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, _Replay
    server.shutdown()
    server.server_close()


def test_llm_proposer_against_recorded_replies(replay_server, tmp_path, monkeypatch):
    server, handler = replay_server
    handler.replies = [(200, MALFORMED), (200, WRONG), (200, GOOD), (500, "overloaded"), (200, GOOD)]
    handler.seen = []
    monkeypatch.setenv("TEST_LLM_KEY", "secret-key")
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    llm = kp.LLMProposer(llm={"url": url, "model": "replay", "api_key_env": "TEST_LLM_KEY", "timeout_s": 10})
    space = sp.build_space(toy_cfg(), platform="cpu")
    ctx = props.Context(space, INCUMBENT, _attribution([("matmul", 3.0)]), set(),
                        seeds=[{"weights": "w12"}])
    got = llm.propose(ctx, 4)
    assert len(handler.seen) == 4 and handler.seen[0]["path"] == "/v1/chat/completions"
    assert handler.seen[0]["auth"] == "Bearer secret-key" and handler.seen[0]["body"]["model"] == "replay"
    prompt = handler.seen[0]["body"]["messages"][-1]["content"]
    assert "def bf16_matmul_reference(x" in prompt  # the op's reference source
    assert "kernel class matmul: 3.000 ms lost" in prompt and '{"weights": "w12"}' in prompt  # cost model, memory
    assert "def matmul(x, w)" in prompt
    malformed, wrong, good, failed = got
    assert malformed.dropped.startswith("the reply has no python code block")
    assert failed.dropped.startswith("the endpoint failed: HTTPError")
    assert good.variant.op == "matmul" and good.rewrite == {"kernels.matmul.implementation": [good.variant.name, "xla"]}
    with pytest.raises(va.VariantRejected, match="wrong at"):
        va.check("matmul", _loaded(wrong.variant, tmp_path), SHAPES, seed=1)
    assert va.check("matmul", _loaded(good.variant, tmp_path), SHAPES, seed=1)["calls"] == 3
    # the same module again is not proposed twice
    ctx.tried.add(sp.rewrite_key(good.rewrite))
    assert llm.propose(ctx, 1) == [] and not handler.replies


def test_llm_needs_an_endpoint():
    with pytest.raises(ValueError, match="agent.llm.url is not set"):
        props.make(["llm"], llm=None)
    assert isinstance(props.make(["llm"], llm={"url": "http://x/v1", "model": "m"})[0], kp.LLMProposer)


class _InProcessEvaluator:
    """Stands in for the Dask evaluator: a spec's variants are loaded and checked here, timing is made up."""

    checks = 1

    def __init__(self):
        self.specs = []

    def evaluate(self, specs, progress=None, warm=False):
        out = []
        for i, s in enumerate(specs):
            self.specs.append(s)
            res = {"name": s["name"], "status": "ok", "reason": "", "s_per_token": 1e-3 / (1 + i), "wall_s": [1.0],
                   "tokens": [], "stats": {}, "folder": None}
            try:
                if s.get("variants"):
                    va.load_and_check(s["variants"], s["variant_check"]["shapes"], 11)
            except va.VariantRejected as e:
                res.update(status="variant_rejected", reason=str(e))
            out.append(res)
        return out


class _AcceptingGate:
    def check(self, result, plan, incumbent):
        ok = result["status"] == "ok"
        return Verdict(ok, [] if ok else [f"{result['status']}: {result['reason']}"], speedup=2.0 if ok else None)


def test_the_loop_records_rejected_replies_and_goes_on(replay_server, tmp_path):
    """A round with the LLM proposer: the malformed reply is dropped, the wrong kernel fails its reference
    check on the CPU check stage, the correct one reaches the full stage; each is recorded with why."""
    server, handler = replay_server
    handler.replies, handler.seen = [(200, MALFORMED), (200, WRONG), (200, GOOD)], []
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    agent = loop_mod.agent_conf({"proposers": ["llm"], "per_proposer": 3, "llm": {"url": url, "model": "replay"},
                                 "memory_url": f"sqlite:///{tmp_path / 'memory.db'}"})
    loop = loop_mod.Loop(toy_cfg(), agent, tmp_path / "out", progress=lambda m: None)
    loop.model_cfg = types.SimpleNamespace(hidden_size=64, intermediate_size=128)
    loop.memory.start_run(loop.key, loop.features, loop.versions)
    evaluator = _InProcessEvaluator()
    proposers = props.make(["llm"], llm=agent.llm)
    rows = loop._round(0, _AcceptingGate(), evaluator, proposers, [[1, 2, 3]], None, [], [])
    by = {r["proposer"] + str(i): r for i, r in enumerate(rows["candidates"])}
    statuses = [(r["status"], r["reason"].split(":")[0]) for r in rows["candidates"]]
    assert statuses == [("dropped", "the reply has no python code block"), ("failed", "variant_rejected"),
                        ("accepted", "")], by
    assert [s["stage"] for s in evaluator.specs] == ["check", "check", "full", "full"]  # incumbent + the good one
    good = rows["candidates"][2]
    name = good["fields"]["kernels"]["matmul"]["implementation"][0]
    assert (tmp_path / "out" / "sandbox" / good["name"] / f"{name.split(':')[1]}.py").exists()
    recorded = {c.name: c for c in loop.memory.candidates(loop.key, 0)}
    assert "wrong at" in recorded[rows["candidates"][1]["name"]].reason
    # a resumed loop finds the variant its incumbent may name in the sandbox
    assert name in loop_mod.recover_variants(tmp_path / "out" / "sandbox")


CUT = "```python\nimport jax.numpy as jnp\n\n\ndef matmul(x, w):\n    return jnp.einsum("  # at the token limit
FORBIDDEN = """```python
import os


def matmul(x, w):
    return os.environ
```"""


def test_the_transcript_records_each_ask_and_replays_offline(replay_server, tmp_path):
    """A round of the loop with the LLM proposer leaves <run>/llm/round_0/ask_<n>.json: the endpoint, the prompt
    (the attribution's lines, memory's rewrites), the reply, the time and what became of it; a proposer
    replaying that folder answers the same without the endpoint."""
    server, handler = replay_server
    replies = [(200, MALFORMED), (200, GOOD), (200, FORBIDDEN), (200, CUT, "length")]
    handler.replies, handler.seen = list(replies), []
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    agent = loop_mod.agent_conf({"proposers": ["llm"], "per_proposer": 4, "llm": {"url": url, "model": "replay",
                                                                                 "max_tokens": 512},
                                 "memory_url": f"sqlite:///{tmp_path / 'memory.db'}"})
    loop = loop_mod.Loop(toy_cfg(), agent, tmp_path / "out", progress=lambda m: None)
    loop.model_cfg = types.SimpleNamespace(hidden_size=64, intermediate_size=128)
    loop.memory.start_run(loop.key, loop.features, loop.versions)
    att, seeds = _attribution([("matmul", 3.0), ("attention", 0.5)]), [{"block_size": 8}]
    rows = loop._round(0, _AcceptingGate(), _InProcessEvaluator(), props.make(["llm"], llm=agent.llm),
                       [[1, 2, 3]], att, seeds, [])["candidates"]
    folder = tmp_path / "out" / "llm"
    asks = kp.read_transcript(folder)
    assert sorted(p.name for p in (folder / "round_0").iterdir()) == [f"ask_{i}.json" for i in range(4)]
    for ask, seen, (_, reply, *finish) in zip(asks, handler.seen, replies, strict=True):
        assert (ask["url"], ask["model"], ask["op"]) == (url, "replay", "matmul")
        assert ask["prompt"] == seen["body"]["messages"][-1]["content"] and ask["reply"] == reply
        assert seen["body"]["max_tokens"] == 512 and ask["finish_reason"] == (finish or ["stop"])[0]
        assert ask["elapsed_s"] >= 0
    prompt = asks[0]["prompt"]
    assert "- stage verify: 1.000 ms lost per step" in prompt and "- verify kernel class matmul: 3.000 ms" in prompt
    assert "- verify kernel class attention: 0.500 ms lost" in prompt and '- {"block_size": 8}' in prompt
    no_code, good, forbidden, cut = asks
    assert no_code["dropped"].startswith("the reply has no python code block") and no_code["status"] == "dropped"
    assert forbidden["dropped"].startswith("variant rejected: line 1: imports 'os'"), forbidden["dropped"]
    assert forbidden["status"] == "dropped"
    assert cut["dropped"].startswith("the reply has no python code block (cut at its token limit")
    # the good variant went through the check stage and the gate: its verdict and time are in the transcript
    row = next(r for r in rows if r["status"] == "accepted")
    assert good["dropped"] is None and good["variant"] == row["fields"]["kernels"]["matmul"]["implementation"][0]
    assert good["status"] == "accepted" and good["s_per_token"] == row["s_per_token"]
    assert [r["status"] for r in rows] == ["dropped", "dropped", "dropped", "accepted"]

    # offline: the recorded replies answer in order (the endpoint and model as recorded); then none are left
    asked = len(handler.seen)
    replay = kp.LLMProposer(llm={"replay": str(folder)})
    assert (replay.conf.url, replay.conf.model) == (url, "replay")
    ctx = props.Context(loop.space, loop.incumbent, att, set(), seeds)
    again = replay.propose(ctx, 5)
    assert len(handler.seen) == asked
    assert [p.dropped.split(":")[0] if p.dropped else p.variant.name for p in again] == [
        "the reply has no python code block", good["variant"], "variant rejected",
        "the reply has no python code block (cut at its token limit", "the endpoint failed"]
    assert "has no more recorded replies" in again[-1].dropped
    with pytest.raises(ValueError, match="no recorded asks"):
        kp.LLMConf(replay=str(tmp_path))


def _agent_command(tmp_path, run, llm):
    return [sys.executable, str(ROOT / "experiments" / "agent.py"), *TOY, "agent.rounds=1", "agent.workers=1",
            "agent.repeats=1", "agent.heldout=4", "agent.prompts_per_round=1", "agent.proposers=[llm]",
            "agent.per_proposer=2", f"agent.llm={llm}", f"agent.memory_url=sqlite:///{tmp_path / run / 'memory.db'}",
            f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / run / 'out'}",
            f"hydra.run.dir={tmp_path / run / 'hydra'}"]


@pytest.mark.slow
def test_a_recorded_run_through_the_sandbox_and_the_gate_replays_offline(replay_server, tmp_path):
    """experiments/agent.py with the llm proposer against the replaying endpoint, as a user runs it (Dask, the
    sandbox, the real gate): the transcript holds each reply's fate; the same command given the transcript
    instead of the endpoint judges the same replies the same way without asking anything."""
    server, handler = replay_server
    handler.replies, handler.seen = [(200, MALFORMED), (200, GOOD)], []
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run(_agent_command(tmp_path, "live", f"{{url: {url}, model: replay}}"), cwd=tmp_path,
                           capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    asks = kp.read_transcript(tmp_path / "live" / "out" / "llm")
    assert len(asks) == len(handler.seen) == 2 and asks[1]["reply"] == GOOD
    assert asks[0]["status"] == "dropped" and asks[0]["dropped"].startswith("the reply has no python code block")
    good = asks[1]
    assert good["variant"].startswith("variant:") and good["status"] in ("accepted", "rejected"), good
    assert good["s_per_token"] > 0  # reference-checked in the sandbox, timed, and judged by the gate
    assert f"{good['variant']}" in (tmp_path / "live" / "out" / "round_0.md").read_text()

    handler.replies = []  # the endpoint has nothing more to say: the replay must not ask it
    folder = tmp_path / "live" / "out" / "llm"
    again = subprocess.run(_agent_command(tmp_path, "replayed", f"{{replay: {folder}}}"), cwd=tmp_path,
                           capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    replayed = kp.read_transcript(tmp_path / "replayed" / "out" / "llm")
    assert len(handler.seen) == 2 and [a["reply"] for a in replayed] == [MALFORMED, GOOD]
    assert [a["replay"] for a in replayed] == [str(folder)] * 2 and replayed[0]["url"] == url
    assert replayed[0]["dropped"] == asks[0]["dropped"] and replayed[1]["variant"] == good["variant"]
    assert replayed[1]["status"] in ("accepted", "rejected") and replayed[1]["s_per_token"] > 0
