"""Stop token: a row ends right after emitting it, in AR and speculative decoding alike; the decode ends
once every row has; the harness stops at the end-of-sequence token of the target's folder.

The reference is the budget-only greedy AR output cut after its first stop token, and a target that
counts its own forwards (a host callback inside the compiled loops) tells how many steps ran."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.data.prompt_sets import eos_token_id
from specpilot.decoding import ar, spec
from specpilot.decoding.sampling import SamplingConfig
from specpilot.harness import config_schema, deploy, methods, runner
from specpilot.harness.config_schema import ConfigValueError, build_plans, validate
from specpilot.models.checkpoint import save_hf
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from helpers import random_params

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
TARGET = dense.target(CFG, jnp.float32)
PROMPTS = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 2, 8, 8, 1, 60], [17, 4, 99, 23, 5, 6], [30, 31, 32, 33], [77, 1]]
N = 24  # new tokens per prompt
EXTRA = 17  # the AR reference runs past N so a replayed block never runs off its end
STOP = 47  # greedy AR emits it first at steps 2, 8, never, 20, 5 (checked by test_the_stop_token_...)
FIRST = [2, 8, None, 20, 5]

_FORWARDS = []  # chain length T of every counted target forward, as it runs


@dataclasses.dataclass(frozen=True)
class CountingTarget(dense.Target):
    """The dense target, recording each forward's chain length when it executes (also inside loops)."""

    def forward(self, params, tokens, positions, state, mask, logits_at=None):
        jax.debug.callback(functools.partial(_FORWARDS.append, tokens.shape[1]))
        return super().forward(params, tokens, positions, state, mask, logits_at=logits_at)


def count_steps(run, chain: int) -> int:
    """Forwards of chain length `chain` (1: AR decode steps; Bs: verifications) that `run()` executes."""
    jax.effects_barrier()
    _FORWARDS.clear()
    run()
    jax.effects_barrier()
    return _FORWARDS.count(chain)


@pytest.fixture(scope="module")
def params():
    # A large init std makes logits peaked, so greedy choices are not near-ties between tokens.
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def full(params):
    return ar.generate(TARGET, params, PROMPTS, N + EXTRA).tokens  # [B, N + EXTRA], no stop token


@pytest.fixture(scope="module")
def reference(full):
    return jnp.asarray(dr.replay_reference(PROMPTS, full.tolist()))


def cut(tokens, stop, budgets):
    """Each row's first budget tokens, cut after its first `stop`: the expected output, as lists."""
    out = []
    for row, n in zip(np.asarray(tokens).tolist(), budgets):
        row = row[:n]
        out.append(row[: row.index(stop) + 1] if stop in row else row)
    return out


def padded(rows, n):
    return np.array([r + [-1] * (n - len(r)) for r in rows])


def test_the_stop_token_covers_the_cases(full):
    """Rows stop at different steps (one mid-block for block 8, one at a block's end), one never."""
    for row, k in zip(full[:, :N], FIRST):
        hits = np.flatnonzero(row == STOP)
        assert (int(hits[0]) if hits.size else None) == k


@pytest.mark.parametrize("loop", ar.LOOPS)
def test_ar_output_is_the_budget_run_cut_after_the_stop_token(params, full, loop):
    res = ar.generate(TARGET, params, PROMPTS, N, loop=loop, stop_token=STOP)
    want = cut(full, STOP, [N] * len(PROMPTS))
    np.testing.assert_array_equal(res.tokens, padded(want, N))
    np.testing.assert_array_equal(res.num_generated, [k + 1 if k is not None else N for k in FIRST])
    assert res.as_lists() == want
    assert res.decode_steps == N - 1  # the row that never stops runs to its budget
    # Budgets still hold: row 0's budget ends before its stop token, row 2's before the capacity.
    budgets = np.array([2, N, 10, N, 7])
    res = ar.generate(TARGET, params, PROMPTS, N, loop=loop, stop_token=STOP, budgets=budgets)
    want = cut(full, STOP, budgets)
    np.testing.assert_array_equal(res.tokens, padded(want, N))
    np.testing.assert_array_equal(res.num_generated, [2, 9, 10, 21, 6])
    assert res.decode_steps == 20


