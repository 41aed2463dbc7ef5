"""Training the DFlash-style block drafter against a frozen target (the DFlash recipe): the target
regenerates its own training data, random anchors per sequence, the drafter's own inference code as the
training forward, and held-out tau measured as greedy decoding would (docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from specpilot import atomic_io
from specpilot.data.corpus import Corpus, batch_at, packed_split
from specpilot.data.tokenizer import TextTokenizer
from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models import drafter as drafter_model
from specpilot.models.config import ModelConfig
from specpilot.state import causal_mask, chain_positions
from specpilot.training.common import cross_entropy, make_optimizer, run_training


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """Defaults: the embedded drafter of the default pipeline.

    Measured on 2 CPU cores against the default target: regeneration 30-60 s, 0.5-0.55 s/step with
    two layers on an idle CI-class machine (0.38 s, or 0.25 s with one layer, on 2 pinned cores of
    another Xeon), so 600 steps take 4-6 min. Greedy tau at block 8 on the default benchmark
    prompts (64 x 128 new tokens): 4.58 after the whole default pipeline on 2 CPU cores; 2.7 with
    1 layer x 300 steps (GPU run of the same recipe).
    """

    # Drafter (hidden size, heads and MLP follow the target, as in DFlash)
    num_layers: int = 2
    block_size: int = 8
    tap_layers: tuple[int, ...] | None = None  # None: evenly spaced over the target, last layer included
    num_taps: int = 3
    gamma: float = 4.0  # loss weight exp(-(k-1)/gamma) on draft k (DFlash: 7 for block 16)
    # Regenerated data
    num_sequences: int = 1024
    prompt_len: int = 96
    gen_len: int = 160
    gen_batch: int = 256
    heldout_sequences: int = 32
    # Optimization
    anchors_per_seq: int = 16
    batch_size: int = 16
    steps: int = 600
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # Bookkeeping
    log_every: int = 10
    eval_every: int = 200
    eval_batch: int = 4  # every anchor of a sequence at once: memory grows with anchors x batch
    checkpoint_every: int = 100

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


def spaced_taps(num_layers: int, num_taps: int) -> tuple[int, ...]:
    """Evenly spaced target layers ending at the last one (small targets have no spare top layers)."""
    num_taps = max(1, min(num_taps, num_layers))
    return tuple(sorted({round(num_layers - 1 - i * (num_layers - 1) / max(num_taps, 1))
                         for i in range(num_taps)}))


def drafter_config(cfg: DrafterTrainConfig, target_cfg: ModelConfig,
                   tokenizer: TextTokenizer) -> drafter_model.DrafterConfig:
    if tokenizer.mask_id is None:
        raise ValueError("the tokenizer has no mask token; the block drafter needs one (<|mask|>)")
    taps = cfg.tap_layers or spaced_taps(target_cfg.num_layers, cfg.num_taps)
    return drafter_model.DrafterConfig.for_target(
        target_cfg.with_taps(taps), num_layers=cfg.num_layers, block_size=cfg.block_size,
        tap_layers=taps, mask_token_id=tokenizer.mask_id)


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Regenerated sequences: row i is a prompt (positions < starts[i]) and the target's greedy
    continuation (positions starts[i] .. ends[i]-1, a stop token included); the rest is padding."""

    tokens: np.ndarray  # [N, T] int32
    starts: np.ndarray  # [N] int32
    ends: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, idx) -> "Sequences":
        return Sequences(self.tokens[idx], self.starts[idx], self.ends[idx])


EMPTY = Sequences(np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))


