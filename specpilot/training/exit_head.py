"""Training an exit head (`models.exit_head`) against a frozen target with the drafter's data recipe: the
target's own greedy replies to chat prompts, held-out prompts never trained on (docs/design/data-training.md).

At each reply position the label is the target's greedy next token and the head reads the target's first
`exit_layer` layers there (teacher-forced, one forward). Cross-entropy over the head's ids makes its softmax
estimate the chance that a token is the target's greedy choice: what a greedy tree's acceptance needs.
The features are computed once; training steps only run the head.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from specpilot.models import dense, draft_vocab
from specpilot.models import exit_head
from specpilot.models.config import ModelConfig
from specpilot.models.drafter_checkpoint import PACKAGED
from specpilot.state import causal_mask, chain_positions
from specpilot.training.common import cross_entropy, make_optimizer, run_training
from specpilot.training.drafter import DrafterTrainConfig, Sequences, regenerated_data


@dataclasses.dataclass(frozen=True)
class ExitHeadTrainConfig:
    """Defaults: a head for SmolLM2-135M-Instruct after 8 of its 30 layers, rank 128 (~0.15M params),
    over the packaged drafter's 8,192-token draft vocabulary (conf/train_exit_head_smollm2.yaml)."""

    exit_layer: int = 8
    rank: int = 128
    vocab: int | None = 8192  # ids scored: the first `vocab` of the ranking; None: the whole vocabulary
    # a .npy token ranking, or a packaged drafter's name (its draft_vocab.npy); None: the train replies' counts
    vocab_ranking: str | None = None
    # Regenerated data (the drafter's recipe: greedy replies up to the stop token)
    gen_len: int = 128
    gen_batch: int = 64
    feature_batch: int = 16  # sequences per teacher-forced forward when reading the features
    # Optimization (over reply positions)
    batch_size: int = 1024
    steps: int = 2000
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # Bookkeeping
    log_every: int = 50
    eval_every: int = 500
    checkpoint_every: int = 500


def ranking_path(name: str) -> Path:
    """A ranking file: `name` itself, or the draft_vocab.npy of the packaged drafter named `name`."""
    path = Path(name).expanduser()
    if not path.exists() and "/" not in name and (PACKAGED / name / draft_vocab.RANKING_FILE).is_file():
        return PACKAGED / name / draft_vocab.RANKING_FILE
    return path


def head_ids(cfg: ExitHeadTrainConfig, vocab_size: int, train: Sequences) -> np.ndarray:
    """The sorted token ids the head scores (`cfg.vocab` of them, or every id)."""
    if cfg.vocab is None:
        return np.arange(vocab_size, dtype=np.int32)
    if cfg.vocab_ranking is not None:
        ranking = draft_vocab.load_ranking(ranking_path(cfg.vocab_ranking), vocab_size, "exit_head.vocab_ranking")
    else:
        counts = np.zeros(vocab_size, np.int64)
        for row, s, e in zip(train.tokens, train.starts, train.ends):
            np.add.at(counts, row[s:e], 1)
        ranking = draft_vocab.ranking_from_counts(counts)
    return draft_vocab.select(ranking, cfg.vocab, vocab_size, "exit_head.vocab")


@functools.partial(jax.jit, static_argnames=("cfg", "exit_layer"))
def _exit_hidden(params, cfg: ModelConfig, tokens, exit_layer: int):
    state = dense.init_state(cfg, tokens.shape[0], tokens.shape[1], params["embed"].dtype)
    positions = chain_positions(state, tokens.shape[1])
    x, _, _ = dense.hidden_forward(params, cfg, dense.embed(params, tokens), positions, state,
                                   causal_mask(state, positions), exit_layer=exit_layer)
    return x.astype(jnp.float32)


