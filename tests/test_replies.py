"""The target's replies in shards: the chat request kinds they answer, shards that resume to the data of one
uninterrupted run, settings that differ refused, held-out files never answered, a drafter trained from them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import atomic_io
from specpilot.data import chat
from specpilot.data.corpus import load_corpus
from specpilot.data.tokenizer import train_tokenizer
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.training import replies as rp
from specpilot.training.common import JsonlLog
from specpilot.training.drafter import DrafterTrainConfig, regenerate, train_drafter

MODULE = '''"""Tools for module {i}."""


def scale_{i}(value, factor={i}):
    """Scale a value by {i}."""
    if factor < 0:
        raise ValueError("negative factor")
    return value * factor


def typed_{i}(x: int) -> int:
    """Add {i}."""
    y = x + {i}
    return y


class Box{i}:
    """A box holding one value."""

    def get(self, default=None):
        """Return the value, or default."""
        return default
'''
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                  head_dim=16, max_position_embeddings=512)
SMALL = rp.RepliesConfig(num_replies=24, shard_size=8, temperatures=(0.0, 0.9), top_p=0.9, max_new_tokens=8,
                         slots=4, prefill_chunk=8)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    for i in range(30):
        (root / f"pkg{i % 3}").mkdir(exist_ok=True)
        (root / f"pkg{i % 3}" / f"mod{i}.py").write_text(MODULE.format(i=i))
    return load_corpus(root, heldout_fraction=0.3)


@pytest.fixture(scope="module")
def target():
    return dense.init(jax.random.key(0), CFG, jnp.float32, std=0.5)


def _prompts(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 64, int(k)).tolist() for k in rng.integers(3, 12, n)]


def _shards(folder, n):
    out = []
    for k in range(n):
        with np.load(rp.shard_path(folder, k)) as data:
            out.append({name: data[name] for name in ("tokens", "starts", "ends", "reply", "prompt_index",
                                                      "temperature", "seed", "stopped")})
    return out


# ------------------------------------------------------------------------------------------------------
# Request kinds


def test_new_request_kinds_render_and_split_by_file(corpus):
    train = chat.stdlib_requests(corpus, "train", kinds=chat.ALL_KINDS, every_kind=True)
    held = chat.stdlib_requests(corpus, "heldout", kinds=chat.ALL_KINDS, every_kind=True)
    assert {r.kind for r in train} == set(chat.ALL_KINDS)
    train_files = {r.where.rsplit(":", 1)[0] for r in train}
    held_files = {r.where.rsplit(":", 1)[0] for r in held}
    assert train_files == set(corpus.train_files) and held_files == set(corpus.heldout_files)
    assert not train_files & held_files
    # Per file: scale (11 function kinds, `errors` among them), typed (no type_hints: it is annotated; no
    # errors), Box.get (no errors), the class twice, the module once.
    per_file = {f: [r.kind for r in train if r.where.startswith(f + ":")] for f in corpus.train_files}
    for kinds in per_file.values():
        assert len(kinds) == 11 + 9 + 10 + 2 + 1
        assert kinds.count("errors") == 1 and kinds.count("type_hints") == 2 and kinds.count("module") == 1
    scale = [r for r in train if r.kind == "parameters" and "scale_" in r.text][0]
    assert "List the parameters of `pkg" in scale.text and "def scale_" in scale.text
    klass = [r for r in train if r.kind == "class"][0]
    assert klass.text.endswith('"""A box holding one value."""\n```') and klass.where.endswith(":17")
    # The shipped kinds are untouched: the same requests as asking for them alone.
    shipped = chat.stdlib_requests(corpus, "train", every_kind=True)
    assert shipped == [r for r in train if r.kind in chat.REQUEST_KINDS]
    tok = train_tokenizer(corpus.texts("train"), vocab_size=300)
    prompts, kept = chat.chat_prompt_ids(tok, TEMPLATE, train, 10**6)
    assert len(prompts) == len(train) and tok.decode(prompts[-1]).startswith("<|im_start|>user\nGive an overview")


def test_bad_kinds_are_refused(corpus):
    with pytest.raises(ValueError, match="request kind must be one of .*'poem'"):
        chat.stdlib_requests(corpus, "train", kinds=("explain", "poem"), every_kind=True)
    with pytest.raises(ValueError, match="class and module kinds need every_kind=True"):
        chat.stdlib_requests(corpus, "train", kinds=("explain", "class"))


# ------------------------------------------------------------------------------------------------------
# Shards


def test_a_resumed_run_writes_the_shards_of_one_run(target, tmp_path):
    prompts = _prompts()
    whole = rp.generate_replies(SMALL, target, CFG, prompts, tmp_path / "whole", stop_token=5, progress=False)
    assert (whole.done, whole.total, whole.written) == (3, 3, 3) and whole.complete
    # A run whose time is up after its first shard stops there (the first shard always runs) ...
    first = rp.generate_replies(SMALL, target, CFG, prompts, tmp_path / "parts", stop_token=5, max_minutes=1e-9,
                                progress=False)
    assert (first.done, first.written, first.complete) == (1, 1, False)
    with pytest.raises(rp.RepliesError, match=r"holds 1 of the 3 shards .*missing: \[1, 2\].*stage=replies"):
        rp.load_replies(tmp_path / "parts", SMALL.num_replies)
    # ... a shard cut short by a kill is rebuilt, and the next run finishes the rest.
    rp.shard_path(tmp_path / "parts", 1).write_bytes(b"PK\x03\x04 torn")
    with pytest.warns(atomic_io.CacheRebuildWarning, match="replies shard"):
        rest = rp.generate_replies(SMALL, target, CFG, prompts, tmp_path / "parts", stop_token=5, progress=False)
    assert (rest.done, rest.written) == (3, 2)
    for a, b in zip(_shards(tmp_path / "whole", 3), _shards(tmp_path / "parts", 3)):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # A finished folder is left alone.
    again = rp.generate_replies(SMALL, target, CFG, prompts, tmp_path / "parts", stop_token=5, progress=False)
    assert again.written == 0 and again.complete


def test_replies_follow_the_order_greedy_equals_the_target(target, tmp_path):
    prompts = _prompts()
    rp.generate_replies(SMALL, target, CFG, prompts, tmp_path, stop_token=5, progress=False)
    seqs, info = rp.load_replies(tmp_path, SMALL.num_replies)
    order = rp.reply_order(SMALL, len(prompts))
    assert seqs.tokens.dtype == np.int32 and len(seqs) == 24 and info["shards"] == 3
    np.testing.assert_array_equal(info["prompt_index"], order.prompt[:24])
    assert sorted(order.prompt[:16]) == list(range(16)) and list(info["temperature"]) == [0.0] * 16 + [0.9] * 8
    greedy = regenerate(target, CFG, [prompts[i] for i in info["prompt_index"][:16]], 8, batch=16, stop_token=5)
    for i in range(16):
        np.testing.assert_array_equal(seqs.tokens[i, :seqs.ends[i]], greedy.tokens[i, :greedy.ends[i]])
    for i in range(16, 24):  # sampled replies start with their prompt and stay in the vocabulary
        p = prompts[info["prompt_index"][i]]
        assert seqs.tokens[i, :len(p)].tolist() == p and seqs.starts[i] == len(p)
    reply = lambda i: seqs.tokens[i, seqs.starts[i]:seqs.ends[i]].tolist()  # noqa: E731
    greedy_of = {int(info["prompt_index"][i]): reply(i) for i in range(16)}
    assert any(reply(i) != greedy_of[int(info["prompt_index"][i])] for i in range(16, 24))  # sampled at 0.9
    with np.load(rp.shard_path(tmp_path, 0)) as data:
        assert data["tokens"].dtype == np.uint16  # a vocabulary below 65,536 ids


def test_other_settings_are_refused_naming_them(target, tmp_path):
    prompts = _prompts()
    one = rp.RepliesConfig(num_replies=8, shard_size=8, max_new_tokens=4, slots=4, prefill_chunk=8)
    rp.generate_replies(one, target, CFG, prompts, tmp_path, stop_token=5, progress=False, about={"kinds": ["a"]})
    manifest = json.loads((tmp_path / rp.MANIFEST).read_text())
    assert manifest["key"]["temperatures"] == [0.0] and manifest["key"]["kinds"] == ["a"]
    cases = [(dict(cfg=rp.RepliesConfig(**{**vars(one), "temperatures": (0.0, 0.7)})), "temperatures"),
             (dict(cfg=rp.RepliesConfig(**{**vars(one), "seed": 1})), "'seed'"),
             (dict(prompts=_prompts(seed=1)), "'prompts'"),
             (dict(params=jax.tree.map(lambda x: x * 2, target)), "'target'"),
             (dict(about={"kinds": ["b"]}), "'kinds'")]
    for change, named in cases:
        args = {**dict(cfg=one, params=target, prompts=prompts, about={"kinds": ["a"]}), **change}
        with pytest.raises(rp.RepliesError, match=f"other settings .*{named}"):
            rp.generate_replies(args["cfg"], args["params"], CFG, args["prompts"], tmp_path, stop_token=5,
                                about=args["about"], progress=False)
    # Execution settings are not part of the key: more slots, a larger target count.
    more = rp.RepliesConfig(**{**vars(one), "slots": 8, "num_replies": 16})
    assert rp.generate_replies(more, target, CFG, prompts, tmp_path, stop_token=5, about={"kinds": ["a"]},
                               progress=False).written == 1
    with pytest.raises(ValueError, match=r"num_replies=40, but 16 prompts x 2 temperatures give 32 replies"):
        rp.generate_replies(rp.RepliesConfig(num_replies=40, temperatures=(0.0, 0.5)), target, CFG, prompts,
                            tmp_path / "x", stop_token=5, progress=False)
    with pytest.raises(ValueError, match="replies.policy must be one of"):
        rp.RepliesConfig(policy="eager").check()
    with pytest.raises(rp.RepliesError, match="no replies in"):
        rp.load_replies(tmp_path / "none")


def test_replies_come_from_train_files_only(corpus, tmp_path):
    tok = train_tokenizer(corpus.texts("train"), vocab_size=300)
    requests = chat.stdlib_requests(corpus, "train", kinds=chat.ALL_KINDS, every_kind=True)
    prompts, kept = chat.chat_prompt_ids(tok, TEMPLATE, requests, 160)
    cfg = ModelConfig(**{**vars(CFG), "vocab_size": tok.vocab_size})
    params = dense.init(jax.random.key(1), cfg, jnp.float32, std=0.5)
    one = rp.RepliesConfig(num_replies=8, shard_size=8, max_new_tokens=4, slots=8, prefill_chunk=64)
    rp.generate_replies(one, params, cfg, prompts, tmp_path, stop_token=tok.eos_id,
                        sources=[{"kind": r.kind, "where": r.where} for r in kept], progress=False)
    _, info = rp.load_replies(tmp_path)
    files = {s["where"].rsplit(":", 1)[0] for s in info["sources"]}
    assert len(info["sources"]) == len(prompts) and files <= set(corpus.train_files)
    assert not files & set(corpus.heldout_files)
    assert {info["sources"][i]["kind"] for i in info["prompt_index"]} <= set(chat.ALL_KINDS)


# ------------------------------------------------------------------------------------------------------
# Training from shards


TINY = DrafterTrainConfig(num_layers=1, block_size=4, num_taps=2, gamma=2.0, gen_len=8, gen_batch=4,
                          anchors_per_seq=3, batch_size=4, steps=3, learning_rate=1e-2, warmup_steps=1,
                          log_every=1, eval_every=3, eval_batch=2, checkpoint_every=10)


def _mask_tokenizer():
    """A stand-in for the tokenizer: the drafter needs a mask id inside the target's vocabulary."""
    class Tok:
        mask_id = 63
    return Tok()