def test_ar_stop_token_does_not_recompile_for_other_budgets(params):
    ar.generate(TARGET, params, PROMPTS, N, stop_token=STOP, budgets=[N, 3, 5, 9, 1])
    size = len(ar._CACHE)
    ar.generate(TARGET, params, PROMPTS, N, stop_token=STOP, budgets=[4, N, 1, 2, 8])
    assert len(ar._CACHE) == size


def test_ar_sampled_output_is_cut_the_same_way(params):
    """Sampling draws the same keys per step with and without a stop token."""
    cfg, key = SamplingConfig(temperature=1.0, top_p=0.9), jax.random.key(3)
    free = ar.generate(TARGET, params, PROMPTS, N, cfg, key=key).tokens
    stop = int(free[0, 6])  # a token row 0 samples at step 6 (or earlier)
    for loop in ar.LOOPS:
        res = ar.generate(TARGET, params, PROMPTS, N, cfg, key=key, loop=loop, stop_token=stop)
        np.testing.assert_array_equal(res.tokens, padded(cut(free, stop, [N] * len(PROMPTS)), N))
        assert res.num_generated[0] <= 7


def test_ar_loop_ends_when_every_row_has_stopped(params):
    prompts = [PROMPTS[0], PROMPTS[4]]  # stop at steps 2 and 5
    target = CountingTarget(CFG, "float32")
    assert count_steps(lambda: ar.generate(target, params, prompts, N), 1) == N - 1
    fori = count_steps(lambda: ar.generate(target, params, prompts, N, stop_token=STOP), 1)
    assert fori == 5  # exactly the longest row's steps
    host = count_steps(lambda: ar.generate(target, params, prompts, N, loop="host", stop_token=STOP), 1)
    assert 5 <= host <= 6  # read-backs one step behind: at most one extra step
    res = ar.generate(target, params, prompts, N, stop_token=STOP)
    np.testing.assert_array_equal(res.num_generated, [3, 6])
    assert res.decode_steps == 5


@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("drafts", ["right", "mixed", "wrong"])
def test_spec_equals_ar_with_the_stop_token(params, reference, block_size, drafts):
    shift, wrong_every = {"right": (0, 0), "mixed": (1, 3), "wrong": (1, 0)}[drafts]
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8, shift=shift, wrong_every=wrong_every)
    want = ar.generate(TARGET, params, PROMPTS, N, stop_token=STOP)
    res = spec.generate(TARGET, params, drafter, reference, PROMPTS, N, block_size=block_size,
                        stop_token=STOP)
    np.testing.assert_array_equal(res.tokens, want.tokens)
    np.testing.assert_array_equal(res.num_generated, want.num_generated)
    # tau counts what was emitted: nothing past a stop token
    np.testing.assert_array_equal(res.stats.emitted, res.num_generated - 1)
    assert res.stats.new_tokens == N and res.decode_steps == N - 1
    if drafts == "wrong" or block_size == 1:
        np.testing.assert_array_equal(res.stats.steps, res.num_generated - 1)


def test_spec_loops_agree_with_a_stop_token(params, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8, shift=1, wrong_every=3)
    runs = [spec.generate(TARGET, params, drafter, reference, PROMPTS, N, loop=loop, stop_token=STOP)
            for loop in spec.LOOPS]
    runs.append(spec.generate(TARGET, params, drafter, reference, PROMPTS, N, profile=True, stop_token=STOP))
    for r in runs[1:]:
        np.testing.assert_array_equal(r.tokens, runs[0].tokens)
        np.testing.assert_array_equal(r.stats.steps, runs[0].stats.steps)
        np.testing.assert_array_equal(r.stats.emitted, runs[0].stats.emitted)
        np.testing.assert_array_equal(r.stats.accept_hist, runs[0].stats.accept_hist)