def regenerate(target_params: dict, target_cfg: ModelConfig, prompts: Sequence[Sequence[int]],
               gen_len: int, batch: int, stop_token: int | None = None, progress=None) -> Sequences:
    """Each prompt followed by the target's greedy continuation of up to gen_len tokens (cut after the
    first `stop_token`), right-padded to the longest prompt + gen_len."""
    if len(prompts) == 0:
        raise ValueError("no prompts to regenerate from")
    width = max(len(p) for p in prompts) + gen_len
    tokens = np.zeros((len(prompts), width), np.int32)
    starts = np.array([len(p) for p in prompts], np.int32)
    ends = starts + gen_len
    batch = min(batch, len(prompts))
    target = dense.target(target_cfg, target_params["embed"].dtype)
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i:i + batch]]
        chunk += [chunk[-1]] * (batch - len(chunk))  # one shape for every call (one compile)
        result = generate(target, target_params, chunk, gen_len,
                          cache_len=-(-width // 128) * 128)
        for j, row in enumerate(result.tokens[:min(batch, len(prompts) - i)]):
            hits = np.flatnonzero(row == stop_token) if stop_token is not None else ()
            n = int(hits[0]) + 1 if len(hits) else gen_len
            k = i + j
            tokens[k, :starts[k]] = prompts[k]
            tokens[k, starts[k]:starts[k] + n] = row[:n]
            ends[k] = starts[k] + n
        if progress is not None:
            progress(min(i + batch, len(prompts)))
    return Sequences(tokens, starts, ends)


def target_taps(target_params: dict, target_cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> frozen target taps [B, T, n_taps*H] (no LM head, no gradient)."""
    b, t = tokens.shape
    state = dense.init_state(target_cfg, b, t, target_params["embed"].dtype)
    positions = chain_positions(state, t)
    _, taps, _ = dense.hidden_forward(target_params, target_cfg, dense.embed(target_params, tokens),
                                      positions, state, causal_mask(state, positions))
    return jax.lax.stop_gradient(taps)


def block_logits(params: dict, dcfg: drafter_model.DrafterConfig, target_params: dict,
                 target_cfg: ModelConfig, taps: jax.Array, tokens: jax.Array,
                 anchors: jax.Array) -> jax.Array:
    """Draft logits [B, K, Bs-1, V] for blocks anchored at anchors [B, K] of sequences tokens [B, T]."""
    b, t = tokens.shape
    bs = dcfg.block_size
    cache = drafter_model.init_context_cache(dcfg, b, t, dtype=params["fc"].dtype)
    cache = drafter_model.extend_context(params, dcfg, cache, taps, jnp.zeros((b,), jnp.int32))
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, K]
    blocks = jnp.concatenate([first[..., None], jnp.full((*anchors.shape, bs - 1), dcfg.mask_token_id,
                                                         jnp.int32)], axis=-1)  # [B, K, Bs]

    def one(anchor, block):  # anchor [B], block [B, Bs]: one block per sequence
        hidden, _ = drafter_model.draft_block(params, dcfg, target_params, target_cfg,
                                              cache.with_lengths(anchor), block)
        return hidden[:, 1:]  # [B, Bs-1, H]

    hidden = jax.vmap(one, in_axes=(1, 1), out_axes=1)(anchors, blocks)  # [B, K, Bs-1, H]
    return dense.lm_head(target_params, target_cfg, hidden)


def block_labels(tokens: jax.Array, anchors: jax.Array, block_size: int,
                 ends: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """([B, K, Bs-1] tokens at anchor + 1 .. anchor + Bs-1, [B, K, Bs-1] whether each lies before its
    sequence's end, `ends` [B]; None: the row's length)."""
    idx = anchors[..., None] + jnp.arange(1, block_size, dtype=jnp.int32)  # [B, K, Bs-1]
    ends = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32) if ends is None else ends
    valid = idx < ends[:, None, None]
    labels = jax.vmap(lambda row, i: row[i])(tokens, jnp.minimum(idx, tokens.shape[1] - 1))
    return labels, valid


def draw_anchors(key: jax.Array, k: int, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """[B, K] anchors uniform in [lo[b], hi[b]] (inclusive) for each row b."""
    u = jax.random.uniform(key, (lo.shape[0], k))
    span = (hi - lo + 1).astype(jnp.float32)[:, None]
    return jnp.minimum(lo[:, None] + jnp.floor(u * span).astype(jnp.int32), hi[:, None])


def position_weights(block_size: int, gamma: float) -> jax.Array:
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)  # draft k: exp(-(k-1)/gamma)


def accepted_drafts(logits: jax.Array, labels: jax.Array, valid: jax.Array) -> jax.Array:
    """[B, K]: drafts greedy verification accepts (a label past the sequence's end is never accepted)."""
    return jnp.cumprod((jnp.argmax(logits, -1) == labels) & valid, axis=-1).sum(-1)


def make_train_step(cfg: DrafterTrainConfig, dcfg, target_cfg: ModelConfig, optimizer):
    weights = position_weights(cfg.block_size, cfg.gamma)

    def loss_fn(params, target_params, tokens, anchors, ends):
        taps = target_taps(target_params, target_cfg, tokens)
        logits = block_logits(params, dcfg, target_params, target_cfg, taps, tokens, anchors)
        labels, valid = block_labels(tokens, anchors, cfg.block_size, ends)
        loss = cross_entropy(logits, labels, weights * valid)
        return loss, accepted_drafts(logits, labels, valid).mean()

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, batch: tuple):
        target_params, tokens, starts, ends = batch
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        # The anchor at starts-1 (the prompt's last token) drafts the continuation's first tokens; the
        # last anchor keeps one label inside the sequence.
        anchors = draw_anchors(key, cfg.anchors_per_seq, starts - 1, jnp.maximum(ends - 2, starts - 1))
        (loss, accepted), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], target_params, tokens, anchors, ends)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        return ({"params": params, "opt_state": opt_state, "step": state["step"] + 1},
                {"loss": loss, "train_accepted": accepted})  # mean accepted drafts per anchor
    return train_step


def walk_tau(accepted: np.ndarray, first, last=None) -> float:
    """Greedy tau from accepted drafts per anchor [N, A]: row i starts at anchor index first[i] and jumps
    n + 1, while the anchor index is below last[i] (None: the row's end); ints apply to every row."""
    accepted = np.asarray(accepted)
    first = np.broadcast_to(np.asarray(first), (len(accepted),))
    last = np.broadcast_to(np.asarray(accepted.shape[1] if last is None else last), (len(accepted),))
    emitted = steps = 0
    for row, i, end in zip(accepted, first, last):
        i = int(i)
        while i < min(int(end), len(row)):
            emitted += int(row[i]) + 1
            steps += 1
            i += int(row[i]) + 1
    return emitted / max(steps, 1)


def make_eval_fn(cfg: DrafterTrainConfig, dcfg, target_cfg: ModelConfig, target_params: dict,
                 sequences: Sequences):
    """Held-out loss over every anchor inside the held-out regenerated continuations, and their tau."""
    weights = position_weights(cfg.block_size, cfg.gamma)
    # Anchor start-1 (the prompt's last token) trains but decoding never drafts there: prefill emits
    # the token at `start`, and decoding's first block is anchored there.
    lo = int(sequences.starts.min()) - 1
    anchors = np.arange(lo, sequences.tokens.shape[1] - 1, dtype=np.int32)

    @jax.jit
    def one_batch(params, target_params, tokens, starts, ends):
        taps = target_taps(target_params, target_cfg, tokens)
        a = jnp.broadcast_to(jnp.asarray(anchors), (tokens.shape[0], len(anchors)))
        logits = block_logits(params, dcfg, target_params, target_cfg, taps, tokens, a)
        labels, valid = block_labels(tokens, a, cfg.block_size, ends)
        inside = (a >= starts[:, None] - 1)[..., None] & valid
        return cross_entropy(logits, labels, weights * inside), accepted_drafts(logits, labels, valid)

    def eval_fn(state: dict) -> dict:
        losses, accepted = [], []
        for i in range(0, len(sequences), cfg.eval_batch):
            rows = sequences.rows(slice(i, i + cfg.eval_batch))
            loss, acc = one_batch(state["params"], target_params, jnp.asarray(rows.tokens),
                                  jnp.asarray(rows.starts), jnp.asarray(rows.ends))
            losses.append(float(loss))
            accepted.append(np.asarray(acc))
        # decoding's first anchor is each row's start; the last one sits before its final token
        return {"heldout_loss": float(np.mean(losses)),
                "heldout_tau": walk_tau(np.concatenate(accepted), first=sequences.starts - lo,
                                        last=sequences.ends - 1 - lo)}

    return eval_fn


def window_prompts(cfg: DrafterTrainConfig, corpus: Corpus,
                   tokenizer: TextTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(train [N, P], held-out [M, P]) prompts: windows of the corpus's train / held-out splits."""
    windows = packed_split(corpus, tokenizer, "train", cfg.prompt_len)
    held = packed_split(corpus, tokenizer, "heldout", cfg.prompt_len)
    rng = np.random.default_rng([cfg.seed, 7])
    prompts = windows[rng.choice(len(windows), size=min(cfg.num_sequences, len(windows)), replace=False)]
    held_prompts = held[np.linspace(0, len(held) - 1, min(cfg.heldout_sequences, len(held))).astype(int)]
    return prompts, held_prompts


def regenerated_data(cfg: DrafterTrainConfig, prompts: tuple, target_params: dict,
                     target_cfg: ModelConfig, out_dir: Path, stop_token: int | None = None,
                     progress: bool = True) -> tuple[Sequences, Sequences]:
    """(train, held-out) regenerated sequences from (train, held-out) prompts, cached in out_dir (no train
    prompts: no train sequences)."""
    path = out_dir / "regenerated.npz"
    train_prompts, held_prompts = ([list(map(int, p)) for p in part] for part in prompts)
    # What the sequences depend on; a checksum of the target's weights catches a retrained target.
    digest = hashlib.sha256(json.dumps([train_prompts, held_prompts]).encode()).hexdigest()[:16]
    key = json.dumps([digest, cfg.gen_len, stop_token,
                      float(sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(target_params)))])
    cached = load_sequences(path, key)
    if cached is not None:
        return cached
    bar = tqdm(total=len(train_prompts) + len(held_prompts), desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    train = regenerate(target_params, target_cfg, train_prompts, cfg.gen_len, cfg.gen_batch, stop_token,
                       lambda n: bar.update(n - bar.n)) if train_prompts else EMPTY
    heldout = regenerate(target_params, target_cfg, held_prompts, cfg.gen_len, cfg.gen_batch, stop_token,
                         lambda n: bar.update(len(train_prompts) + n - bar.n))
    bar.close()
    save_sequences(path, key, train, heldout, seconds=time.perf_counter() - t0)
    return train, heldout


def save_sequences(path: Path, key: str, train: Sequences, heldout: Sequences, seconds: float) -> None:
    """Write the regenerated (train, held-out) sequences and the `key` they were made for, whole or not at
    all (a kill mid-write leaves no file)."""
    with atomic_io.temporary_file(path) as tmp, open(tmp, "wb") as f:  # a file object: savez adds no suffix
        np.savez(f, train=train.tokens, train_starts=train.starts, train_ends=train.ends,
                 heldout=heldout.tokens, heldout_starts=heldout.starts, heldout_ends=heldout.ends, key=key,
                 seconds=seconds)


def load_sequences(path: Path, key: str) -> tuple[Sequences, Sequences] | None:
    """The (train, held-out) sequences cached at `path` for `key`; None when absent, made for another key,
    or unreadable (then removed with a warning, to be regenerated)."""
    def load(p: Path):
        with np.load(p) as data:
            if str(data["key"]) != key:
                return None
            return (Sequences(data["train"], data["train_starts"], data["train_ends"]),
                    Sequences(data["heldout"], data["heldout_starts"], data["heldout_ends"]))
    return atomic_io.read_cache(path, load, "the regenerated drafter data")


def train_drafter(cfg: DrafterTrainConfig, corpus: Corpus, tokenizer: TextTokenizer, target_params: dict,
                  target_cfg: ModelConfig, out_dir: str | Path, *, prompts: tuple | None = None,
                  stop_token: int | None = None, stop_at: int | None = None, export_at_stop: bool = False,
                  train_sequences: Sequences | None = None, data_id: str | None = None,
                  max_minutes: float | None = None, progress: bool = True
                  ) -> tuple[dict, drafter_model.DrafterConfig]:
    """Train (or resume training) the block drafter against the frozen target.

    `prompts`: (train, held-out) token-id prompts the target continues (default: corpus windows of
    `cfg.prompt_len` tokens, `window_prompts`); continuations end after `stop_token` if given.
    `train_sequences`: train on these instead (e.g. `replies.load_replies`; the train prompts must then be
    empty), identified in the checkpoints by `data_id` so a resume on other data is refused.
    `stop_at` ends the run after that step; `export_at_stop` then writes that step's params as the model
    (a checkpoint taken before the learning-rate schedule's end). `max_minutes` ends it after the first
    step past that wall time (checkpointed: the same call again continues).
    Writes `out_dir/regenerated.npz`, `log.jsonl`, `checkpoints/` and, once done, `out_dir/model/`
    (DFlash layout, `drafter.load_drafter`). Returns (float32 drafter params, drafter config).
    """
    out_dir = Path(out_dir)
    dcfg = drafter_config(cfg, target_cfg, tokenizer)
    tcfg = target_cfg.with_taps(dcfg.tap_layers)
    target_params = jax.tree.map(jnp.asarray, target_params)
    prompts = window_prompts(cfg, corpus, tokenizer) if prompts is None else prompts
    if train_sequences is not None and len(prompts[0]):
        raise ValueError("train_sequences replace the train prompts: give an empty train prompt list")
    train, heldout = regenerated_data(cfg, prompts, target_params, tcfg, out_dir, stop_token, progress)
    train = train if train_sequences is None else train_sequences
    if len(train) < cfg.batch_size:
        raise ValueError(f"{len(train)} train sequences cannot fill a batch of {cfg.batch_size}")
    optimizer = make_optimizer(cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.weight_decay,
                               cfg.grad_clip, cfg.min_lr_ratio)
    params = drafter_model.init(jax.random.key(cfg.seed), dcfg, jnp.float32)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    meta = {"kind": "drafter", "seed": cfg.seed, "sequences": len(train),
            "seq_len": int(train.tokens.shape[1]), "batch_size": cfg.batch_size, "steps": cfg.steps,
            "block_size": cfg.block_size, "tap_layers": list(dcfg.tap_layers)}
    if data_id is not None:
        meta["data"] = data_id
    step_fn = make_train_step(cfg, dcfg, tcfg, optimizer)
    order = np.arange(len(train), dtype=np.int32)[:, None]  # batches of row indices

    def batch(step):
        rows = train.rows(batch_at(order, step, cfg.batch_size, cfg.seed)[:, 0])
        return target_params, jnp.asarray(rows.tokens), jnp.asarray(rows.starts), jnp.asarray(rows.ends)

    state, done = run_training(
        state, step_fn, batch, steps=cfg.steps, out_dir=out_dir, meta=meta, log_every=cfg.log_every,
        checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
        eval_fn=make_eval_fn(cfg, dcfg, tcfg, target_params, heldout), stop_at=stop_at, max_minutes=max_minutes,
        tokens_per_step=cfg.batch_size * cfg.anchors_per_seq * (cfg.block_size - 1),
        desc="drafter", progress=progress)
    if done >= cfg.steps or (export_at_stop and stop_at is not None and done >= stop_at):
        drafter_model.save_drafter(out_dir / "model", state["params"], dcfg)
    return state["params"], dcfg
