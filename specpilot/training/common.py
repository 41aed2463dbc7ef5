"""What target pretraining and drafter training share: the optimizer (AdamW, clipping, warm-up and cosine
decay), a JSON-lines log and a resumable loop whose data is a pure function of the step
(docs/design/data-training.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from specpilot import atomic_io
from specpilot.training.checkpointing import Checkpointer, abstract_of


def make_optimizer(learning_rate: float, steps: int, warmup_steps: int, weight_decay: float,
                   grad_clip: float, min_lr_ratio: float = 0.1,
                   b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
    warmup_steps = max(1, min(warmup_steps, steps - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(steps, warmup_steps + 1), end_value=learning_rate * min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(grad_clip),
                       optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))


class JsonlLog:
    """Append-only JSON-lines log; `truncate_after(step)` drops records of steps a resume will redo (and a
    torn last line), rewriting the file whole."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [json.dumps(r) for r in self.read() if r.get("step", 0) <= step]
        atomic_io.write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        """The records; a line cut short by a writer killed mid-append is skipped."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return [r for r in out if isinstance(r, dict)]


def cross_entropy(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean (or weighted mean) token cross-entropy in float32. logits [..., V], labels [...]."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    if weights is None:
        return losses.mean()
    weights = jnp.broadcast_to(weights, losses.shape).astype(jnp.float32)
    return (losses * weights).sum() / jnp.maximum(weights.sum(), 1e-9)


def _to_host(metrics: dict) -> dict:
    return {k: float(np.asarray(v)) for k, v in metrics.items()}


def run_training(state: Any, step_fn: Callable, batch_fn: Callable[[int], Any], *, steps: int,
                 out_dir: str | Path, meta: dict, log_every: int, checkpoint_every: int,
                 eval_every: int = 0, eval_fn: Callable[[Any], dict] | None = None,
                 stop_at: int | None = None, max_minutes: float | None = None, tokens_per_step: int = 0,
                 desc: str = "train", progress: bool = True, max_to_keep: int = 2) -> tuple[Any, int]:
    """Run `state, metrics = step_fn(state, batch_fn(step))` from the latest checkpoint to `steps`.

    `meta` (JSON) is saved with each checkpoint; on resume its values must match the saved ones
    (same data, same seed), else the run would silently continue a different experiment.
    `stop_at` ends the run early after saving a checkpoint (an interruption, for tests and budgets);
    `max_minutes` does so after the first step that ends past that wall time (a run in chunks of a time
    budget: the next run resumes there and, the data being a function of the step, matches one run).
    Returns (state, completed steps).
    """
    out_dir = Path(out_dir)
    log = JsonlLog(out_dir / "log.jsonl")
    start = 0
    with Checkpointer(out_dir / "checkpoints", max_to_keep=max_to_keep) as ckpt:
        restored = ckpt.restore_latest(abstract_of(state), meta)
        if restored is not None:
            start, state, _ = restored
        # Commit the state to the device: a fresh (uncommitted) state and the step's committed output
        # are different jit signatures, which would compile the step twice.
        state = jax.device_put(state, jax.devices()[0])
        log.truncate_after(start)
        end = steps if stop_at is None else min(steps, stop_at)
        bar = tqdm(total=steps, initial=start, desc=desc, disable=not progress, dynamic_ncols=True)
        t0, last_t, last_step = time.perf_counter(), time.perf_counter(), start
        deadline = None if max_minutes is None else t0 + 60 * max_minutes
        stopped = end
        for step in range(start, end):
            state, metrics = step_fn(state, batch_fn(step))
            done = step + 1
            bar.update(1)
            if done % log_every == 0 or done == end:
                record = _to_host(metrics)  # deliberate host sync, once per log interval
                now = time.perf_counter()
                rate = (done - last_step) / max(now - last_t, 1e-9)
                record.update(step=done, elapsed_s=round(now - t0, 3), steps_per_s=round(rate, 4))
                if tokens_per_step:
                    record["tokens_per_s"] = round(rate * tokens_per_step, 1)
                log.write(record)
                bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}")
                last_t, last_step = now, done
            if eval_fn is not None and eval_every and (done % eval_every == 0 or done == steps):
                record = _to_host(eval_fn(state))
                record["step"] = done
                log.write(record)
                bar.write(f"{desc} step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in record.items()
                                                                 if k != "step"))
            out_of_time = deadline is not None and done < end and time.perf_counter() >= deadline
            if done % checkpoint_every == 0 or done == end or out_of_time:
                ckpt.save(done, state, meta)
            if out_of_time:
                bar.write(f"{desc}: stopped at step {done} of {steps} ({max_minutes} min); run again to continue")
                stopped = done
                break
        bar.close()
        return state, max(start, stopped)
