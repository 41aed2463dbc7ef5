"""Training the DFlash-style block drafter against a frozen target (the DFlash recipe).

Design choices:
- Targets regenerate their own training data: each sequence is a corpus prefix followed by the target's
  greedy continuation (`ar.generate`), and anchors fall only where every label is a greedy token. So the
  labels are exactly what greedy verification accepts, including the target's repetitions.
- Random anchors per sequence, drawn inside the jitted step from (seed, step): a resumed run draws the
  same ones. A block anchored at a is [x_a, MASK x (Bs-1)] at positions a..a+Bs-1, sees the target taps
  of positions < a, and is trained on x_{a+1..a+Bs-1} with weights exp(-(k-1)/gamma) for draft k.
- The forward is the drafter's own inference code: `extend_context` writes the context K/V of all T
  positions once, then `draft_block` runs per anchor (vmapped) on that cache with `lengths = a`, so
  the block overwrites rows a.. and the mask hides the rest. Training and decoding cannot drift apart.
- The target is frozen and runs inside the step (taps only, no LM head) under `stop_gradient`;
  caching taps would cost n_taps*H floats per token of memory to save a forward pass that is a
  minority of the step.
- Held-out metric: `heldout_tau`, exactly the tau of greedy speculative decoding on held-out
  regenerated sequences, without running the decode loop: blocks at every anchor are drafted in
  parallel (teacher-forced context = the target's own greedy tokens, as in decoding), then the host
  walks the anchors decoding would visit (next anchor = anchor + accepted + 1). The plain mean over
  all anchors overstates tau (on GPU runs: 4.2 against a real 2.2): easy stretches hold many anchors
  but cost decoding few steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

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


def regenerate(target_params: dict, target_cfg: ModelConfig, prompts: np.ndarray, gen_len: int,
               batch: int, progress=None) -> np.ndarray:
    """prompts [N, P] -> [N, P + gen_len]: each prompt followed by the target's greedy continuation."""
    out = []
    batch = min(batch, len(prompts))
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        if len(chunk) < batch:  # pad the last chunk so every call has one shape (one compile)
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])
        result = generate(dense.target(target_cfg, target_params["embed"].dtype), target_params,
                          chunk.tolist(), gen_len)
        out.append(np.concatenate([chunk, result.tokens.astype(np.int32)], axis=1))
        if progress is not None:
            progress(min(i + batch, len(prompts)))
    return np.concatenate(out)[:len(prompts)]


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


def block_labels(tokens: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """[B, K, Bs-1]: tokens at anchor + 1 .. anchor + Bs-1."""
    idx = anchors[..., None] + jnp.arange(1, block_size, dtype=jnp.int32)  # [B, K, Bs-1]
    return jax.vmap(lambda row, i: row[i])(tokens, idx)


def draw_anchors(key: jax.Array, batch: int, k: int, lo: int, hi: int) -> jax.Array:
    """[B, K] anchors uniform in [lo, hi] (inclusive)."""
    return jax.random.randint(key, (batch, k), lo, hi + 1, dtype=jnp.int32)


def position_weights(block_size: int, gamma: float) -> jax.Array:
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)  # draft k: exp(-(k-1)/gamma)


def make_train_step(cfg: DrafterTrainConfig, dcfg, target_cfg: ModelConfig, optimizer):
    lo, hi = cfg.prompt_len - 1, cfg.seq_len - cfg.block_size
    weights = position_weights(cfg.block_size, cfg.gamma)

    def loss_fn(params, target_params, tokens, anchors):
        taps = target_taps(target_params, target_cfg, tokens)
        logits = block_logits(params, dcfg, target_params, target_cfg, taps, tokens, anchors)
        labels = block_labels(tokens, anchors, cfg.block_size)
        loss = cross_entropy(logits, labels, weights)
        accepted = jnp.cumprod(jnp.argmax(logits, -1) == labels, axis=-1).sum(-1)  # [B, K]
        return loss, accepted.mean()

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: dict, batch: tuple):
        target_params, tokens = batch
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        anchors = draw_anchors(key, tokens.shape[0], cfg.anchors_per_seq, lo, hi)
        (loss, accepted), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], target_params, tokens, anchors)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        return ({"params": params, "opt_state": opt_state, "step": state["step"] + 1},
                {"loss": loss, "train_accepted": accepted})  # mean accepted drafts per anchor
    return train_step


def walk_tau(accepted: np.ndarray, first: int) -> float:
    """Greedy tau from accepted drafts per anchor [N, A]: start at anchor index `first`, jump n + 1."""
    emitted = steps = 0
    for row in np.asarray(accepted):
        i = first
        while i < len(row):
            emitted += int(row[i]) + 1
            steps += 1
            i += int(row[i]) + 1
    return emitted / max(steps, 1)