def reply_features(target_params: dict, target_cfg: ModelConfig, seqs: Sequences, exit_layer: int, ids,
                   batch: int, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(features [M, H] float32: the final-normed hidden after `exit_layer` layers at every position whose
    next token is a reply token, labels [M]: that token's index in `ids`); positions whose label is outside
    `ids` are left out (no node there can be drafted from a reduced vocabulary)."""
    index = np.full(target_cfg.vocab_size, -1, np.int64)
    index[np.asarray(ids)] = np.arange(len(ids))
    feats, labels = [], []
    order = np.argsort(seqs.ends, kind="stable")  # similar lengths together: little padding per forward
    for i in tqdm(range(0, len(seqs), batch), desc=f"features (layer {exit_layer})", disable=not progress):
        rows = seqs.rows(order[i:i + batch])
        width = -(-int(rows.ends.max()) // 64) * 64  # a few compiled widths
        tokens = np.zeros((batch, width), np.int32)
        n = min(width, rows.tokens.shape[1])
        tokens[:len(rows), :n] = rows.tokens[:, :n]
        hidden = np.asarray(_exit_hidden(target_params, target_cfg, jnp.asarray(tokens), exit_layer))
        for j, (s, e) in enumerate(zip(rows.starts, rows.ends)):
            pos = np.arange(s - 1, e - 1)
            lab = index[rows.tokens[j, pos + 1]]
            keep = lab >= 0
            feats.append(hidden[j, pos[keep]])
            labels.append(lab[keep])
    return np.concatenate(feats), np.concatenate(labels).astype(np.int32)


def make_train_step(rows: jax.Array, eps: float, optimizer):
    def loss_fn(params, x, y):
        logits = exit_head.logits(params, rows, x, eps)
        return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, batch: tuple):
        x, y = batch
        (loss, top1), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], x, y)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss, "top1": top1}
    return train_step


def evaluate(params: dict, rows: jax.Array, eps: float, feats: np.ndarray, labels: np.ndarray,
             chunk: int = 4096) -> dict:
    """Held-out loss and top-1 agreement with the target's greedy token (the head's argmax is it)."""
    f = jax.jit(lambda p, x, y: (cross_entropy(exit_head.logits(p, rows, x, eps), y) * x.shape[0],
                                 jnp.sum(jnp.argmax(exit_head.logits(p, rows, x, eps), -1) == y)))
    loss = hits = 0.0
    for i in range(0, len(labels), chunk):
        a, b = f(params, jnp.asarray(feats[i:i + chunk]), jnp.asarray(labels[i:i + chunk]))
        loss, hits = loss + float(a), hits + float(b)
    n = max(len(labels), 1)
    return {"heldout_loss": loss / n, "heldout_top1": hits / n}


def train_exit_head(cfg: ExitHeadTrainConfig, prompts: tuple, target_params: dict, target_cfg: ModelConfig,
                    out_dir: str | Path, *, stop_token: int | None = None, progress: bool = True
                    ) -> tuple[dict, np.ndarray, exit_head.ExitHeadConfig, dict]:
    """Train (or resume) an exit head for the frozen target on its greedy replies to `prompts`
    ((train, held-out) token-id prompts). Writes `out_dir/regenerated.npz`, `log.jsonl`, `checkpoints/`
    and, once done, `out_dir/model/` (`exit_head.load`). Returns (params, ids, config, held-out metrics
    of the untrained exit and of the trained head)."""
    out_dir = Path(out_dir)
    if not 1 <= cfg.exit_layer < target_cfg.num_layers:
        raise ValueError(f"exit_head.exit_layer must be in 1..{target_cfg.num_layers - 1} (below the target's "
                         f"{target_cfg.num_layers} layers), got {cfg.exit_layer}")
    target_params = jax.tree.map(jnp.asarray, target_params)
    t0 = time.perf_counter()
    data_cfg = DrafterTrainConfig(gen_len=cfg.gen_len, gen_batch=cfg.gen_batch)
    train, heldout = regenerated_data(data_cfg, prompts, target_params, target_cfg, out_dir, stop_token, progress)
    ids = head_ids(cfg, target_cfg.vocab_size, train)
    feats, labels = reply_features(target_params, target_cfg, train, cfg.exit_layer, ids, cfg.feature_batch,
                                   progress)
    held_feats, held_labels = reply_features(target_params, target_cfg, heldout, cfg.exit_layer, ids,
                                             cfg.feature_batch, progress)
    data_s = time.perf_counter() - t0
    hcfg = exit_head.ExitHeadConfig(cfg.exit_layer, target_cfg.hidden_size, cfg.rank, len(ids),
                                    target_cfg.vocab_size, target_cfg.num_layers)
    rows = draft_vocab.head_rows(target_params, target_cfg, ids).astype(jnp.float32)
    eps = target_cfg.rms_norm_eps
    params = exit_head.init(jax.random.key(cfg.seed), hcfg)
    untrained = evaluate(params, rows, eps, held_feats, held_labels)
    optimizer = make_optimizer(cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.weight_decay,
                               cfg.grad_clip, cfg.min_lr_ratio)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    meta = {"kind": "exit_head", "seed": cfg.seed, "positions": int(len(labels)), "exit_layer": cfg.exit_layer,
            "rank": cfg.rank, "num_ids": int(len(ids)), "batch_size": cfg.batch_size, "steps": cfg.steps}

    def batch(step):  # a pure function of the step: a resumed run draws the same positions
        idx = np.random.default_rng([cfg.seed, step]).integers(0, len(labels), cfg.batch_size)
        return jnp.asarray(feats[idx]), jnp.asarray(labels[idx])

    state, done = run_training(
        state, make_train_step(rows, eps, optimizer), batch, steps=cfg.steps, out_dir=out_dir, meta=meta,
        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
        eval_fn=lambda s: evaluate(s["params"], rows, eps, held_feats, held_labels),
        tokens_per_step=cfg.batch_size, desc="exit head", progress=progress)
    trained = evaluate(state["params"], rows, eps, held_feats, held_labels)
    metrics = {"untrained": untrained, "trained": trained}
    if done >= cfg.steps:
        exit_head.save(out_dir / "model", state["params"], hcfg, ids, meta={
            **meta, "train_sequences": len(train), "heldout_sequences": len(heldout),
            "heldout_positions": int(len(held_labels)), "data_s": round(data_s, 1),
            "total_s": round(time.perf_counter() - t0, 1), **metrics})
    return state["params"], ids, hcfg, metrics