def test_stop_token_inside_an_accepted_block_truncates_there(params, full, reference):
    """Exact drafts, block 8: every step accepts 8 tokens, and the stop tokens at steps 2, 5 and 20
    sit inside the first, first and third blocks; what follows them in the block is dropped."""
    rows = [0, 4, 3]
    prompts, ref = [PROMPTS[i] for i in rows], reference[jnp.asarray(rows)]
    n = N + 16  # without the stop token: ceil(39 / 8) = 5 steps
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8)
    target = CountingTarget(CFG, "float32")
    free = spec.generate(TARGET, params, drafter, ref, prompts, n)
    assert free.stats.num_steps == 5
    res = spec.generate(TARGET, params, drafter, ref, prompts, n, stop_token=STOP)
    np.testing.assert_array_equal(res.tokens, padded(cut(full[rows], STOP, [n] * 3), n))
    np.testing.assert_array_equal(res.num_generated, [3, 6, 21])
    np.testing.assert_array_equal(res.stats.steps, [1, 1, 3])
    np.testing.assert_array_equal(res.stats.emitted, [2, 5, 20])
    np.testing.assert_array_equal(res.stats.accepted, [8, 8, 24])  # upstream's count is untruncated
    assert res.stats.tau == 27 / 5 and res.stats.acceptance_length_upstream == 8.0
    assert res.stats.new_tokens == 21 and res.decode_steps == 20
    verifications = count_steps(lambda: spec.generate(target, params, drafter, ref, prompts, n,
                                                      stop_token=STOP), 8)
    assert verifications == 3  # the loop ended with the last row: fewer steps than the budget needs


def test_stop_token_from_prefill_and_at_the_first_step(params, full, reference):
    stop = int(full[0, 0])  # row 0's prefill token; row 1 emits it at step 1
    assert int(full[1, 1]) == stop and int(full[1, 0]) != stop
    want = ar.generate(TARGET, params, PROMPTS, N, stop_token=stop)
    assert want.num_generated[0] == 1 and want.tokens[0, 0] == stop and (want.tokens[0, 1:] == -1).all()
    assert want.num_generated[1] == 2
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4, shift=1, wrong_every=3)
    res = spec.generate(TARGET, params, drafter, reference, PROMPTS, N, stop_token=stop)
    np.testing.assert_array_equal(res.tokens, want.tokens)
    assert res.stats.steps[0] == 0 and res.stats.emitted[0] == 0


def test_a_stop_token_never_emitted_changes_nothing(params, full, reference):
    unused = next(t for t in range(CFG.vocab_size) if t not in full[:, :N])
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8, shift=1, wrong_every=3)
    a = ar.generate(TARGET, params, PROMPTS, N, stop_token=unused)
    s = spec.generate(TARGET, params, drafter, reference, PROMPTS, N, stop_token=unused)
    free = spec.generate(TARGET, params, drafter, reference, PROMPTS, N)
    np.testing.assert_array_equal(a.tokens, full[:, :N])
    np.testing.assert_array_equal(s.tokens, full[:, :N])
    assert (a.num_generated == N).all() and (s.num_generated == N).all()
    np.testing.assert_array_equal(s.stats.accept_hist, free.stats.accept_hist)
    assert a.decode_steps == s.decode_steps == N - 1


@pytest.mark.parametrize("bad", [128, -1, 1.5, True, "47"])
def test_bad_stop_tokens_are_refused(params, reference, bad):
    with pytest.raises(ValueError, match="stop_token"):
        ar.generate(TARGET, params, PROMPTS, 4, stop_token=bad)
    with pytest.raises(ValueError, match="stop_token"):
        spec.generate(TARGET, params, dr.ReplayDrafter(CFG.vocab_size, 4), reference, PROMPTS, 4,
                      stop_token=bad)


# ---------------------------------------------------------------------------------------------------
# Harness: bench.stop_at_eos


