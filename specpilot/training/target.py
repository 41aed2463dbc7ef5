"""Pretraining a tiny Qwen3-architecture target on the corpus, so the embedded pair needs no download;
the model is `dense` itself, trained in float32 within a few CPU minutes (docs/design/data-training.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.data.corpus import Corpus, batch_at, packed_split
from specpilot.data.tokenizer import TextTokenizer
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import save_model
from specpilot.training.common import cross_entropy, make_optimizer, run_training


@dataclasses.dataclass(frozen=True)
class TargetTrainConfig:
    """Defaults: the embedded target of the default pipeline.

    Measured on 2 CPU cores: 0.63-0.73 s/step on an idle CI-class machine (0.84 s/step on 2 pinned
    cores of another Xeon), so 480 steps take 5-7 min and reach a held-out loss of 4.10 nats/token
    (3.4 bytes/token). At a fixed budget a smaller model
    won: held-out 4.10 (hidden 128), 4.62 (192), 4.74 (256) after ~6.5 min each. Better targets are
    harder to draft (their greedy output repeats less): tau at block 8 fell from 4.6 to 2.3 when the
    held-out loss went from 4.08 to 3.81, so the default stops where the drafter still reaches tau > 3.
    """

    # Model (Qwen3 architecture): 1.31M parameters, 0.52M of them the tied embedding.
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 384
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024  # positions past seq_len were never trained on
    # Data
    seq_len: int = 256
    batch_size: int = 16
    max_train_bytes: int | None = None  # None: the whole train split (tokenizing takes seconds)
    # Optimization
    steps: int = 480
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # Bookkeeping
    log_every: int = 10
    eval_every: int = 160
    eval_sequences: int = 64
    checkpoint_every: int = 80


def model_config(cfg: TargetTrainConfig, tokenizer: TextTokenizer) -> ModelConfig:
    return ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        tie_word_embeddings=True, qk_norm=True, max_position_embeddings=cfg.max_position_embeddings,
        architecture="Qwen3ForCausalLM", eos_token_id=tokenizer.eos_id)


def train_forward(params: dict, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] -> (logits [B, T, V] float32, taps [B, T, n_taps*H]), positions 0..T-1.

    `dense.forward` over a scratch state of exactly T positions in the weights' dtype: every K/V slot
    is overwritten, so the result is plain causal attention.
    """
    b, t = tokens.shape
    state = dense.init_state(cfg, b, t, params["embed"].dtype)
    logits, taps, _ = dense.chain_forward(params, cfg, tokens, state)
    return logits, taps


def lm_loss(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy over windows tokens [B, T] (T-1 predictions each)."""
    logits, _ = train_forward(params, cfg, tokens[:, :-1])
    return cross_entropy(logits, tokens[:, 1:])


def make_train_step(cfg: ModelConfig, optimizer):
    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, batch: jax.Array):
        loss, grads = jax.value_and_grad(lm_loss)(state["params"], cfg, batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        return new, {"loss": loss, "grad_norm": grad_norm}
    return train_step


def heldout_windows(heldout: np.ndarray, n: int) -> np.ndarray:
    """n windows evenly spaced over the held-out split (covers many files, fixed across runs)."""
    if heldout.shape[0] == 0:
        raise ValueError("the held-out split packs into zero windows; raise heldout_fraction")
    idx = np.unique(np.linspace(0, heldout.shape[0] - 1, min(n, heldout.shape[0])).astype(int))
    return heldout[idx]


_eval_loss = jax.jit(lm_loss, static_argnames="cfg")


@functools.lru_cache(maxsize=8)
def _compiled_train_step(mcfg: ModelConfig, cfg: TargetTrainConfig):
    """One jitted step per (model, training) config: a resumed run in the same process reuses it."""
    optimizer = make_optimizer(cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.weight_decay,
                               cfg.grad_clip, cfg.min_lr_ratio)
    return optimizer, make_train_step(mcfg, optimizer)


def make_eval_fn(cfg: ModelConfig, windows: np.ndarray, batch_size: int):
    batches = [windows[i:i + batch_size] for i in range(0, len(windows), batch_size)]

    def eval_fn(state: dict) -> dict:
        losses = [float(_eval_loss(state["params"], cfg, jnp.asarray(b))) * len(b) for b in batches]
        return {"heldout_loss": sum(losses) / len(windows)}
    return eval_fn


def train_target(cfg: TargetTrainConfig, corpus: Corpus, tokenizer: TextTokenizer, out_dir: str | Path,
                 *, stop_at: int | None = None, progress: bool = True) -> dict:
    """Pretrain (or resume pretraining) the target; returns float32 params.

    Writes `out_dir/log.jsonl` (loss curve), `out_dir/checkpoints/` (resumable state) and, once all
    `cfg.steps` are done, `out_dir/model/` (`checkpointing.load_model`) plus `tokenizer.json`.
    """
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    # +1: a window of seq_len + 1 tokens gives seq_len inputs and seq_len next-token labels.
    train = packed_split(corpus, tokenizer, "train", cfg.seq_len + 1, cfg.max_train_bytes)
    heldout = packed_split(corpus, tokenizer, "heldout", cfg.seq_len + 1)
    tokenize_s = time.perf_counter() - t0
    mcfg = model_config(cfg, tokenizer)
    optimizer, train_step = _compiled_train_step(mcfg, cfg)
    params = dense.init(jax.random.PRNGKey(cfg.seed), mcfg, jnp.float32)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    meta = {"kind": "target", "seed": cfg.seed, "train_windows": int(train.shape[0]),
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "steps": cfg.steps,
            "vocab_size": mcfg.vocab_size, "num_params": mcfg.num_params()}
    state, done = run_training(
        state, train_step,
        lambda step: jnp.asarray(batch_at(train, step, cfg.batch_size, cfg.seed)),
        steps=cfg.steps, out_dir=out_dir, meta=meta, log_every=cfg.log_every,
        checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
        eval_fn=make_eval_fn(mcfg, heldout_windows(heldout, cfg.eval_sequences), cfg.batch_size),
        stop_at=stop_at, tokens_per_step=cfg.batch_size * cfg.seq_len, desc="target", progress=progress)
    if done >= cfg.steps:
        save_model(out_dir / "model", state["params"], mcfg,
                   extra={"train": dataclasses.asdict(cfg), "tokenize_s": round(tokenize_s, 2),
                          "train_windows": int(train.shape[0]), "heldout_windows": int(heldout.shape[0])},
                   tokenizer=tokenizer)
    return state["params"]
