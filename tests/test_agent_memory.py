"""The loop's memory: per-candidate transactions, resume points, nearest-deployment retrieval."""

import multiprocessing
import os
import signal

from specpilot.agent import memory as mem
from specpilot.agent.space import rewrite_key


def _features(hidden, layers, gpu="cpu", batch=1):
    return {"target": {"hidden_size": hidden, "num_layers": layers, "intermediate_size": 3 * hidden,
                       "vocab_size": 512, "dtype": "float32"}, "drafter": {"source": "random"}, "gpu": gpu,
            "batch": batch, "plan": {"verify": "chain"}}


def test_rounds_and_candidates_persist(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    m = mem.Memory(url)
    assert m.start_run("k", _features(128, 4), {"jax": "x"}) is False
    m.record_candidate("k", 0, name="c0", proposer="guided", rewrite_key='{"block_size": 4}',
                       rewrite={"block_size": 4}, fields=None, status="failed", reason="exit 1: boom")
    m.finish_round("k", 0, {"verify": "ar"}, 1e-3, 9e-4)
    again = mem.Memory(url)  # another driver on the same file
    assert again.start_run("k", _features(128, 4), {}) is True
    assert again.last_round("k").index == 0 and again.last_round("k").incumbent == {"verify": "ar"}
    assert again.tried("k") == {'{"block_size": 4}'}
    assert again.candidates("k")[0].reason == "exit 1: boom"


def _writer(url, n):
    m = mem.Memory(url)
    for i in range(n):
        m.record_candidate("k", 0, name=f"c{i}", proposer="p", rewrite_key=str(i), rewrite={}, fields=None,
                           status="rejected", reason="")
        if i == n - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # killed right after its last commit


def test_committed_candidates_survive_kill_9(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    mem.Memory(url)
    p = multiprocessing.get_context("spawn").Process(target=_writer, args=(url, 5))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert [c.name for c in mem.Memory(url).candidates("k")] == [f"c{i}" for i in range(5)]


def test_retrieval_is_nearest_deployment_first(tmp_path):
    m = mem.Memory(f"sqlite:///{tmp_path / 'm.db'}")
    m.record_mechanism(_features(4096, 36, gpu="h200"), {"weights": "w12"}, {}, 1.3, ["a"], {})  # 8B-like
    m.record_mechanism(_features(128, 4), {"block_size": 4}, {}, 1.1, ["b"], {})  # the toy
    m.record_mechanism(_features(2560, 36, gpu="h200"), {"block_size": 8}, {}, 1.2, ["c"], {})  # 4B-like
    at_4b = [x.rewrite for x in m.retrieve(_features(2560, 36, gpu="h200"))]
    assert at_4b == [{"block_size": 8}, {"weights": "w12"}, {"block_size": 4}]
    # an 8B-validated mechanism comes before the toy's at a new 4B-like deployment with no history
    new = _features(2048, 32, gpu="h200")
    assert [x.rewrite for x in m.retrieve(new)][-1] == {"block_size": 4}
    assert mem.distance(new, _features(2048, 32, gpu="h200")) == 0.0
    # the same deployment through the serving engine: a step further than through the harness
    engine = {**_features(2560, 36, gpu="h200"), "workload": "engine"}
    assert mem.distance(engine, _features(2560, 36, gpu="h200")) == 1.0
    m.record_mechanism(engine, {"block_size": 6}, {}, 1.05, ["d"], {})
    assert [x.rewrite for x in m.retrieve(engine)][:2] == [{"block_size": 6}, {"block_size": 8}]


def test_clear_losses_travel_to_near_deployments_only(tmp_path):
    m = mem.Memory(f"sqlite:///{tmp_path / 'm.db'}")
    at_8b, at_4b, toy = _features(4096, 36, gpu="h200"), _features(2560, 36, gpu="h200"), _features(128, 4)
    m.start_run("r8", at_8b, {})
    ar, w12, blk = {"verify": "ar", "block_size": None}, {"verify": "chain", "weights": "w12"}, {"block_size": 8}
    for name, fields, gain in (("ar", ar, 0.28), ("w12", w12, 0.87), ("blk", blk, 0.4)):
        m.record_candidate("r8", 1, name=name, proposer="guided", rewrite_key=name, rewrite={}, fields=fields,
                           status="rejected", reason="", s_per_token=1.0, gain=gain)
    m.record_candidate("r8", 1, name="crash", proposer="optuna", rewrite_key="crash", rewrite={}, fields=blk,
                       status="failed", reason="exit 1")
    near = m.losses(at_4b)
    # only the clear losses (under 0.5x), keyed by the full plan; a near miss is judged again
    assert set(near) == {rewrite_key(ar), rewrite_key(blk)}
    assert "0.28x" in near[rewrite_key(ar)] and "r8" in near[rewrite_key(ar)]
    assert m.losses(toy) == {}  # the toy is far from the 8B shape