def _word_tokenizer(folder, vocab_size: int, eos: str | None):
    """tokenizer.json with tokens t0 .. t{V-1} (id i is ti) and, if eos is given, tokenizer_config.json."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")).save(
        str(folder / "tokenizer.json"))
    if eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


def test_eos_token_id_reads_the_folder(tmp_path):
    assert eos_token_id(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [9, 3]}))
    assert eos_token_id(tmp_path) == 9
    _word_tokenizer(tmp_path, 64, None)
    assert eos_token_id(tmp_path) == 9
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "t12"}}))
    assert eos_token_id(tmp_path) == 12  # the tokenizer's own eos comes first


def test_eos_token_id_of_smollm2_is_im_end():
    """Against transformers reading the converted SmolLM2 folder."""
    import glob

    folders = glob.glob("/tmp/smolcache/gguf/*/tokenizer_config.json")
    if not folders:
        pytest.skip("no converted SmolLM2 folder under /tmp/smolcache/gguf")
    transformers = pytest.importorskip("transformers")

    folder = folders[0].rsplit("/", 1)[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert eos_token_id(folder) == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def _compose(overrides):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    config_schema.register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return config_schema.typed(compose(config_name="config", overrides=list(overrides)))


def test_stop_at_eos_without_a_tokenizer_is_refused(tmp_path, params):
    cfg = _compose(["target=tiny_random", "drafter=none", "decoding=ar", "bench=default", "bench.stop_at_eos=true"])
    with pytest.raises(ConfigValueError, match="bench.stop_at_eos: a random-weight target has no tokenizer"):
        validate(cfg)
    save_hf(params, CFG, tmp_path)  # config.json without eos_token_id, no tokenizer
    cfg = _compose(["target=hf", f"target.path={tmp_path}", "drafter=none", "decoding=ar", "bench=default",
                    "bench.stop_at_eos=true"])
    with pytest.raises(ConfigValueError, match="bench.stop_at_eos: the checkpoint .* names no end-of-sequence"):
        validate(cfg)


def test_harness_stops_every_method_at_the_eos(tmp_path, params):
    """An hf folder whose tokenizer names as its eos a token the AR run emits mid-way: AR and stock both
    stop there, token forcing checks each row up to its end, and decode tokens count the longest row's
    steps."""
    save_hf(params, CFG, tmp_path)
    overrides = ["target=hf", f"target.path={tmp_path}", "target.dtype=float32", "drafter=oracle",
                 "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=2.5", "drafter.num_taps=2",
                 "decoding=stock", "decoding.profile_split=false", "bench=default", "bench.num_prompts=4",
                 "bench.batch_size=2", "bench.new_tokens=24", "bench.prompt_len=6"]
    free_cfg = _compose(overrides)
    free_dep = deploy.build(free_cfg, build_plans(free_cfg))
    assert free_dep.stop_token is None
    free = np.array(methods.run_plan(free_dep, build_plans(free_cfg)[0]).tokens)
    # the eos: a token some row emits first at step >= 3 and another row never emits
    eos = next(t for t in range(CFG.vocab_size)
               if any(row[:3].tolist().count(t) == 0 and t in row for row in free)
               and any(t not in row for row in free))
    _word_tokenizer(tmp_path, CFG.vocab_size, f"t{eos}")
    cfg = _compose(overrides + ["bench.stop_at_eos=true"])
    validate(cfg)
    plans = build_plans(cfg)
    dep = deploy.build(cfg, plans)
    assert dep.stop_token == eos and any(f"end-of-sequence token (id {eos})" in n for n in dep.notes)
    ar_plan, stock = plans[0], next(p for p in plans if p.verify == "chain")
    ar_run = methods.run_plan(dep, ar_plan)
    dep.reference_tokens = ar_run.tokens
    want = padded(cut(free, eos, [24] * len(free)), 24)
    assert ar_run.tokens == want.tolist()
    lengths = (want >= 0).sum(axis=1)
    steps = sum(int(lengths[i:i + 2].max()) - 1 for i in range(0, len(lengths), 2))  # batches of 2
    assert ar_run.decode_tokens == steps and (lengths < 24).any() and (lengths == 24).any()
    chain_run = methods.run_plan(dep, stock)
    assert chain_run.tokens == want.tolist() and chain_run.decode_tokens == steps
    forcing = runner.check_by_forcing(dep, ar_plan, stock, ar_run, chain_run, 1e-3)
    assert forcing["mismatches"] == 0 and forcing["outputs_differ"] == 0
    assert forcing["positions"] == int(lengths.sum())