def make_eval_fn(cfg: DrafterTrainConfig, dcfg, target_cfg: ModelConfig, target_params: dict,
                 sequences: np.ndarray):
    """Held-out loss over every anchor of the held-out regenerated sequences, and their greedy tau."""
    weights = position_weights(cfg.block_size, cfg.gamma)
    # Anchor P-1 (last prompt token) trains but decoding never drafts there: prefill emits token P.
    anchors = np.arange(cfg.prompt_len - 1, cfg.seq_len - cfg.block_size + 1, dtype=np.int32)

    @jax.jit
    def one_batch(params, target_params, tokens):
        taps = target_taps(target_params, target_cfg, tokens)
        a = jnp.broadcast_to(jnp.asarray(anchors), (tokens.shape[0], len(anchors)))
        logits = block_logits(params, dcfg, target_params, target_cfg, taps, tokens, a)
        labels = block_labels(tokens, a, cfg.block_size)
        accepted = jnp.cumprod(jnp.argmax(logits, -1) == labels, axis=-1).sum(-1)  # [B, A]
        return cross_entropy(logits, labels, weights), accepted

    def eval_fn(state: dict) -> dict:
        losses, accepted = [], []
        for i in range(0, len(sequences), cfg.eval_batch):
            loss, acc = one_batch(state["params"], target_params,
                                  jnp.asarray(sequences[i:i + cfg.eval_batch]))
            losses.append(float(loss))
            accepted.append(np.asarray(acc))
        return {"heldout_loss": float(np.mean(losses)),
                "heldout_tau": walk_tau(np.concatenate(accepted), first=1)}
    return eval_fn


def regenerated_data(cfg: DrafterTrainConfig, corpus: Corpus, tokenizer: TextTokenizer,
                     target_params: dict, target_cfg: ModelConfig, out_dir: Path,
                     progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(train [N, T], held-out [M, T]) regenerated sequences, cached in out_dir (deterministic)."""
    path = out_dir / "regenerated.npz"
    # What the sequences depend on; a checksum of the target's weights catches a retrained target.
    key = json.dumps([cfg.num_sequences, cfg.prompt_len, cfg.gen_len, cfg.heldout_sequences, cfg.seed,
                      float(sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(target_params)))])
    if path.exists():
        data = np.load(path)
        if str(data["key"]) == key:
            return data["train"], data["heldout"]
    windows = packed_split(corpus, tokenizer, "train", cfg.prompt_len)
    held = packed_split(corpus, tokenizer, "heldout", cfg.prompt_len)
    rng = np.random.default_rng([cfg.seed, 7])
    prompts = windows[rng.choice(len(windows), size=min(cfg.num_sequences, len(windows)), replace=False)]
    held_prompts = held[np.linspace(0, len(held) - 1, min(cfg.heldout_sequences, len(held))).astype(int)]
    from tqdm.auto import tqdm
    bar = tqdm(total=len(prompts) + len(held_prompts), desc="regenerate", disable=not progress)
    t0 = time.perf_counter()
    train = regenerate(target_params, target_cfg, prompts, cfg.gen_len, cfg.gen_batch,
                       lambda n: bar.update(n - bar.n))
    heldout = regenerate(target_params, target_cfg, held_prompts, cfg.gen_len, cfg.gen_batch,
                         lambda n: bar.update(len(prompts) + n - bar.n))
    bar.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(path, train=train, heldout=heldout, key=key, seconds=time.perf_counter() - t0)
    return train, heldout


def train_drafter(cfg: DrafterTrainConfig, corpus: Corpus, tokenizer: TextTokenizer, target_params: dict,
                  target_cfg: ModelConfig, out_dir: str | Path, *, stop_at: int | None = None,
                  progress: bool = True) -> tuple[dict, drafter_model.DrafterConfig]:
    """Train (or resume training) the block drafter against the frozen target.

    Writes `out_dir/regenerated.npz`, `log.jsonl`, `checkpoints/` and, once done, `out_dir/model/`
    (DFlash layout, `drafter.load_drafter`). Returns (float32 drafter params, drafter config).
    """
    out_dir = Path(out_dir)
    dcfg = drafter_config(cfg, target_cfg, tokenizer)
    tcfg = target_cfg.with_taps(dcfg.tap_layers)
    target_params = jax.tree.map(jnp.asarray, target_params)
    train, heldout = regenerated_data(cfg, corpus, tokenizer, target_params, tcfg, out_dir, progress)
    optimizer = make_optimizer(cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.weight_decay,
                               cfg.grad_clip, cfg.min_lr_ratio)
    params = drafter_model.init(jax.random.key(cfg.seed), dcfg, jnp.float32)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    meta = {"kind": "drafter", "seed": cfg.seed, "sequences": int(train.shape[0]), "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "steps": cfg.steps, "block_size": cfg.block_size,
            "tap_layers": list(dcfg.tap_layers)}
    step_fn = make_train_step(cfg, dcfg, tcfg, optimizer)
    state, done = run_training(
        state, step_fn,
        lambda step: (target_params, jnp.asarray(batch_at(train, step, cfg.batch_size, cfg.seed))),
        steps=cfg.steps, out_dir=out_dir, meta=meta, log_every=cfg.log_every,
        checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
        eval_fn=make_eval_fn(cfg, dcfg, tcfg, target_params, heldout), stop_at=stop_at,
        tokens_per_step=cfg.batch_size * cfg.anchors_per_seq * (cfg.block_size - 1),
        desc="drafter", progress=progress)
    if done >= cfg.steps:
        drafter_model.save_drafter(out_dir / "model", state["params"], dcfg)
    return state["params"], dcfg