def _replies_run(target, folder) -> dict:
    rp.generate_replies(SMALL, target, CFG, _prompts(), folder, stop_token=5, progress=False)
    seqs, info = rp.load_replies(folder, SMALL.num_replies)
    return dict(prompts=([], _prompts(4, seed=3)), stop_token=5, train_sequences=seqs, data_id=info["id"],
                progress=False)


def test_a_drafter_trains_from_the_shards_in_chunks(target, corpus, tmp_path):
    run = _replies_run(target, tmp_path / "replies")
    held = run["prompts"][1]
    # A time budget spent at once: the run stops after one step, checkpointed ...
    train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "d", max_minutes=0.0, **run)
    assert [r["step"] for r in JsonlLog(tmp_path / "d" / "log.jsonl").read()] == [1]
    assert not (tmp_path / "d" / "model").exists()
    # ... and the same call without one continues to the end, held-out tau measured on the held-out prompts
    # (that it ends where one uninterrupted run does: the slow test below).
    train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "d", **run)
    log = JsonlLog(tmp_path / "d" / "log.jsonl").read()
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in log if "heldout_tau" in r] == [3] and (tmp_path / "d" / "model").exists()
    with np.load(tmp_path / "d" / "regenerated.npz") as data:
        assert data["train"].shape[0] == 0 and data["heldout"].shape[0] == 4  # only held-out regenerated
    with pytest.raises(ValueError, match="different settings .*'data'"):  # other replies: refused on resume
        train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "d", **{**run, "data_id": "x"})
    with pytest.raises(ValueError, match="empty train prompt list"):
        train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "e",
                      **{**run, "prompts": (held, held)})


@pytest.mark.slow  # three training runs, ~20 s on 2 cores
def test_a_chunked_drafter_run_ends_where_one_run_does(target, corpus, tmp_path):
    run = _replies_run(target, tmp_path / "replies")
    train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "chunked", max_minutes=0.0, **run)
    chunked, _ = train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "chunked", **run)
    whole, _ = train_drafter(TINY, corpus, _mask_tokenizer(), target, CFG, tmp_path / "whole", **run)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    first = JsonlLog(tmp_path / "chunked" / "log.jsonl").read()
    assert [r["loss"] for r in first if "loss" in r] == [r["loss"] for r in JsonlLog(
        tmp_path / "whole" / "log.jsonl").read() if "loss" in r]
